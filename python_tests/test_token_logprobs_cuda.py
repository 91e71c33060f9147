"""token_logprobs on a GPU: against the CPU op in float64, bf16/fp16 against float64 with eager's error as the
scale, no [tokens, V] allocation, a bad id an error. Skipped without a GPU."""

import pytest
import torch
from cuda_allocations import allocation_sizes
from test_token_logprobs import make_inputs, outputs_and_grads, reference, relative_error
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def to_cuda(tensors, dtype=None):
    return [t.detach().to("cuda", dtype).requires_grad_() if t is not None else None for t in tensors]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_cuda_matches_cpu_op_float64(temperature, bias):
    hidden, weight, b, ids = make_inputs((1030, 8), 4099, bias=bias)
    leaves = [t for t in (hidden, weight, b) if t is not None]
    gpu = to_cuda(leaves)
    upstream = [torch.randn(ids.shape, dtype=torch.float64), torch.randn(ids.shape, dtype=torch.float64)]

    def run(h, w, bb, where):
        return torch_offload.token_logprobs(h, w, ids.to(where), bias=bb, temperature=temperature, entropy=True)

    want, want_grads = outputs_and_grads(run(hidden, weight, b, "cpu"), upstream, leaves)
    got, got_grads = outputs_and_grads(
        run(gpu[0], gpu[1], gpu[2] if bias else None, "cuda"), [u.cuda() for u in upstream], gpu
    )
    for g, w in zip([*got, *got_grads], [*want, *want_grads]):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cuda_reduced_precision_is_as_close_to_float64_as_eager(dtype):
    hidden, weight, b, ids = make_inputs((2, 600, 64), 5000, bias=True)
    inputs = to_cuda((hidden, weight, b), dtype)
    exact = [t.detach().double().requires_grad_() for t in inputs]
    ids = ids.cuda()
    upstream = [torch.randn(ids.shape, device="cuda"), torch.randn(ids.shape, device="cuda")]
    want, want_grads = outputs_and_grads(reference(*exact[:2], ids, exact[2], 0.7), upstream, exact)
    eager, eager_grads = outputs_and_grads(reference(*inputs[:2], ids, inputs[2], 0.7), upstream, inputs)
    got, got_grads = outputs_and_grads(
        torch_offload.token_logprobs(*inputs[:2], ids, bias=inputs[2], temperature=0.7, entropy=True), upstream, inputs
    )
    for g, e, w in zip(got, eager, want):
        assert g.dtype == torch.float32
        assert relative_error(g, w) <= max(2 * relative_error(e, w), 1e-3)
    for g, e, w in zip(got_grads, eager_grads, want_grads):
        assert g.dtype == dtype
        assert relative_error(g, w) <= max(1.5 * relative_error(e, w), 1e-2)


def test_cuda_allocates_no_tokens_by_vocabulary_tensor():
    tokens, vocab = 8192, 32000
    hidden, weight, _, ids = make_inputs((tokens, 64), vocab, dtype=torch.float32)
    hidden, weight = to_cuda((hidden, weight))
    ids = ids.cuda()
    upstream = [torch.randn(tokens, device="cuda"), torch.randn(tokens, device="cuda")]

    def step():
        outputs_and_grads(torch_offload.token_logprobs(hidden, weight, ids, entropy=True), upstream, [hidden, weight])

    sizes = allocation_sizes(step)
    # Tiles of 8 MiB of logits and their float32 temporaries, the weight's gradient (8 MiB); logits are 1 GiB.
    assert max(sizes) < tokens * vocab * 4 / 16, max(sizes)


def test_cuda_opcheck():
    hidden, weight, b, ids = make_inputs((2, 7, 16), 19, bias=True, dtype=torch.float32)
    hidden, weight, b = to_cuda((hidden, weight, b))
    opcheck(torch.ops.offload.token_logprobs.default, (hidden, weight, ids.cuda()), dict(bias=b, entropy=True))


def test_cuda_bad_id_is_an_error_not_a_crash():
    hidden, weight, _, ids = make_inputs((5, 16), 10, dtype=torch.float32)
    ids[2] = 10
    with pytest.raises(RuntimeError, match=r"token_logprobs: ids holds 10 at \(flattened\) index 2"):
        torch_offload.token_logprobs(hidden.cuda(), weight.cuda(), ids.cuda())


def test_cuda_summaries_match_the_cpu_op():
    hidden, weight, b, ids = make_inputs((1030, 8), 4099, bias=True)
    want = torch_offload.token_logprob_summaries(hidden, weight, ids, bias=b, temperature=0.7)
    got = torch_offload.token_logprob_summaries(
        hidden.cuda(), weight.cuda(), ids.cuda(), bias=b.cuda(), temperature=0.7
    )
    for g, w in zip(got, want):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, rtol=1e-10, atol=1e-12)


def test_cuda_graph_capture_of_ops_reading_values_on_the_host_is_refused_by_name():
    # Each reads a value on the host (an .item()), which would end a capture with CUDA's own error.
    hidden, weight = torch.randn(2, 5, 8, device="cuda"), torch.randn(11, 8, device="cuda")
    ids = torch.randint(0, 11, (2, 5), device="cuda")
    ops = {
        "token_logprobs": lambda: torch.ops.offload.token_logprobs(hidden, weight, ids),
        "linear_cross_entropy": lambda: torch_offload.linear_cross_entropy(hidden, weight, ids),
        "_assert_all": lambda: torch.ops.offload._assert_all(ids, ids.ge(0), "ids must be >= 0"),
    }
    for op, run in ops.items():
        with pytest.raises(RuntimeError, match=f"{op}: cannot run while a CUDA graph is being captured on cuda"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                run()
        run()  # outside a capture, as before
