"""Finding and loading ``libtorch_offload.so``: the library is built against one torch and loads into that one only,
so the torch it was built for (recorded beside it at build time) is checked first, for an error that names both
versions instead of the dynamic loader's undefined symbol."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

import torch

LIBRARY = "libtorch_offload.so"
# Written by CMake beside the library (CMakeLists.txt): the torch and CUDA it was compiled against.
BUILD_RECORD = "torch_offload_build.json"


def library_path() -> str:
    """Path of the ``libtorch_offload.so`` shipped in this package, for C++ users (dlopen or link).

    ``TORCH_OFFLOAD_LIBRARY`` overrides it, e.g. to test a library built by CMake
    from a source checkout without installing it.
    """
    override = os.environ.get("TORCH_OFFLOAD_LIBRARY")
    if override:
        return override
    beside = Path(__file__).with_name(LIBRARY)
    if beside.is_file():
        return str(beside)
    # Imported from a source checkout: use the .so that `pip install .` put in the environment.
    try:
        installed = Path(importlib.metadata.distribution("torch_offload").locate_file(f"torch_offload/{LIBRARY}"))
    except importlib.metadata.PackageNotFoundError:
        installed = None
    if installed is None or not installed.is_file():
        raise ImportError(f"{LIBRARY} not found: build and install it with `pip install --no-build-isolation .`")
    return str(installed)


def cmake_prefix_path() -> str:
    """Prefix for CMake's ``find_package(torch_offload)`` against this installed package.

    Use it with torch's: ``-DCMAKE_PREFIX_PATH="$(python -c 'import torch_offload;
    print(torch_offload.cmake_prefix_path())');$(python -c 'import torch;
    print(torch.utils.cmake_prefix_path)')"``.
    """
    return str(Path(library_path()).parent)


def _describe(version: str, cuda: str | None) -> str:
    return f"torch {version} ({f'CUDA {cuda}' if cuda else 'no CUDA'})"


def check_built_for_running_torch(library: str) -> None:
    """Raises ImportError unless the library was built for the running torch: the same release (C++ symbols move
    between releases) and the same CUDA major version (a CUDA build links torch's CUDA libraries and runtime). A
    library without a record (built by CMake by hand, outside pip) is not checked."""
    record = Path(library).with_name(BUILD_RECORD)
    if not record.is_file():
        return
    built = json.loads(record.read_text())
    running_cuda = torch.version.cuda

    def release(version: str) -> str:
        return version.split("+")[0]

    def cuda_major(cuda: str | None) -> str | None:
        return cuda.split(".")[0] if cuda else None

    if release(built["torch"]) == release(torch.__version__) and cuda_major(built["cuda"]) == cuda_major(running_cuda):
        return
    raise ImportError(
        f"torch_offload: {library} was built against {_describe(built['torch'], built['cuda'])}, but this process "
        f"runs {_describe(torch.__version__, running_cuda)}; the library loads into the torch it was built against "
        "only. Install the torch_offload wheel made for this torch, or build it here: "
        "`pip install --no-build-isolation .` (README, Install)"
    )


def _tag_compile_caches(library: str) -> None:
    """torch.compile's on-disk caches (AOTAutograd's, inductor's) key a graph by the ops it calls, not by what
    this library's C++ autograd formulas trace those ops' backward to: after an upgrade whose formulas changed, an
    old backward graph would be served. The loaded library's digest goes into every cache key."""
    digest = hashlib.blake2b(Path(library).read_bytes(), digest_size=8).hexdigest()
    tag = torch.compiler.config.cache_key_tag
    torch.compiler.config.cache_key_tag = f"{tag} torch_offload-{digest}".strip()


def load() -> None:
    """Registers the library's ops with torch (once per process: torch.ops.load_library ignores a second call)."""
    library = library_path()
    check_built_for_running_torch(library)
    torch.ops.load_library(library)
    _tag_compile_caches(library)
