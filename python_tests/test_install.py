"""The installed package: the library records the torch it was built against, and refuses another torch with an
error that names both versions (torch_offload/_library.py), never the dynamic loader's undefined symbol."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import torch_offload
from torch_offload._library import BUILD_RECORD

pytestmark = pytest.mark.torch_range


def installed_record():
    return json.loads(Path(torch_offload.library_path()).with_name(BUILD_RECORD).read_text())


def import_with_record(tmp_path, record):
    """Imports torch_offload in a child whose library sits beside the given build record (a link to the real one)."""
    (tmp_path / "libtorch_offload.so").symlink_to(torch_offload.library_path())
    (tmp_path / BUILD_RECORD).write_text(json.dumps(record))
    env = dict(os.environ, TORCH_OFFLOAD_LIBRARY=str(tmp_path / "libtorch_offload.so"))
    code = "import torch_offload, torch; print(torch.ops.offload.offload_pack(torch.ones(2)).sum().item())"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_the_installed_library_records_the_torch_it_runs_with():
    record = installed_record()
    assert record == {"torch": torch.__version__, "cuda": torch.version.cuda}


def test_a_library_built_for_this_torch_imports(tmp_path):
    child = import_with_record(tmp_path, installed_record())
    assert child.returncode == 0, child.stderr
    assert child.stdout.strip() == "2.0"


def test_a_library_built_for_another_torch_release_is_refused_naming_both(tmp_path):
    other = "2.99.0" if not torch.__version__.startswith("2.99") else "2.98.0"
    child = import_with_record(tmp_path, {"torch": other, "cuda": torch.version.cuda})
    assert child.returncode != 0
    message = child.stderr.strip().splitlines()[-1]
    assert message.startswith("ImportError: torch_offload:"), child.stderr
    assert f"built against torch {other}" in message and f"runs torch {torch.__version__}" in message
    assert "undefined symbol" not in child.stderr


def test_a_library_built_for_another_cuda_is_refused_naming_both(tmp_path):
    # A CUDA build loaded into a CPU torch, or a CPU build's record read by a CUDA torch: the CUDA major differs.
    other_cuda = None if torch.version.cuda else "13.0"
    child = import_with_record(tmp_path, {"torch": torch.__version__, "cuda": other_cuda})
    assert child.returncode != 0
    message = child.stderr.strip().splitlines()[-1]
    built = f"CUDA {other_cuda}" if other_cuda else "no CUDA"
    running = f"CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"
    assert f"({built})" in message and f"({running})" in message, message


def test_a_local_version_label_alone_is_not_a_mismatch(tmp_path):
    # PyPI's and download.pytorch.org's wheels of one release and CUDA differ in the label only (2.11.0 / +cu130).
    release = torch.__version__.split("+")[0]
    child = import_with_record(tmp_path, {"torch": f"{release}+other", "cuda": torch.version.cuda})
    assert child.returncode == 0, child.stderr
