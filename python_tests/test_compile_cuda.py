"""torch.compile of an applied model on a GPU: one graph, eager's numbers, activations moved to the
host inside the compiled graphs. Skipped without one."""

import pytest
import torch
from test_apply import assert_close_runs, batch, loss_and_grads, make_model
from test_compile import aot_graphs, assert_inductor_step_matches_eager_and_offloads, graph_breaks

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_compiled_applied_model_on_a_gpu_matches_eager_and_offloads_to_the_host(offload):
    model = make_model("llama").cuda()
    handle = torch_offload.apply(model, offload=offload, num_shards=2, **({} if offload is None else {"min_bytes": 0}))
    ids = batch().cuda()
    want = loss_and_grads(model, ids)
    before = handle.stats()
    got, (forward, backward) = aot_graphs(model, ids)
    assert_close_runs(want, got)
    assert graph_breaks(model, ids) == (0, [])
    if offload == "cpu":
        assert "torch.ops.torch_offload.store_pack" in forward and "torch.ops.torch_offload.store_unpack" in backward
        after = handle.stats()
        assert after["packed_bytes"] > before["packed_bytes"]
        assert after["live_entries"] == 0 and after["host_bytes"] == 0
    handle.remove()


def test_inductor_on_a_gpu_gives_eager_numbers_with_host_offload():
    model = make_model("gpt2").cuda()
    handle = torch_offload.apply(model, offload="cpu", min_bytes=0, num_shards=2)
    assert_inductor_step_matches_eager_and_offloads(model, handle, batch().cuda())
    handle.remove()
