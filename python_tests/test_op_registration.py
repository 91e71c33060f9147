"""Every op of offload:: that takes a tensor follows the rules all ops share (ops/common/op_rules.h), registered
from the op's own folder: a kernel at each key of tensors that are not dense (an error naming the op and the
argument), a rule under autocast at both autocast keys, and a test that runs on the supported torch range's ends
(a test file marked torch_range, or gpu_torch for the range's oldest end: the Makefile's OP_TESTS and
GPU_TORCH_TESTS are those files)."""

import re
from pathlib import Path

import pytest
import torch

import torch_offload  # noqa: F401  (loads the library)

pytestmark = pytest.mark.torch_range

NON_DENSE_KEYS = (
    "SparseCPU",
    "SparseCUDA",
    "SparseCsrCPU",
    "SparseCsrCUDA",
    "NestedTensorCPU",
    "NestedTensorCUDA",
    "AutogradNestedTensor",
    "MkldnnCPU",
    "QuantizedCPU",
    "QuantizedCUDA",
)
AUTOCAST_KEYS = ("AutocastCPU", "AutocastCUDA")
RANGE_MARK = re.compile(r"^pytestmark = .*pytest\.mark\.(torch_range|gpu_torch)\b", re.MULTILINE)


def takes_a_tensor(qualified_name):
    namespace, name = qualified_name.split("::")
    schema = getattr(getattr(torch.ops, namespace), name).default._schema
    return any("Tensor" in str(argument.type) for argument in schema.arguments)


def offload_ops_taking_tensors():
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("offload::"))
    return [n for n in names if takes_a_tensor(n)]


def range_test_sources():
    files = sorted(Path(__file__).parent.glob("test_*.py"))
    return {f.name: f.read_text() for f in files if RANGE_MARK.search(f.read_text())}


def missing_rules(qualified_name, sources):
    """The shared rules `qualified_name` lacks, in words."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    missing = [f"a layout rule at {key}" for key in NON_DENSE_KEYS if not has(qualified_name, key)]
    missing += [f"an autocast rule at {key}" for key in AUTOCAST_KEYS if not has(qualified_name, key)]
    name = qualified_name.split("::")[1]
    if not any(re.search(rf"\b{re.escape(name)}\b", text) for text in sources.values()):
        missing.append("a test in a file marked torch_range or gpu_torch")
    return missing


@pytest.mark.parametrize("op", offload_ops_taking_tensors())
def test_op_has_every_shared_rule(op):
    assert missing_rules(op, range_test_sources()) == []


def test_an_op_registered_without_the_rules_is_caught():
    library = torch.library.Library("offload_rules_probe", "DEF")
    library.define("op_no_test_names(Tensor x) -> Tensor")
    try:
        others = {name: text for name, text in range_test_sources().items() if name != Path(__file__).name}
        missing = missing_rules("offload_rules_probe::op_no_test_names", others)
    finally:
        library._destroy()
    assert missing == [f"a layout rule at {key}" for key in NON_DENSE_KEYS] + [
        f"an autocast rule at {key}" for key in AUTOCAST_KEYS
    ] + ["a test in a file marked torch_range or gpu_torch"]


def test_the_range_files_hold_the_op_tests_and_this_file():
    names = set(range_test_sources())
    assert {"test_op_registration.py", "test_offload_ops.py", "test_sequence_parallel.py"} <= names
    assert len(offload_ops_taking_tensors()) >= 25  # every op folder's ops were found
