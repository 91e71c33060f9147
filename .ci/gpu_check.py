"""The GPU check (`make gpu-check`): on a machine with a GPU, build the library against that machine's
own CUDA build of torch, run every CUDA test (pytest's test_*_cuda.py, one process per file, and the
whole C++ suite where GoogleTest is installed), the CPU's error paths and the GPU variant of the
benches, and print one summary table.

    make gpu-check                         # GPU_PYTHON=python3: the interpreter that holds CUDA torch
    make gpu-check GPU_CHECK_FLAGS="--tests test_rms_norm_cuda.py"  # a rerun of one file, then the benches
    python3 .ci/gpu_check.py --allow-no-gpu  # the same steps where no GPU is (every GPU test skips)
    make gpu-check GPU_CHECK_FLAGS="--wheel build/torch-2.11.0/dist/torch_offload-0.1.0-py3-none-linux_x86_64.whl"
                                           # the torch range's wheel of the machines' torch, carried: no build
    make gpu-check GPU_CHECK_FLAGS="--tests test_rms_norm_cuda.py --benches plan-review --bench-after 600"
                                           # issue 72's comparison of apply()'s GPU settings, profiled
    make gpu-check GPU_CHECK_FLAGS="--tests test_chunk_recurrent_cuda.py --benches step --bench-after 600"
                                           # issue 73's: the chunk-recurrent step's tests, then its bench

It needs no package index: packages the machine lacks (expecttest, for opcheck) can be put as
wheels in .whl/, which is installed into build/gpu-check/site first. Exits non-zero if a step fails.
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD = os.path.join(ROOT, "build", "gpu-check")


def run(step, command, env=None, results=None):
    """Runs command from the repository root, echoing its output; records (step, rc, seconds)."""
    print(f"\n=== {step}: {' '.join(command)}", flush=True)
    start = time.monotonic()
    rc = subprocess.run(command, cwd=ROOT, env=env).returncode
    results.append({"step": step, "rc": rc, "seconds": time.monotonic() - start})
    return rc


def cuda_toolkit():
    """$CUDA_HOME, else the toolkit of the nvcc on PATH, else /usr/local/cuda: the first holding nvcc and headers."""
    nvcc = shutil.which("nvcc")
    candidates = [
        os.environ.get("CUDA_HOME"),
        nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc))),
        "/usr/local/cuda",
    ]
    for home in filter(None, candidates):
        if os.path.exists(os.path.join(home, "bin", "nvcc")) and os.path.exists(
            os.path.join(home, "include", "cuda_runtime.h")
        ):
            return home
    sys.exit(f"gpu-check: no CUDA toolkit (nvcc and its headers) in {[c for c in candidates if c]}; set CUDA_HOME")


def nvrtc_library(python, cuda_home):
    """torch's CMake config wants libnvrtc: the toolkit's, else the one torch's wheels ship."""
    found = sorted(glob.glob(os.path.join(cuda_home, "lib64", "libnvrtc.so*")))
    if not found:
        site = subprocess.check_output([python, "-c", "import site; print(site.getsitepackages()[0])"], text=True)
        found = sorted(glob.glob(os.path.join(site.strip(), "nvidia", "*", "lib", "libnvrtc.so.*")))
    return found[0] if found else None


def cmake_binary():
    """The pip cmake package's binary where GPU_PYTHON has it (recent enough for CUDA 20), else cmake on PATH."""
    try:
        import cmake
    except ImportError:
        return "cmake"
    return os.path.join(cmake.CMAKE_BIN_DIR, "cmake")


