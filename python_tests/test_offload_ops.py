"""offload_pack / offload_unpack from Python: values, autograd, opcheck, compile, TorchScript, errors;
meta tensors through every device-moving op."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.bool]


def sample(shape, dtype=torch.float32, requires_grad=False):
    values = torch.arange(max(1, torch.Size(shape).numel()), dtype=torch.float64)[: torch.Size(shape).numel()]
    values = values.reshape(shape)
    out = values.remainder(3).eq(0) if dtype == torch.bool else (values * 0.5 - 3).to(dtype)
    return out.requires_grad_(requires_grad)


def layouts():
    base = sample((4, 6))
    return {
        "contiguous": base,
        "transposed": base.t(),
        "strided": base[:, ::2],
        "expanded": sample((1, 6)).expand(5, 6),
        "zero_size": torch.empty(0, 3),
        "zero_dim": torch.tensor(1.5),
    }


def test_import_loads_the_ops_and_names_the_library():
    assert os.path.isfile(torch_offload.library_path())
    assert hasattr(torch.ops.offload, "offload_pack")
    assert hasattr(torch.ops.offload, "offload_unpack")


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None, reason="reads the ELF with nm")
def test_the_library_carries_no_cxx_runtime_of_its_own():
    # A copy of libstdc++ linked into the library (a g++ whose own directory holds only libstdc++.a, as the GPU
    # machines' /opt/gcc) has its locales unset: the numbers of every error message came out empty, or the process
    # segfaulted. The library must use the shared one torch loads.
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", torch_offload.library_path()], capture_output=True, text=True, check=True
    ).stdout
    assert "_ZNSt6locale" not in symbols, "libtorch_offload.so defines std::locale: a static libstdc++ is linked in"
    if shutil.which("readelf") is not None:
        dynamic = subprocess.run(
            ["readelf", "-d", torch_offload.library_path()], capture_output=True, text=True, check=True
        ).stdout
        assert "[libstdc++.so.6]" in dynamic, "libtorch_offload.so does not need the shared libstdc++"
    with pytest.raises(
        RuntimeError, match=r"target has shape \[3\]; expected .* = \[4\]"
    ):  # the numbers of a message are there
        torch_offload.linear_cross_entropy(torch.randn(4, 8), torch.randn(5, 8), torch.zeros(3, dtype=torch.long))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_keeps_values_shape_and_dtype(dtype):
    src = sample((3, 5), dtype)
    packed = torch_offload.offload_pack(src)
    assert packed.device.type == "cpu" and packed.is_contiguous()
    assert packed.data_ptr() != src.data_ptr()
    back = torch_offload.offload_unpack(packed, "cpu")
    assert back.data_ptr() != packed.data_ptr()
    for out in (packed, back):
        assert out.dtype == dtype and out.shape == src.shape
        assert torch.equal(out, src)


@pytest.mark.parametrize("name", list(layouts()))
def test_any_layout_comes_back_contiguous_and_equal(name):
    src = layouts()[name]
    for out in (torch_offload.offload_pack(src), torch_offload.offload_unpack(src, "cpu")):
        assert out.is_contiguous() and out.shape == src.shape
        assert torch.equal(out, src)


def test_result_is_a_copy_not_a_view():
    src = sample((8,))
    packed = torch_offload.offload_pack(src)
    src.add_(100)
    assert torch.equal(packed, sample((8,)))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name", list(layouts()))
def test_opcheck_pack(name, requires_grad):
    src = layouts()[name].clone().requires_grad_(requires_grad)
    opcheck(torch.ops.offload.offload_pack.default, (src,), {"non_blocking": False})
    opcheck(torch.ops.offload.offload_pack.default, (src, True))


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("name", list(layouts()))
def test_opcheck_unpack(name, requires_grad):
    packed = layouts()[name].clone().requires_grad_(requires_grad)
    opcheck(torch.ops.offload.offload_unpack.default, (packed, torch.device("cpu")))


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool], ids=str)
def test_opcheck_non_float(dtype):
    opcheck(torch.ops.offload.offload_pack.default, (sample((2, 3), dtype),))
    opcheck(torch.ops.offload.offload_unpack.default, (sample((2, 3), dtype), torch.device("cpu")))


def test_gradcheck_float64():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: torch_offload.offload_pack(t), (x,))
    assert torch.autograd.gradcheck(lambda t: torch_offload.offload_unpack(t, "cpu"), (x,))

    def composed(t):
        return torch_offload.offload_unpack(torch_offload.offload_pack(t * t), "cpu").sin()

    assert torch.autograd.gradcheck(composed, (x,))
    assert torch.autograd.gradgradcheck(composed, (x,))


def test_gradient_of_round_trip_equals_plain_torch():
    x = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 7, dtype=torch.float64)
    (torch_offload.offload_unpack(torch_offload.offload_pack(x.exp()), "cpu") * w).sum().backward()
    assert torch.allclose(x.grad, w * x.detach().exp())


def test_fake_tensor_results_land_on_the_asked_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        src = torch.empty(2, 3, dtype=torch.float16)
        packed = torch.ops.offload.offload_pack(src)
        back = torch.ops.offload.offload_unpack(packed, torch.device("meta"))
    assert packed.device.type == "cpu" and packed.dtype == torch.float16 and packed.shape == (2, 3)
    assert back.device.type == "meta"


# Real meta tensors through the device-moving ops: meta results, nothing allocated
# (the tensor would take 256 GiB), no data consumed. The package's fake impls are
# the ops' Meta kernels once it is imported, the C++ ones before.
META_CHECKS = """
huge = torch.empty(1 << 36, device="meta")
ticket = torch.ops.offload.disk_spill(huge)
torch.ops.offload.disk_prefetch(ticket)
torch.ops.offload.disk_wait(ticket)
results = [
    torch.ops.offload.offload_pack(huge),
    torch.ops.offload.offload_pack(huge, True),
    torch.ops.offload.offload_unpack(huge, torch.device("cpu")),
    torch.ops.offload.disk_restore(ticket, huge.shape, huge.dtype, torch.device("cpu")),
]
assert ticket.is_meta and ticket.shape == (2,) and ticket.dtype == torch.int64, ticket
assert all(r.is_meta and r.shape == huge.shape and r.dtype == huge.dtype for r in results), results
"""


def test_meta_tensors_give_meta_results_with_the_package():
    exec(META_CHECKS, {"torch": torch})


def test_meta_tensors_give_meta_results_with_the_library_alone():
    code = (
        f"import sys, torch\ntorch.ops.load_library({torch_offload.library_path()!r})\n{META_CHECKS}\n"
        "assert 'torch_offload' not in sys.modules\nprint('META OK')"
    )
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "META OK" in child.stdout, child.stdout + child.stderr


def pack_compute_unpack(x, w):
    packed = torch.ops.offload.offload_pack(x * 2)
    h = torch.tanh(x @ w)
    y = torch.ops.offload.offload_unpack(packed, x.device)
    return (y * h).sum()


def test_compile_fullgraph_dynamic_matches_eager_without_graph_breaks():
    torch._dynamo.reset()
    compiled = torch.compile(pack_compute_unpack, fullgraph=True, dynamic=True)
    for rows in (4, 9):  # two sequence lengths: one dynamic graph serves both
        x = torch.randn(rows, 6, requires_grad=True)
        w = torch.randn(6, 6, requires_grad=True)
        eager_loss = pack_compute_unpack(x, w)
        eager_grads = torch.autograd.grad(eager_loss, (x, w))
        compiled_loss = compiled(x, w)
        compiled_grads = torch.autograd.grad(compiled_loss, (x, w))
        torch.testing.assert_close(compiled_loss, eager_loss)
        for got, want in zip(compiled_grads, eager_grads):
            torch.testing.assert_close(got, want)
    explanation = torch._dynamo.explain(pack_compute_unpack)(torch.randn(4, 6), torch.randn(6, 6))
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1


def test_torchscript_calls_the_ops():
    @torch.jit.script
    def scripted(x: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.offload.offload_pack(x, False)
        return torch.ops.offload.offload_unpack(packed, torch.device("cpu"))

    x = sample((3, 4))
    assert torch.equal(scripted(x), x)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_unpack_to_missing_cuda_device_names_the_problem():
    with pytest.raises(RuntimeError, match="offload_unpack: device is cuda.* no CUDA device is available"):
        torch_offload.offload_unpack(sample((2,)), "cuda")


def test_unknown_device_is_rejected():
    with pytest.raises(RuntimeError, match="offload_unpack: device is meta|expected a cpu or cuda device"):
        torch.ops.offload.offload_unpack(sample((2,)), torch.device("xpu"))


def test_missing_tensor_is_rejected_by_name():
    with pytest.raises(RuntimeError, match="offload_pack: src is NoneType; expected a defined tensor"):
        torch_offload.offload_pack(None)
    with pytest.raises(RuntimeError, match="offload_unpack: packed is NoneType; expected a defined tensor"):
        torch_offload.offload_unpack(None, "cpu")
    # The raw ops refuse it too (the dispatcher finds no device to run on).
    with pytest.raises(RuntimeError):
        torch.ops.offload.offload_pack(None)


@pytest.mark.parametrize("budget, message", [(-1, "must be >= 0"), (1 << 62, "exceeds this host's physical memory")])
def test_bad_budget_is_rejected_and_nothing_changes(budget, message):
    before = torch_offload.pinned_arena_stats()
    with pytest.raises(RuntimeError, match=f"set_pinned_budget: budget_bytes.*{message}"):
        torch_offload.set_pinned_budget(budget)
    assert torch_offload.pinned_arena_stats() == before


def test_budget_is_stored():
    before = torch_offload.pinned_arena_stats()["budget_bytes"]
    try:
        torch_offload.set_pinned_budget(1 << 20)
        assert torch_offload.pinned_arena_stats()["budget_bytes"] == 1 << 20
    finally:
        torch_offload.set_pinned_budget(before)


def test_saved_tensor_hooks_round_trip_matches_plain_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
    x, target = torch.randn(32, 8), torch.randn(32, 1)

    def loss_and_grads(hooks):
        model.zero_grad()
        if hooks:
            with torch.autograd.graph.saved_tensors_hooks(
                lambda t: (t.device, torch_offload.offload_pack(t)),
                lambda saved: torch_offload.offload_unpack(saved[1], saved[0]),
            ):
                loss = torch.nn.functional.mse_loss(model(x), target)
        else:
            loss = torch.nn.functional.mse_loss(model(x), target)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain_loss, plain_grads = loss_and_grads(False)
    hooked_loss, hooked_grads = loss_and_grads(True)
    assert torch.equal(plain_loss, hooked_loss)
    for a, b in zip(plain_grads, hooked_grads):
        assert torch.equal(a, b)


def _non_dense_inputs():
    dense = torch.randn(4, 8)
    return {  # by test id: the tensor and what the error calls it
        "sparse_coo": (dense.to_sparse(), "sparse COO"),
        "sparse_csr": (dense.to_sparse_csr(), "sparse compressed"),
        "nested": (torch.nested.nested_tensor([dense, dense[:2]]), "nested"),
        "nested_jagged": (torch.nested.nested_tensor([dense, dense[:2]], layout=torch.jagged), "nested"),
        "mkldnn": (dense.to_mkldnn(), "mkldnn"),
        "quantized": (torch.quantize_per_tensor(dense, 0.1, 0, torch.qint8), "quantized"),
    }


@pytest.mark.filterwarnings("ignore::UserWarning")  # sparse CSR, nested and quantized tensors warn that they are beta
@pytest.mark.parametrize("case", list(_non_dense_inputs()))
def test_tensors_that_are_not_dense_get_an_error_naming_the_op_and_argument(case, tmp_path):
    bad, kind = _non_dense_inputs()[case]
    x, w_gate, w_up, w_down = torch.randn(4, 8), torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 16)
    weight, target = torch.randn(32, 8), torch.randint(0, 32, (4,))
    rope = torch.randn(4, 4)
    calls = {
        ("offload_pack", "src"): lambda t: torch_offload.offload_pack(t),
        ("offload_unpack", "packed"): lambda t: torch_offload.offload_unpack(t, "cpu"),
        ("disk_spill", "src"): lambda t: torch_offload.disk_spill(t, directory=str(tmp_path)),
        ("tiled_mlp", "x"): lambda t: torch_offload.tiled_mlp(t, w_gate, w_up, w_down),
        ("tiled_mlp", "w_up"): lambda t: torch_offload.tiled_mlp(x, w_gate, t, w_down),
        ("linear_cross_entropy", "hidden"): lambda t: torch_offload.linear_cross_entropy(t, weight, target),
        ("linear_cross_entropy", "weight"): lambda t: torch_offload.linear_cross_entropy(x, t, target),
        ("token_logprobs", "hidden"): lambda t: torch_offload.token_logprobs(t, weight, target),
        ("token_logprobs", "weight"): lambda t: torch_offload.token_logprobs(x, t, target),
        ("token_logprob_summaries", "hidden"): lambda t: torch_offload.token_logprob_summaries(t, weight, target),
        ("rms_norm", "x"): lambda t: torch_offload.rms_norm(t, torch.ones(8)),
        ("attention_block", "x"): lambda t: torch_offload.attention_block(
            t, w_down.t(), w_down.t(), w_down.t(), w_down.t(), rope, rope
        ),
    }
    for (op, arg), call in calls.items():
        # The forward op may be the one that refuses (linear_cross_entropy_forward).
        with pytest.raises(RuntimeError, match=rf"{op}\w*: {arg} is a {kind} tensor; expected a dense"):
            call(bad)
    assert list(tmp_path.iterdir()) == []  # nothing spilled


def test_assert_all_returns_a_copy_of_its_value_or_raises_its_message():
    ids = torch.arange(6).view(2, 3)
    got = torch.ops.offload._assert_all(ids, torch.tensor([True, True]), "unused")
    assert torch.equal(got, ids) and got.data_ptr() != ids.data_ptr()
    with pytest.raises(RuntimeError, match="row 1 has a hole"):
        torch.ops.offload._assert_all(ids, torch.tensor([True, False]), "row 1 has a hole")
    opcheck(torch.ops.offload._assert_all.default, (ids, torch.tensor(True), "unused"))
