"""apply() on a GPU, eager: the un-applied model's loss and gradients with activations on the host.
Skipped without one."""

import pytest
import torch
from test_apply import assert_close_runs, batch, loss_and_grads, make_model

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_applied_model_with_host_offload_gives_the_unapplied_loss_and_gradients(name):
    model = make_model(name).cuda()
    ids = batch().cuda()
    want = loss_and_grads(model, ids)
    handle = torch_offload.apply(model, offload="cpu", min_bytes=0, num_shards=2)
    got = loss_and_grads(model, ids)
    stats = handle.stats()
    assert stats["packed_bytes"] > 0 and stats["live_entries"] == 0 and stats["host_bytes"] == 0
    handle.remove()
    # The kernels differ from the module's (memory-efficient attention, sharded GEMMs): float32 rounding apart.
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for key in want[1]:
        scale = max(want[1][key].abs().max().item(), 1e-3)
        torch.testing.assert_close(got[1][key], want[1][key], rtol=1e-4, atol=1e-4 * scale, msg=lambda m: f"{key}: {m}")
    assert_close_runs(want, loss_and_grads(model, ids))  # removed: the model's own step again