def build_here(python, jobs, with_gtest, env, results):
    """Configures and builds the library (and its C++ suite, which then runs) against python's torch in BUILD."""
    cmake = cmake_binary()
    configure = [
        cmake,
        "-S",
        ".",
        "-B",
        BUILD,
        "-G",
        "Ninja",
        f"-DPython3_EXECUTABLE={python}",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DTORCH_OFFLOAD_CUDA=ON",
        f"-DTORCH_OFFLOAD_BUILD_TESTS={'ON' if with_gtest else 'OFF'}",
    ]
    cuda_home = cuda_toolkit()
    configure += [f"-DCMAKE_CUDA_COMPILER={cuda_home}/bin/nvcc", f"-DCUDA_TOOLKIT_ROOT_DIR={cuda_home}"]
    nvrtc = nvrtc_library(python, cuda_home)
    if nvrtc:
        configure.append(f"-DCUDA_nvrtc_LIBRARY={nvrtc}")
    built = (
        run("configure", configure, env, results) == 0
        and run("build", [cmake, "--build", BUILD, "--parallel", str(jobs)], env, results) == 0
    )
    if built and with_gtest:
        ctest = os.path.join(os.path.dirname(cmake), "ctest") if os.path.isabs(cmake) else "ctest"
        # The whole suite: the CPU tests tell the build's own faults (error paths) from the GPU's.
        run("C++ tests", [ctest, "--test-dir", BUILD, "-j", str(jobs), "--output-on-failure"], env, results)
    return built


def pytest_counts(report):
    """{test file: [passed, failed, skipped]} from pytest's JUnit XML report."""
    counts = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        # "python_tests.test_x" (a collection error names the module only, in `name`)
        module = (case.get("classname") or case.get("name", "")).split(".")
        name = next((part for part in module if part.startswith("test_")), ".".join(module)) + ".py"
        row = counts.setdefault(name, [0, 0, 0])
        if case.find("failure") is not None or case.find("error") is not None:
            row[1] += 1
        elif case.find("skipped") is not None:
            row[2] += 1
        else:
            row[0] += 1
    return counts


