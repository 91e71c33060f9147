"""apply() on a GPU, eager: the un-applied model's loss and gradients with activations on the host.
Skipped without one."""

import pytest
import torch
from test_apply import assert_close_runs, batch, loss_and_grads, make_model
from test_tiled_mlp import relative_error

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


@pytest.mark.parametrize("packed", [False, True], ids=["one_sequence", "packed_documents"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_applied_model_in_low_precision_is_as_close_to_float64_as_the_unapplied_one(dtype, packed):
    # The dtype users train in, through every op apply() installs (attention_block, segmented when the documents
    # are packed; tiled_mlp; the fused loss): no further from the float64 step than the model's own, 3x at most.
    ids = batch().cuda()
    position_ids = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, -1).cuda() if packed else None

    def run(model):
        return lambda **kwargs: model(position_ids=position_ids, **kwargs)

    exact = make_model("llama").cuda().double()
    want = loss_and_grads(exact, ids, run(exact))
    model = make_model("llama").cuda().to(dtype)
    eager = loss_and_grads(model, ids, run(model))
    handle = torch_offload.apply(model, num_shards=2)
    assert (handle.tiled_mlps, handle.attention_blocks, handle.loss) == (3, 3, "linear_cross_entropy")
    got = loss_and_grads(model, ids, run(model))
    handle.remove()
    pairs = [("loss", got[0], eager[0], want[0])] + [(n, got[1][n], eager[1][n], want[1][n]) for n in want[1]]
    for name, g, e, w in pairs:
        assert g.dtype == e.dtype, name
        tolerance = max(3 * relative_error(e, w), torch.finfo(dtype).eps)
        assert relative_error(g, w) <= tolerance, name
