"""torch.compile of a whole model after torch_offload.apply(): one graph, eager's numbers."""

import hashlib
import warnings
from pathlib import Path

import accelerate.hooks
import peft
import pytest
import torch
from functorch.compile import make_boxed_func
from test_apply import HalveOutput, assert_close_runs, batch, loss_and_grads, make_model, tier_options
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend

import torch_offload
from torch_offload.tiled_mlp import _compiled_num_shards

pytestmark = pytest.mark.torch_range

COMPILED = ["llama", "qwen3", "gemma2", "phi3", "gpt2", "lora"]


def build(name):
    if name != "lora":
        return make_model(name)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
        lora_dropout=0.0,
        init_lora_weights=False,
    )
    return peft.get_peft_model(make_model("llama"), lora)


def applied(name, **options):
    model = build(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # offload="cpu" on a CPU model says it moves nothing
        handle = torch_offload.apply(model, **options)
    return model, handle


def graph_breaks(model, ids):
    """dynamo's graph breaks in a training step's forward (labels: the fused loss), with their reasons."""
    torch._dynamo.reset()
    explained = torch._dynamo.explain(lambda ids: model(input_ids=ids, labels=ids, use_cache=False).loss)(ids)
    return explained.graph_break_count, [reason.reason for reason in explained.break_reasons]


@pytest.mark.parametrize("name", COMPILED)
def test_applied_model_traces_without_graph_break(name):
    model, handle = applied(name, offload=None)
    assert handle.loss == "linear_cross_entropy"
    assert graph_breaks(model, batch()) == (0, [])
    handle.remove()


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_applied_model_matches_eager(name):
    # num_shards=0: tiled_apply's shard count comes from the shapes, as apply() uses it by default.
    model, handle = applied(name, offload=None, num_shards=0 if name in ("phi3", "gpt2") else 2)
    ids = batch()
    want = loss_and_grads(model, ids)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    assert_close_runs(want, loss_and_grads(model, ids, run=compiled))
    handle.remove()


def test_a_compiled_applied_model_honours_accelerate_hooks_put_on_after_its_first_call():
    # The compiled code must be guarded on each projection's forward: accelerate replaces it on the instance.
    def hook_down_projections(model):
        for layer in model.model.layers:
            accelerate.hooks.add_hook_to_module(layer.mlp.down_proj, HalveOutput())

    ids = batch()
    reference = make_model("llama")
    hook_down_projections(reference)
    want = loss_and_grads(reference, ids)
    model, handle = applied("llama", offload=None, num_shards=2)
    assert handle.tiled_mlps == 3
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    loss_and_grads(model, ids, run=compiled)
    hook_down_projections(model)
    assert_close_runs(want, loss_and_grads(model, ids, run=compiled))
    handle.remove()


def test_inductor_compiled_applied_model_matches_eager():
    model, handle = applied("phi3", offload=None, num_shards=2)  # fused projections split, checkpoint, fused loss
    ids = batch()
    want = loss_and_grads(model, ids)
    torch._dynamo.reset()
    got = loss_and_grads(model, ids, run=torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-3, atol=1e-5)
    handle.remove()


# LoRA on the MLPs: tiled_apply's checkpointed shards inside the layer's checkpoint. GPT-2 trips a dynamo assertion
# under dynamic=True ("lift_tracked_freevar_to_input should not be called on root SubgraphTracer", tracing
# its NewGELU inside a checkpoint, the layer's or a shard's); static shapes compile. Plain
# torch.utils.checkpoint around GPT-2's blocks, without torch_offload, fails the same way: pytorch/pytorch#193194,
# fixed in torch 2.15.
@pytest.mark.parametrize(
    "name, offload",
    [
        ("llama", None),
        ("qwen3", None),  # attention_block with its per-head norms (and their epsilon, a float)
        ("lora", None),
        ("llama", "disk"),
        pytest.param(
            "gpt2",
            None,
            marks=pytest.mark.xfail(
                torch.torch_version.TorchVersion(torch.__version__) < "2.15",
                reason="pytorch/pytorch#193194, fixed in torch 2.15",
                strict=True,
            ),
        ),
    ],
)
def test_dynamic_compile_serves_two_lengths_without_recompiling(name, offload, tmp_path):
    model, handle = applied(name, offload=offload, **tier_options(offload, tmp_path, min_bytes=4096))
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    compiles = []
    for length in (24, 40):
        ids = torch.randint(3, 128, (2, length), generator=torch.Generator().manual_seed(length))
        want = loss_and_grads(model, ids)
        assert_close_runs(want, loss_and_grads(model, ids, run=compiled))
        compiles.append(counter.frame_count)
    assert compiles[0] > 0 and compiles[1] == compiles[0]
    if offload:
        assert handle.stats()["disk_bytes"] > 0 and handle.stats()["live_entries"] == 0
    handle.remove()


def test_compiled_shard_count_is_the_ops():
    # What tiled_mlp_num_shards computes under torch.compile (where the op cannot be called): the op's rule.
    for intermediate, gated, dtype in (
        (80, True, torch.float32),
        (14336, True, torch.bfloat16),
        (3072, False, torch.float16),
        (1 << 20, True, torch.float32),
    ):
        for tokens in (0, 1, 2048, 2049, 40000, 1 << 20):
            assert _compiled_num_shards(tokens, intermediate, gated, dtype) == torch.ops.offload.tiled_mlp_num_shards(
                tokens, intermediate, gated, dtype
            )


@pytest.mark.parametrize("name, offload", [(name, "disk") for name in COMPILED] + [("llama", "cpu")])
def test_offloading_applied_model_traces_without_graph_break(name, offload, tmp_path):
    model, handle = applied(name, offload=offload, **tier_options(offload, tmp_path, min_bytes=0))
    assert graph_breaks(model, batch()) == (0, [])
    handle.remove()


def aot_graphs(model, ids):
    """Loss and gradients of one compiled step, and the code of its forward and backward AOT graphs."""
    graphs = []

    def keep(gm, _):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep))
    return loss_and_grads(model, ids, run=compiled), graphs