# Each set's steps: the script (the name's first word) and its arguments.
BENCHES = {
    "standard": {
        "bench/gpu_llama.py": ["--tokens", "8192,32768", "--longest-seconds", "45"],
        "bench/compile.py (GPU)": ["--device", "cuda", "--tokens", "2048", "--rounds", "1", "--offload", "none,cpu"],
    },
    # apply()'s GPU default against two of its settings and plain training, each point's time split by the profiler
    # (forward, recompute, attention backward, copies): the comparison issue 72 asks a lease for first.
    "plan-review": {
        f"bench/gpu_llama.py ({layers} layers, profiled)": [
            *("--tokens", "8192,32768", "--layers", str(layers), "--profile"),
            *("--configs", "plain,apply,apply_rms_norm_off,apply_no_checkpoint"),
        ]
        for layers in (2, 4)
    },
    # Issue 73's: the chunk-recurrent step against plain training and apply() at 32K tokens, then its device memory
    # from 128K to 512K tokens and doubling past it (to a million) while a step runs within the minutes given.
    "step": {
        "bench/gpu_llama.py (the step at 32K)": ["--tokens", "32768", "--configs", "plain,apply,step"],
        "bench/gpu_llama.py (the step, 128K-512K and longer)": [
            *("--tokens", "131072,524288", "--configs", "step", "--longest-seconds", "240"),
        ],
    },
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--allow-no-gpu", action="store_true", help="run the steps where no GPU is (they skip)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    parser.add_argument(
        "--tests", default="test_*_cuda.py", help="the GPU test files to run, a glob in python_tests/ (a rerun's)"
    )
    parser.add_argument(
        "--wheel",
        help="a torch_offload wheel built for this machine's torch (the torch range's, build/torch-2.11.0/dist), "
        "installed instead of a build here; the C++ suite then does not run",
    )
    parser.add_argument(
        "--bench-after", type=float, default=240, help="skip the benches if the steps before took longer (seconds)"
    )
    parser.add_argument("--benches", choices=BENCHES, default="standard", help="which set of GPU benches runs")
    args = parser.parse_args()
    test_files = sorted(glob.glob(os.path.join(ROOT, "python_tests", args.tests)))
    if not test_files:  # before the build: a lease's minutes are few
        sys.exit(f"gpu-check: no test file matches python_tests/{args.tests}")
    started = time.monotonic()
    python = sys.executable
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if gpu is None and not args.allow_no_gpu:
        sys.exit("gpu-check: torch sees no GPU here (torch.cuda.is_available() is False); nothing to check")
    if torch.version.cuda is None:
        sys.exit(f"gpu-check: {python} holds torch {torch.__version__}, a CPU-only build; set GPU_PYTHON")
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCH_OFFLOAD_FAILURES_AT_ONCE="1")
    site = os.path.join(BUILD, "site")
    wheels = sorted(glob.glob(os.path.join(ROOT, ".whl", "*.whl")))
    results = []
    if wheels:
        run(
            "carried wheels",
            [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", site, *wheels],
            env,
            results,
        )
    env["PYTHONPATH"] = os.pathsep.join([ROOT, site, env.get("PYTHONPATH", "")])

    with_gtest = os.path.exists("/usr/include/gtest/gtest.h") and not args.wheel
    if args.wheel:
        # A wheel built elsewhere for this torch (the torch range's, in CI): nothing to compile on the lease.
        install = [python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", site]
        built = run("the torch_offload wheel", [*install, args.wheel], env, results) == 0
        library = os.path.join(site, "torch_offload", "libtorch_offload.so")
    else:
        built = build_here(python, args.jobs, with_gtest, env, results)
        library = os.path.join(BUILD, "libtorch_offload.so")
    if built:
        env["TORCH_OFFLOAD_LIBRARY"] = library
        # Errors raised on the CPU, whose messages format numbers, and the library's own C++ runtime: the H200 of
        # 2026-11-27 built with a g++ that linked libstdc++ statically, and such errors segfaulted.
        cpu_errors = "test_bad_inputs_raise_errors_naming_the_argument or test_the_library_carries_no_cxx_runtime"
        tests = ["python_tests/test_linear_cross_entropy.py", "python_tests/test_attention_block.py"]
        run(
            "CPU errors and the C++ runtime",
            [
                python,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "-k",
                cpu_errors,
                *tests,
                "python_tests/test_offload_ops.py",
            ],
            env,
            results,
        )
        # One process per file: a crash (a segfault in a kernel) costs only its own file's results.
        reports = []
        for test in test_files:
            reports.append(os.path.join(BUILD, os.path.basename(test) + ".xml"))
            pytest = [python, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider"]
            run(f"pytest {os.path.basename(test)}", [*pytest, f"--junitxml={reports[-1]}", test], env, results)
        for step, options in BENCHES[args.benches].items():
            if gpu is None:
                break
            if time.monotonic() - started > args.bench_after:  # the call's minutes go to the tests first
                print(f"\n=== {step}: skipped, {time.monotonic() - started:.0f} s have gone", flush=True)
                continue
            run(step, [python, step.split()[0], *options], env, results)

    print(f"\n## gpu-check: {gpu or 'no GPU'}, torch {torch.__version__} (CUDA {torch.version.cuda})\n")
    print("| step | result | seconds |\n| --- | --- | ---: |")
    for r in results:
        outcome = "ok" if r["rc"] == 0 else f"FAILED (exit {r['rc']})"
        print(f"| {r['step']} | {outcome} | {r['seconds']:.0f} |")
    if built:
        print("\n| test file | passed | failed | skipped |\n| --- | ---: | ---: | ---: |")
        for report in reports:
            if not os.path.exists(report):
                print(f"| {os.path.basename(report)[:-4]} | crashed before its report | | |")
                continue
            for name, (passed, failed, skipped) in sorted(pytest_counts(report).items()):
                print(f"| {name} | {passed} | {failed} | {skipped} |")
    if args.wheel:
        print(f"\nThe library came from {args.wheel}: the C++ suite was not built or run.")
    elif not with_gtest:
        print("\nThe C++ suite was not built: GoogleTest (/usr/include/gtest) is not installed here.")
    if gpu is None:
        print("\nNo GPU: every GPU test skipped and the GPU bench did not run; this proves nothing about the GPU.")
    sys.exit(0 if built and all(r["rc"] == 0 for r in results) else 1)


if __name__ == "__main__":
    main()
