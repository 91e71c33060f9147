#!/usr/bin/env bash
# Proves what the CUDA build links and refuses, from outside: used by `make cuda-check`.
#   check_cuda_runtime.sh LIBRARY              the library needs the shared CUDA runtime and carries no static one
#   check_cuda_runtime.sh --mismatch PYTHON NVCC  configuring against a torch of another CUDA major version fails,
#                                               naming both versions (PYTHON's torch.version.cuda is faked)
set -euo pipefail
if [ "$1" != "--mismatch" ]; then
  library=$1
  readelf -d "$library" | grep -q 'NEEDED.*libcudart\.so' \
    || { echo "$library does not link the shared CUDA runtime (libcudart.so)"; exit 1; }
  # A static runtime defines the runtime API (cudaMalloc, cudaEventQuery...) and its internals in the library.
  if nm -C --defined-only "$library" | grep -q -E ' [tTdDbB] (cuda[A-Z]|cudart::)'; then
    echo "$library carries a static CUDA runtime (defines cuda* or cudart:: symbols)"; exit 1
  fi
  echo "$library: shared CUDA runtime only"
  exit 0
fi
python=$2 nvcc=$3
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
# A Python whose torch says it was built with CUDA 1.0 (the second line of CMakeLists.txt's question about torch);
# everything else is the real one.
cat > "$scratch/python" <<SHIM
#!/usr/bin/env bash
case "\$*" in *torch.version.cuda*) "$python" "\$@" | sed '2s/.*/1.0/' ;; *) exec "$python" "\$@" ;; esac
SHIM
chmod +x "$scratch/python"
if cmake -S "$(dirname "$0")/.." -B "$scratch/build" -DPython3_EXECUTABLE="$scratch/python" \
     -DTORCH_OFFLOAD_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" > "$scratch/log" 2>&1; then
  echo "configuring against a torch built with CUDA 1.0 succeeded with $nvcc"; exit 1
fi
nvcc_version=$("$nvcc" --version | sed -n 's/.*release \([0-9.]*\).*/\1/p')
message=$(tr '\n' ' ' < "$scratch/log" | tr -s ' ')  # CMake indents and may wrap the message
grep -q "is CUDA ${nvcc_version}.*torch was built with CUDA 1.0" <<< "$message" \
  || { cat "$scratch/log"; echo "the configure error does not name both versions"; exit 1; }
echo "a torch of another CUDA major version is refused: $(grep -o 'nvcc (.*CUDA 1.0' <<< "$message")"
