#!/usr/bin/env bash
# A binary wheel of the library for one Python's torch (`make wheel`, and the torch range's ends in CI):
#   build_wheel.sh PYTHON OUTDIR [more pip options, e.g. -C build-dir=DIR]
# CPU kernels always; CUDA kernels too when PYTHON's torch is a CUDA build and $CUDA_HOME/bin/nvcc exists (default
# /usr/local/cuda): sm_80 and sm_90, and sm_100 where that nvcc knows it (or CUDA_ARCHITECTURES, e.g. "80;90"). The
# wheel carries torch_offload_build.json, the torch and CUDA it is for; the package refuses to load into another
# (torch_offload/_library.py). Installing it needs no compiler: `pip install OUTDIR/torch_offload-*.whl` into an
# environment with that torch.
set -euo pipefail
python=$1 out=$2
shift 2
cuda_home=${CUDA_HOME:-/usr/local/cuda}
torch_cuda=$("$python" -c 'import torch; print(torch.version.cuda or "")')
if [ -n "$torch_cuda" ] && [ -x "$cuda_home/bin/nvcc" ]; then
  architectures=${CUDA_ARCHITECTURES:-}
  if [ -z "$architectures" ]; then
    architectures="80;90"
    if "$cuda_home/bin/nvcc" --list-gpu-arch | grep -qx compute_100; then architectures+=";100"; fi
  fi
  # torch's CMake config wants libnvrtc, which a toolkit without the math libraries lacks: then the one torch's
  # wheels ship (the nvidia namespace package, wherever PYTHON finds it).
  nvrtc=$(ls "$cuda_home"/lib64/libnvrtc.so* 2>/dev/null | head -n1 || true)
  if [ -z "$nvrtc" ]; then
    nvrtc=$("$python" -c 'import glob, nvidia; print(next(iter(sorted(
        p for d in nvidia.__path__ for p in glob.glob(d + "/*/lib/libnvrtc.so.*"))), ""))')
  fi
  cuda=(-C cmake.define.TORCH_OFFLOAD_CUDA=ON -C "cmake.define.TORCH_OFFLOAD_CUDA_ARCHITECTURES=$architectures"
        -C "cmake.define.CMAKE_CUDA_COMPILER=$cuda_home/bin/nvcc" -C "cmake.define.CUDA_TOOLKIT_ROOT_DIR=$cuda_home"
        -C "cmake.define.CUDA_nvrtc_LIBRARY=$nvrtc")
  echo "build_wheel: torch $("$python" -c 'import torch; print(torch.__version__)') (CUDA $torch_cuda), kernels for sm ${architectures//;/, }"
else
  cuda=(-C cmake.define.TORCH_OFFLOAD_CUDA=OFF)
  echo "build_wheel: torch $("$python" -c 'import torch; print(torch.__version__)'), CPU kernels only"
fi
mkdir -p "$out"
"$python" -m pip wheel -q --no-build-isolation --no-deps -w "$out" "${cuda[@]}" "$@" .
ls "$out"/torch_offload-*.whl
