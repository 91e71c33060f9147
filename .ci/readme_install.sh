#!/usr/bin/env bash
# The README's install lines, as they stand, in a fresh venv that holds only torch (TORCH_VERSION, default 2.13.0),
# with no cmake or ninja on PATH outside that venv: what a user who wants the library in their own environment runs.
# Then the installed package, imported away from the checkout, calls an op. The build goes to build/readme-install/.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD work=$PWD/build/readme-install
rm -rf "$work" && mkdir -p "$work/bin"
python3 -m venv "$work/venv"
# Without compiling torch's bytecode (35 s here): two processes import it, and compile what they import themselves.
"$work/venv/bin/pip" install -q --no-compile "torch==${TORCH_VERSION:-2.13.0}"
# The machine's tools, less CMake's and ninja's: a link to every other program of the system's bin directories.
for dir in /usr/local/bin /usr/bin /bin; do
  for tool in "$dir"/*; do
    case $(basename "$tool") in cmake | ctest | cpack | ccmake | ninja) continue ;; esac
    [ -e "$work/bin/$(basename "$tool")" ] || ln -s "$tool" "$work/bin/$(basename "$tool")"
  done
done
# The first fenced block under "## Install", line by line as a user types it, in the activated venv.
awk '/^## Install$/ {section = 1; next} section && /^```/ {if (block) exit; block = 1; next} block' README.md \
  > "$work/install.sh"
echo "readme_install: running README.md's install lines:" && cat "$work/install.sh"
env -u CUDA_HOME PATH="$work/bin" bash -euo pipefail -c \
  '! command -v cmake && ! command -v ninja && source "$0/venv/bin/activate" && source "$0/install.sh"' "$work"
# Away from the checkout, so that the installed package is the one imported.
cd "$work" && "$work/venv/bin/python" -c '
import torch, torch_offload
x = torch.randn(4, 3, requires_grad=True)
packed = torch_offload.offload_pack(x)
torch_offload.offload_unpack(packed, "cpu").sum().backward()
assert torch.equal(x.grad, torch.ones_like(x)), x.grad
assert torch_offload.__file__.startswith("'"$work"'"), torch_offload.__file__
print("readme_install: torch", torch.__version__, "and", torch_offload.library_path(), "ok")'
cd "$root" && rm -rf "$work/venv"
