"""What the benchmark scripts share: peak resident memory of a worker process, its slope over token lengths,
the machine, and their BENCHMARKS.md sections."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def status_bytes(field):
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def reset_peak_rss():
    """Set VmHWM to VmRSS (Linux >= 4.0); ru_maxrss could not be reset, and it even
    carries the parent's peak across fork and exec."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return status_bytes("VmRSS")


def measured_step(step, gpu):
    """Runs step() once to warm up, then once measured: its value, its seconds, and its peak memory over what was
    held before it (the GPU's allocated bytes with gpu, else the resident set)."""
    import torch

    step()
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = reset_peak_rss()
    start = time.perf_counter()
    value = step()
    if gpu:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if gpu else status_bytes("VmHWM")
    return value, seconds, peak - before


def measured_long_step(step, tokens):
    """step(128) to warm up, then step(tokens) measured on the CPU: its value, its seconds, and the growth of the
    resident set during it."""
    step(128)
    before = reset_peak_rss()
    start = time.perf_counter()
    value = step(tokens)
    seconds = time.perf_counter() - start
    return value, seconds, status_bytes("VmHWM") - before


def run_worker(script, arguments, env):
    """``script --run *arguments`` in a fresh process with env: its JSON result, its peak and seconds printed."""
    command = [sys.executable, script, "--run", *map(str, arguments)]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout)
    print(f"{arguments[0]} {arguments[1]}: {result['peak'] / 2**20:.0f} MiB, {result['seconds']:.1f} s", flush=True)
    return result


def demo_llama(hidden, intermediate, layers, tokens):
    """The demo's Llama (examples/demo.py): vocabulary 32K, heads of 64, as many key/value heads, SDPA attention."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=tokens,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def slope(points):
    """KiB per token: the least-squares line through (tokens, peak bytes), of points {tokens: {"peak": bytes}}."""
    tokens = list(points)
    mean_t = sum(tokens) / len(tokens)
    mean_b = sum(p["peak"] for p in points.values()) / len(tokens)
    covariance = sum((t - mean_t) * (points[t]["peak"] - mean_b) for t in tokens)
    return covariance / sum((t - mean_t) ** 2 for t in tokens) / 1024


def worker_env():
    """The environment of a measuring worker process. glibc's mmap threshold grows as big blocks are freed,
    after which blocks up to 32 MiB come from the heap and stay in the resident set: fixed at 1 MiB, every
    tensor's memory is returned when freed, and peaks of the resident set are the tensors'."""
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        MALLOC_MMAP_THRESHOLD_=str(1 << 20),
    )


def user_env():
    """The environment of a worker that measures what a user's process shows: glibc's own settings (no MALLOC_*
    variable), the repository on the path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


# A line in a section after which BENCHMARKS.md's hand-written notes on that run are kept when the section is rewritten.
KEPT_NOTES = "<!-- notes below are kept when --write rewrites this section -->"


def write_section(title, text):
    """Replace BENCHMARKS.md's section `## {title}` by `text`, where it stands, keeping what follows its KEPT_NOTES
    line; else append it."""
    path = ROOT / "BENCHMARKS.md"
    doc = (
        path.read_text()
        if path.exists()
        else (
            "# Benchmarks\n\nRatios are taken side by side in one run; "
            "each section gives the command that produced it.\n"
        )
    )
    start = doc.find(f"\n## {title}\n")
    if start < 0:
        path.write_text(doc.rstrip("\n") + "\n\n" + text)
        return
    end = doc.find("\n## ", start + 1)
    after = doc[end + 1 :] if end >= 0 else ""
    section = doc[start : end if end >= 0 else len(doc)]
    if KEPT_NOTES in section:
        text = text.rstrip("\n") + "\n\n" + section[section.find(KEPT_NOTES) :].strip("\n") + "\n"
    path.write_text(doc[: start + 1] + text.rstrip("\n") + "\n" + ("\n" + after if after else ""))


def machine():
    """torch, threads, vector ISA, CPU model and load: what a timing depends on."""
    import torch

    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads "
        f"({torch.backends.cpu.get_cpu_capability()}), {cpu}, load average {os.getloadavg()[0]:.1f} at the end"
    )
