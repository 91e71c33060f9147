# The README's two commands, `make demo` and `make test`, each set up what they
# need on a fresh machine: .venv/ with torch, the build, GoogleTest, the package.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# The linters pinned: a new release moves the lines they want.
LINT_PACKAGES := ruff==0.17.6 clang-format==23.1.5
# transformers, peft and trl pinned: their releases rename what apply() reads (5.24 renamed past_key_values to
# cache), and trl's trainers patch the model's forward. The Hugging Face packages under them pinned too, at the
# versions the suite last passed with, so that a release of one cannot turn a fresh clone's CI red.
DEV_PACKAGES := pytest pytest-xdist==3.8.0 numpy expecttest scikit-build-core ninja cmake transformers==5.24.0 peft==0.21.2 trl==1.16.0 \
                accelerate==1.16.0 datasets==5.2.0 huggingface_hub==2.4.0 tokenizers==0.23.3 safetensors==0.8.0 \
                matplotlib tqdm $(LINT_PACKAGES)
BUILD_DIR := build/python
# pytest on every core (pytest-xdist); the tests that spawn ranks share one worker (python_tests/conftest.py), and
# the slowest are named at the end of the log.
PYTEST_PARALLEL := -n auto --dist loadgroup --durations=20
# axolotl's own venv: it pins other Hugging Face releases than $(VENV) (see run-axolotl-tests).
AXOLOTL_VENV := .venv-axolotl

# The CUDA compile check: a CUDA build of torch in its own venv, and nvcc.
CUDA_VENV := .venv-cuda
CUDA_TORCH_VERSION ?= 2.14.1
CUDA_HOME ?= /usr/local/cuda
CUDA_BUILD_DIR := build/cuda

.PHONY: demo test lint build wheel gtest example-cpp test-axolotl cuda-check test-cuda-torch test-torch-range torch-range-venvs gpu-check gpu-wheels bench-deps clean

demo: build
	$(PY) examples/demo.py

# The C++ example, built like a user's project: find_package(torch_offload)
# against the package pip installed into .venv; it fails if its loss does not go down.
define run-example-cpp
	$(VENV)/bin/cmake -S examples/cpp -B build/example-cpp -G Ninja \
	  -DCMAKE_PREFIX_PATH="$$($(PY) -c 'import torch_offload; print(torch_offload.cmake_prefix_path())');$$($(PY) -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
	PATH=$$PWD/$(VENV)/bin:$$PATH cmake --build build/example-cpp
	build/example-cpp/train_mlp_stack
endef

# Its prerequisites two at a time: axolotl's venv installs (the network and the disk) while .venv installs and the
# library builds (the cores); each one's output printed whole when it is done. The C++ tests on every core: each is a
# process that loads libtorch (about 0.3 s), 24 s one at a time.
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target lint build $(AXOLOTL_VENV)/.ready
	$(VENV)/bin/ctest --test-dir $(BUILD_DIR) --output-on-failure -j $$(nproc)
	$(run-example-cpp)
	$(PY) -m pytest $(PYTEST_PARALLEL) python_tests
	$(run-axolotl-tests)

# axolotl 0.19.0 pins other transformers, peft and trl releases (5.16.1, 0.20.0, 1.9.0) than $(VENV): its plugin's
# test (python_tests/test_axolotl.py, skipped in $(VENV)) runs in a venv of its own, on this checkout's Python
# sources and the library `build` made (the same torch), with the packed and padded batch tests and apply's loop over
# the layers on that transformers.
# Nothing may reach the Hugging Face hub, and axolotl's telemetry is opt-out. TRL 1.9's GRPO and DPO trainers score
# tokens from the whole logits (no fused LM head): their tests there check the callback leaves that alone, saying so.
# Its SFTTrainer patches the model's forward with a chunked loss of its own: its tests there check both orders.
AXOLOTL_VENV_TESTS := python_tests/test_axolotl.py python_tests/test_real_batches.py python_tests/test_layer_loop.py \
	python_tests/test_trainers.py::test_sft_trainer_losses_equal_step_by_step \
	python_tests/test_trainers.py::test_sft_trainer_callback_losses_equal \
	python_tests/test_trainers.py::test_grpo_trainer_callback_losses_and_gradients_equal \
	python_tests/test_trainers.py::test_dpo_trainer_callback_losses_and_gradients_equal \
	python_tests/test_trainers.py::test_rl_trainer_scoring_from_whole_logits_is_warned_about