@pytest.mark.parametrize(
    "name, offload, checkpoint",
    [
        ("llama", "cpu", False),
        ("llama", "cpu", True),
        ("llama", "disk", False),
        ("llama", "disk", True),
        ("lora", "disk", True),
    ],
)
def test_compiled_graph_offloads_saved_activations_through_the_store(name, offload, checkpoint, tmp_path):
    # checkpoint=True: the layers' inputs and their attention's outputs (saved: random ops are not recomputed);
    # whole layers with "cpu", attention only with "disk".
    model, handle = applied(
        name,
        offload=offload,
        checkpoint=checkpoint,
        keep_last=1,
        min_bytes=0,
        num_shards=2,
        **tier_options(offload, tmp_path, offload_cpu_tensors=True),
    )
    recomputed = {False: "none", True: "layer" if offload == "cpu" else "attention"}[checkpoint]
    assert set(list(handle.checkpointing.values())[:-1]) == {recomputed}  # the last layer is kept (keep_last=1)
    ids = batch()
    want = loss_and_grads(model, ids)
    before = handle.stats()
    got, (forward, backward) = aot_graphs(model, ids)
    assert_close_runs(want, got)
    assert "torch.ops.torch_offload.store_pack" in forward and "store_unpack" not in forward
    assert "torch.ops.torch_offload.store_unpack" in backward and "store_pack" not in backward
    after = handle.stats()
    moved = "disk_bytes" if offload == "disk" else "packed_bytes"
    assert after["pack_calls"] > before["pack_calls"] and after[moved] > before[moved]
    restored = after["unpacked_bytes"] + after["live_bytes"] - before["unpacked_bytes"] - before["live_bytes"]
    assert restored == after["packed_bytes"] - before["packed_bytes"]
    assert after["live_entries"] == 0 and after["host_bytes"] == 0
    assert graph_breaks(model, ids) == (0, [])
    handle.remove()
    assert not any("forward" in vars(m) for m in model.modules())


def test_compiled_graph_keeps_the_last_layers_activations(tmp_path):
    packs = []
    for keep_last in (0, 1, 2, 3):
        model, handle = applied(
            "llama", offload="disk", checkpoint=False, keep_last=keep_last, min_bytes=0, spill_directory=str(tmp_path)
        )
        _, (forward, _) = aot_graphs(model, batch())
        packs.append(forward.count("torch.ops.torch_offload.store_pack"))
        handle.remove()
    assert packs[0] > packs[1] > packs[2] > packs[3] == 0
    # Layers alike: each kept one takes one layer's share off (the first offloaded layer packs the rotary
    # tables the later ones share, too).
    assert packs[0] - packs[1] == packs[1] - packs[2]


def assert_inductor_step_matches_eager_and_offloads(model, handle, ids):
    """An inductor-compiled step gives eager apply()'s loss and gradients; the store took bytes and gave all back."""
    want = loss_and_grads(model, ids)
    before = handle.stats()["packed_bytes"]
    torch._dynamo.reset()
    got = loss_and_grads(model, ids, run=torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
    for name in want[1]:
        torch.testing.assert_close(got[1][name], want[1][name], rtol=1e-3, atol=1e-5)
    assert handle.stats()["packed_bytes"] > before and handle.stats()["live_entries"] == 0


def test_inductor_compiled_graph_offloads_the_right_bytes(tmp_path):
    # Inductor reuses dead buffers for later tensors: the store must not take one for another.
    model, handle = applied("gpt2", offload="cpu", min_bytes=0, num_shards=2, offload_cpu_tensors=True)
    assert_inductor_step_matches_eager_and_offloads(model, handle, batch())
    handle.remove()


def test_compile_caches_are_keyed_by_the_loaded_library():
    # A cached backward graph traced from another build's autograd formulas must not be served to this one.
    digest = hashlib.blake2b(Path(torch_offload.library_path()).read_bytes(), digest_size=8).hexdigest()
    assert f"torch_offload-{digest}" in torch.compiler.config.cache_key_tag.split()
