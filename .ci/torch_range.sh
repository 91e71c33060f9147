#!/usr/bin/env bash
# The ends of the supported torch range (`make test-torch-range`): for each version given, the CUDA build of the
# library (nvcc, sm_80 and sm_90, as the lent GPU machines build it) and the test files the Makefile names in
# OP_TESTS, on the CPU; the version named GPU_TORCH (the lent GPU machines') runs GPU_TORCH_TESTS too.
#   OP_TESTS="test_a.py test_b.py" [GPU_TORCH=2.11.0 GPU_TORCH_TESTS="test_c.py"] torch_range.sh CUDA_VENV CUDA_HOME VERSION...
# Each version gets a venv under build/torch-VERSION holding only that torch (from PyPI, without its dependencies);
# everything else, the CUDA libraries included, comes from CUDA_VENV's site-packages through a .pth file: CUDA 13
# libraries of another minor version serve a CPU run. A library a version needs newer than CUDA_VENV's is named in
# EXTRA_WHEELS below. PyPI is asked directly (PIP_CONFIG_FILE=/dev/null): the machine's pip is capped at the
# torch on its disk.
set -euo pipefail
cuda_venv=$(realpath "$1") cuda_home=$2
shift 2
declare -A EXTRA_WHEELS=([2.15.0]="nvidia-nvshmem-cu13==3.7.2")  # torch 2.15's libtorch_nvshmem needs 3.7
read -ra op_tests <<< "${OP_TESTS:?the test files to run, from the Makefile}"
cuda_site=$("$cuda_venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
for version in "$@"; do
  SECONDS=0
  venv=build/torch-$version/venv
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    "$cuda_venv/bin/python" -m venv "$venv"
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "$cuda_site" > "$site/cuda_venv.pth"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q --no-deps "torch==$version" ${EXTRA_WHEELS[$version]:-}
    touch "$venv/.ready"
  fi
  nvrtc=$(ls "$cuda_site"/nvidia/*/lib/libnvrtc.so.* | head -n1)
  "$venv/bin/python" -m pip install -q --no-build-isolation --no-deps -C "build-dir=build/torch-$version/build" \
    -C cmake.define.TORCH_OFFLOAD_CUDA=ON -C "cmake.define.CMAKE_CUDA_COMPILER=$cuda_home/bin/nvcc" \
    -C "cmake.define.CUDA_TOOLKIT_ROOT_DIR=$cuda_home" -C "cmake.define.CUDA_nvrtc_LIBRARY=$nvrtc" .
  tests=("${op_tests[@]}")
  if [ "$version" = "${GPU_TORCH:-}" ]; then read -ra gpu_torch_tests <<< "${GPU_TORCH_TESTS:-}"; tests+=("${gpu_torch_tests[@]}"); fi
  (cd python_tests && "../$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "${tests[@]}")
  echo "torch_range: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): built and tested in ${SECONDS} s"
done