define run-axolotl-tests
	TORCH_OFFLOAD_LIBRARY=$$($(PY) -c 'import torch_offload; print(torch_offload.library_path())') \
	  TORCH_OFFLOAD_REQUIRE_AXOLOTL=1 HF_HUB_OFFLINE=1 AXOLOTL_DO_NOT_TRACK=1 \
	  $(AXOLOTL_VENV)/bin/python -m pytest $(PYTEST_PARALLEL) $(AXOLOTL_VENV_TESTS)
endef

$(AXOLOTL_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(AXOLOTL_VENV)
	$(AXOLOTL_VENV)/bin/pip install --upgrade pip
	$(AXOLOTL_VENV)/bin/pip install torch==$(TORCH_VERSION) axolotl==0.19.0 pytest pytest-xdist==3.8.0
	touch $@

test-axolotl: build $(AXOLOTL_VENV)/.ready
	$(run-axolotl-tests)

example-cpp: build
	$(run-example-cpp)

# ruff (pyproject.toml) and clang-format (.clang-format) over every tracked source; `ruff format .` and
# `clang-format -i` fix what they report.
lint: $(VENV)/.ready
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	files=$$(git ls-files '*.cpp' '*.h' '*.cu' '*.cuh') && [ -n "$$files" ] && $(VENV)/bin/clang-format --dry-run --Werror $$files

# Rebuilt when the Makefile changes, so that a venv made before a package was added gets it.
$(VENV)/.ready: Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install torch==$(TORCH_VERSION) $(DEV_PACKAGES)
	touch $@

# GoogleTest comes from Debian; install it only when CMake could not find it.
gtest:
	@if [ ! -f /usr/include/gtest/gtest.h ]; then \
	  export DEBIAN_FRONTEND=noninteractive; \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq libgtest-dev; \
	fi

# Bench-only: Cut Cross-Entropy (bench/linear_cross_entropy.py compares against it) and the triton it imports,
# in their own directory so that .venv, which the tests run in, stays as it is.
BENCH_DEPS := build/bench-deps
bench-deps: $(VENV)/.ready
	$(PY) -m pip install -q --no-deps --target $(BENCH_DEPS) cut-cross-entropy==25.1.1 triton==3.9.0

# scikit-build-core reuses $(BUILD_DIR), so a second build only recompiles what changed.
build: $(VENV)/.ready gtest
	$(PY) -m pip install --no-build-isolation --no-deps \
	  -C build-dir=$(BUILD_DIR) -C cmake.define.TORCH_OFFLOAD_BUILD_TESTS=ON .

# A binary wheel in dist/ for WHEEL_PYTHON's torch (default: .venv's), which installs without a compiler into an
# environment with that torch: CPU kernels, and CUDA kernels where that torch is a CUDA build and
# $(CUDA_HOME)/bin/nvcc exists (cmake/build_wheel.sh). It needs scikit-build-core, cmake and ninja beside that torch.
WHEEL_PYTHON ?= $(PY)
wheel: $(if $(filter $(PY),$(WHEEL_PYTHON)),$(VENV)/.ready)
	CUDA_HOME=$(CUDA_HOME) cmake/build_wheel.sh $(WHEEL_PYTHON) dist -C build-dir=build/wheel

$(CUDA_VENV)/.ready: Makefile
	$(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/pip install --upgrade pip
	$(CUDA_VENV)/bin/pip install torch==$(CUDA_TORCH_VERSION) $(DEV_PACKAGES)
	touch $@

# Compiles every .cu file with nvcc (sm_80, sm_90) and links the CUDA-enabled
# library (shared CUDA runtime only, checked with readelf and nm; a torch of another
# CUDA major version is refused at configure time) and its C++ tests against a CUDA
# build of torch, installs the package into $(CUDA_VENV) as a user's pip would, then runs the C++ tests:
# on a machine without a GPU that checks the CPU paths of the CUDA build and
# skips the GPU tests. torch's CMake config wants libnvrtc, which a toolkit
# without the math libraries lacks: take the one torch's wheels ship.
cuda-check: $(VENV)/.ready $(CUDA_VENV)/.ready gtest
	@nvrtc=$$(ls $(CUDA_HOME)/lib64/libnvrtc.so* 2>/dev/null | head -n1); \
	[ -n "$$nvrtc" ] || nvrtc=$$(ls $$PWD/$(CUDA_VENV)/lib/python3*/site-packages/nvidia/*/lib/libnvrtc.so.* | head -n1); \
	set -x; \
	$(CUDA_VENV)/bin/pip install -v --no-build-isolation --no-deps -C build-dir=$(CUDA_BUILD_DIR) -C build.verbose=true \
	  -C cmake.define.TORCH_OFFLOAD_CUDA=ON -C cmake.define.TORCH_OFFLOAD_BUILD_TESTS=ON \
	  -C cmake.define.CMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc \
	  -C cmake.define.CUDA_TOOLKIT_ROOT_DIR=$(CUDA_HOME) -C cmake.define.CUDA_nvrtc_LIBRARY=$$nvrtc .
	$(CUDA_VENV)/bin/ctest --test-dir $(CUDA_BUILD_DIR) --output-on-failure -j $$(nproc)
	cmake/check_cuda_runtime.sh $(CUDA_BUILD_DIR)/libtorch_offload.so
	PATH=$$PWD/$(VENV)/bin:$$PATH cmake/check_cuda_runtime.sh --mismatch $$PWD/$(CUDA_VENV)/bin/python $(CUDA_HOME)/bin/nvcc

# The test files of the ops, torch.compile and apply(): the parts of the library that lean on torch's dispatcher and
# private corners, run on the supported range's ends too (make test runs all files on $(TORCH_VERSION)). A file joins
# by its module's mark, `pytestmark = pytest.mark.torch_range` (python_tests/test_op_registration.py fails while an
# op has no test in one).
marked_test_files = $(sort $(notdir $(shell grep -lE '^pytestmark = .*pytest\.mark\.$(1)\b' python_tests/test_*.py)))
OP_TESTS := $(call marked_test_files,torch_range)
# Sequence parallelism's file spawns Gloo ranks that share one xdist worker: about 5 minutes of CI per torch, so it
# runs on $(TORCH_VERSION) (make test) and on the lent GPU machines' torch, the range's oldest end, only (its mark:
# gpu_torch).
GPU_TORCH := 2.11.0
GPU_TORCH_TESTS := $(call marked_test_files,gpu_torch)

# The op tests on the second torch: the CUDA wheel that cuda-check built the package against. Without a GPU
# their CUDA tests skip and the rest runs on the CPU. By hand, as cuda-check: CI (.ci/run) leaves the CUDA build, its
# C++ suite and these files to the range's ends, which run them on CUDA builds too (CI's minutes: .ci/run).
test-cuda-torch: cuda-check
	cd python_tests && $(abspath $(CUDA_VENV))/bin/python -m pytest $(PYTEST_PARALLEL) $(OP_TESTS)

# The ends of the supported torch range (pyproject.toml): the CUDA wheel (cmake/build_wheel.sh), installed where no
# nvcc is, and OP_TESTS on torch 2.11 (the lent GPU machines', which also runs GPU_TORCH_TESTS, the C++ suite and
# cuda-check's checks of what the CUDA build links and refuses) and 2.15 (the newest release), each in its own venv
# that borrows $(CUDA_VENV)'s other packages; then 2.11's wheel refused under 2.15 (.ci/torch_range.sh).
TORCH_RANGE ?= $(GPU_TORCH) 2.15.0
test-torch-range: $(CUDA_VENV)/.ready gtest
	OP_TESTS="$(OP_TESTS)" GPU_TORCH=$(GPU_TORCH) GPU_TORCH_TESTS="$(GPU_TORCH_TESTS)" .ci/torch_range.sh $(CUDA_VENV) $(CUDA_HOME) $(TORCH_RANGE)

# The range's venvs alone (downloads: CI runs it while the README's install builds).
torch-range-venvs: $(CUDA_VENV)/.ready
	.ci/torch_range.sh --venvs $(CUDA_VENV) $(CUDA_HOME) $(TORCH_RANGE)

# On a machine with a GPU: build against that machine's own CUDA torch (GPU_PYTHON's), run every
# CUDA test and the GPU bench, print one table (.ci/gpu_check.py). No venv, no package index needed.
GPU_PYTHON ?= python3
GPU_CHECK_FLAGS ?=
gpu-check:
	$(GPU_PYTHON) .ci/gpu_check.py $(GPU_CHECK_FLAGS)

# The pure-Python wheels the GPU tests need beyond what the lent GPU machines hold (torch 2.11, transformers 5.17,
# no expecttest), downloaded here into .whl/ for gpu-check to install there without an index (docs/layout.md).
GPU_WHEELS := transformers==5.24.0 peft==0.21.2 expecttest
gpu-wheels:
	rm -rf .whl && $(PYTHON) -m pip download -q --no-deps --only-binary=:all: -d .whl $(GPU_WHEELS)

clean:
	rm -rf build
