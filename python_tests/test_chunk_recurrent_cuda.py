"""The chunk-recurrent step on a GPU: ``chunk_recurrent_loss`` of a bfloat16 or float16 model on CUDA (Llama and Qwen3;
one row, packed documents, padded rows; chunks of 5 tokens) against the float64 model, with the same
model's own step in the same dtype as the scale of the error; a host budget smaller than the store (the disk tier
used); the step on a second stream; device memory that does not grow with the sequence beyond one layer's keys and
values; a second step allocating no pinned memory; refused under graph capture and past the pinned arena's budget.
Skipped without a GPU."""

import pytest
import torch
from test_chunk_recurrent import batches, gradients, reference
from test_chunk_recurrent_families import build, float64

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Padded rows with their pads' labels ignored: a left pad's query sees no key, which CUDA's SDPA masks may give a
# softmax over its row where the step gives 0; no counted label reads it either way.
KINDS = ["one row", "packed documents", "padded rows, pads ignored"]


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double().cpu() - want).norm() / want.norm().clamp_min(1e-30)).item()


def on_cuda(call: dict) -> dict:
    return {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in call.items()}


def own_step(model, call):
    """The model's own loss (transformers': float32) and gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(**on_cuda(call), use_cache=False).loss
    loss.backward()
    return loss.detach(), gradients(model)


def stepped(model, call, directory, **options):
    model.zero_grad(set_to_none=True)
    arguments = on_cuda(call)
    loss = torch_offload.chunk_recurrent_loss(
        model, arguments.pop("input_ids"), arguments.pop("labels"), chunk_tokens=5, directory=directory,
        **arguments, **options,
    )  # fmt: skip
    loss.backward()
    return loss.detach(), gradients(model)


def assert_as_close_as_the_models_own(got, own, want, dtype):
    """Loss and every gradient: the step's error against float64 (``want``: the model's weights as the dtype rounds
    them) at most 3x the model's own step's, or an eighth of the dtype's epsilon."""
    assert got[1].keys() == want[1].keys()
    pairs = [("loss", got[0], own[0], want[0]), *((n, got[1][n], own[1][n], want[1][n]) for n in want[1])]
    for name, mine, theirs, exact in pairs:
        assert torch.isfinite(mine).all(), name
        bound = max(3 * relative_error(theirs, exact), torch.finfo(dtype).eps / 8)
        assert relative_error(mine, exact) <= bound, (name, relative_error(mine, exact), bound)


def low_precision(name, dtype):
    return build(name).to("cuda", dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["llama", "qwen3"])  # no mixture: its router's ties (test_chunk_recurrent_host_store)
def test_cuda_step_is_as_close_to_float64_as_the_models_own(name, kind, dtype, stores, tmp_path):
    call = dict(batches()[kind])
    arguments = dict(call)
    rounded = float64(build(name).to(dtype))  # the weights as the dtype rounds them: the errors are the arithmetic's
    want = reference(rounded, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    model = low_precision(name, dtype)
    own = own_step(model, call)
    got = stepped(model, call, tmp_path)
    assert got[0].device.type == "cuda"
    assert all(g.dtype == dtype for g in got[1].values())
    assert stores[-1].disk_bytes == 0  # the pinned arena held the whole store
    assert_as_close_as_the_models_own(got, own, want, dtype)


def test_cuda_a_host_budget_smaller_than_the_store_sends_the_oldest_to_disk(stores, tmp_path):
    call = batches()["packed documents"]
    arguments = dict(call)
    rounded = float64(build("llama").bfloat16())
    want = reference(rounded, arguments.pop("input_ids"), arguments.pop("labels"), **arguments)
    model = low_precision("llama", torch.bfloat16)
    own = own_step(model, call)
    got = stepped(model, call, tmp_path, host_budget=4 << 10)
    step = stores[-1]
    assert step.moved_to_disk > 0 and step.peak_host_bytes <= 4 << 10
    assert_as_close_as_the_models_own(got, own, want, torch.bfloat16)


def test_cuda_step_on_a_second_stream(tmp_path):
    call = batches()["padded rows, pads ignored"]
    model = low_precision("qwen3", torch.bfloat16)
    on_default = stepped(model, call, tmp_path)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = stepped(model, call, tmp_path)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(on_side[0], on_default[0])
    for name, gradient in on_default[1].items():
        torch.testing.assert_close(on_side[1][name], gradient, msg=lambda m: f"{name}: {m}")


def test_cuda_device_memory_grows_by_less_than_one_layers_keys_and_values_per_token(tmp_path):
    model = build("llama").to("cuda", torch.bfloat16)
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    keys_and_values = 2 * config.num_key_value_heads * head_dim * 2  # bytes a token of one layer, bfloat16

    def peak(tokens):
        ids = torch.randint(3, 128, (1, tokens), generator=torch.Generator().manual_seed(tokens))
        model.config.max_position_embeddings = tokens
        for _ in range(2):  # the second one measured: the gradients and the kernels' workspaces made once
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            torch_offload.chunk_recurrent_loss(model, ids, ids, chunk_tokens=64, directory=tmp_path).backward()
            torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before

    short, long = peak(512), peak(2048)
    assert (long - short) / (2048 - 512) < keys_and_values, (short, long)


def test_cuda_the_first_step_sizes_the_pinned_arena_for_the_next(stores, tmp_path):
    model = low_precision("llama", torch.bfloat16)
    call = batches()["packed documents"]
    stepped(model, call, tmp_path)
    allocations = torch_offload.pinned_arena_stats()["chunk_allocations"]
    stepped(model, call, tmp_path)
    assert torch_offload.pinned_arena_stats()["chunk_allocations"] == allocations
    assert stores[-1].peak_host_bytes > 0 and stores[-1].disk_bytes == 0


def test_cuda_step_is_refused_under_graph_capture(tmp_path):
    model = low_precision("llama", torch.bfloat16)
    ids = batches()["one row"]["input_ids"].cuda()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="chunk_recurrent_loss: a CUDA graph is being captured"):
        with torch.cuda.graph(graph):
            torch_offload.chunk_recurrent_loss(model, ids, ids, directory=tmp_path)


def test_cuda_a_host_budget_past_the_pinned_arena_is_refused_by_name(tmp_path):
    model = low_precision("llama", torch.bfloat16)
    ids = batches()["one row"]["input_ids"]
    budget = torch_offload.pinned_arena_stats()["budget_bytes"]
    with pytest.raises(ValueError, match=r"chunk_recurrent_loss: host_budget \(\d+ bytes\) is over what the pinned"):
        torch_offload.chunk_recurrent_loss(model, ids, ids, directory=tmp_path, host_budget=budget + 1)
