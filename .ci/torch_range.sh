#!/usr/bin/env bash
# The ends of the supported torch range (`make test-torch-range`): for each version given, the CUDA wheel of the
# library (cmake/build_wheel.sh: nvcc; sm_80, sm_90 and sm_100 for GPU_TORCH, sm_90 for the others), installed with no
# compiler on PATH, and the test files the Makefile names in OP_TESTS, on the CPU; the version named GPU_TORCH (the lent GPU machines') runs
# GPU_TORCH_TESTS too, the C++ suite and the CUDA runtime checks, and its wheel (build/torch-VERSION/dist) is the one
# `make gpu-check` can carry.
#   OP_TESTS="test_a.py test_b.py" [GPU_TORCH=2.11.0 GPU_TORCH_TESTS="test_c.py"] torch_range.sh CUDA_VENV CUDA_HOME VERSION...
#   torch_range.sh --venvs CUDA_VENV CUDA_HOME VERSION...  # the venvs alone (CI downloads them while it builds)
# Each version gets a venv under build/torch-VERSION holding only that torch (from PyPI, without its dependencies);
# everything else, the CUDA libraries included, comes from CUDA_VENV's site-packages through a .pth file: CUDA 13
# libraries of another minor version serve a CPU run. A library a version needs newer than CUDA_VENV's is named in
# EXTRA_WHEELS below. PyPI is asked directly (PIP_CONFIG_FILE=/dev/null): the machine's pip is capped at the
# torch on its disk.
set -euo pipefail
venvs_only=false
if [ "$1" = "--venvs" ]; then venvs_only=true; shift; fi
cuda_venv=$(realpath "$1") cuda_home=$2
shift 2
declare -A EXTRA_WHEELS=([2.15.0]="nvidia-nvshmem-cu13==3.7.2")  # torch 2.15's libtorch_nvshmem needs 3.7
cuda_site=$("$cuda_venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
make_venv() {
  local venv=build/torch-$1/venv
  if [ ! -f "$venv/.ready" ]; then
    rm -rf "$venv"
    "$cuda_venv/bin/python" -m venv "$venv"
    site=$("$venv/bin/python" -c 'import site; print(site.getsitepackages()[0])')
    echo "$cuda_site" > "$site/cuda_venv.pth"
    PIP_CONFIG_FILE=/dev/null "$venv/bin/pip" install -q --no-deps "torch==$1" ${EXTRA_WHEELS[$1]:-}
    touch "$venv/.ready"
  fi
}
if $venvs_only; then
  for version in "$@"; do make_venv "$version"; done
  exit 0
fi
read -ra op_tests <<< "${OP_TESTS:?the test files to run, from the Makefile}"
for version in "$@"; do
  SECONDS=0
  venv=build/torch-$version/venv
  make_venv "$version"
  # The wheel a user of that torch would install (`make wheel`), installed as on a machine without a compiler.
  wheels=build/torch-$version/dist
  rm -rf "$wheels"
  build=build/torch-$version/build
  if [ "$version" = "${GPU_TORCH:-}" ]; then
    # The lent machines' torch also gets the C++ suite (its GPU tests skip here) and the checks of what the CUDA
    # build links and refuses (cmake/check_cuda_runtime.sh). torch's CUDA libraries find theirs (cuDNN, NCCL...)
    # beside them in a venv of their own; here those are CUDA_VENV's, named to the linker of the test program and to
    # the loader of it (GoogleTest lists its tests at build time).
    nvidia_libraries=$(ls -d "$cuda_site"/nvidia/*/lib | paste -sd:)
    LD_LIBRARY_PATH=$nvidia_libraries CUDA_HOME=$cuda_home cmake/build_wheel.sh "$venv/bin/python" "$wheels" \
      -C "build-dir=$build" -C cmake.define.TORCH_OFFLOAD_BUILD_TESTS=ON
    LD_LIBRARY_PATH=$nvidia_libraries "$cuda_venv/bin/ctest" --test-dir "$build" --output-on-failure -j "$(nproc)"
    cmake/check_cuda_runtime.sh "$build/libtorch_offload.so"
    PATH=$cuda_venv/bin:$PATH cmake/check_cuda_runtime.sh --mismatch "$PWD/$venv/bin/python" "$cuda_home/bin/nvcc"
  else
    # Every architecture in the wheel the GPU machines take only; elsewhere one proves that the .cu files compile and
    # link against that torch: each architecture costs a build about 100 s of nvcc here.
    CUDA_HOME=$cuda_home CUDA_ARCHITECTURES="90" cmake/build_wheel.sh "$venv/bin/python" "$wheels" -C "build-dir=$build"
  fi
  env -u CUDA_HOME PATH="$(realpath "$venv")/bin:/usr/bin:/bin" bash -c \
    '! command -v nvcc && "$0" -m pip install -q --no-deps --force-reinstall "$1"/torch_offload-*.whl' \
    "$venv/bin/python" "$wheels"
  tests=("${op_tests[@]}")
  if [ "$version" = "${GPU_TORCH:-}" ]; then read -ra gpu_torch_tests <<< "${GPU_TORCH_TESTS:-}"; tests+=("${gpu_torch_tests[@]}"); fi
  (cd python_tests && "../$venv/bin/python" -m pytest -q -p no:cacheprovider -n auto --dist loadgroup "${tests[@]}")
  echo "torch_range: torch $("$venv/bin/python" -c 'import torch; print(torch.__version__)'): built and tested in ${SECONDS} s"
done
# The first end's wheel under the last end's torch: refused with both versions named, not the loader's undefined
# symbol (the package's own test fakes the record; this is a real wheel of another torch).
if [ "$#" -ge 2 ]; then
  first=$1 last=${!#}
  target=$(realpath -m "build/torch-$last/wheel-of-$first")
  rm -rf "$target"
  "build/torch-$last/venv/bin/python" -m pip install -q --no-deps --target "$target" "build/torch-$first/dist"/torch_offload-*.whl
  python=$PWD/build/torch-$last/venv/bin/python  # not resolved: the link is what makes it the venv's
  if refusal=$(cd / && PYTHONPATH=$target "$python" -c 'import torch_offload' 2>&1); then
    echo "torch_range: torch $first's wheel imported under torch $last"; exit 1
  fi
  echo "$refusal" | tail -n1 | grep -E "built against torch $first.*runs torch $last" \
    || { echo "torch_range: not the refusal expected:"; echo "$refusal"; exit 1; }
fi
