"""What the benchmark scripts share: peak resident memory of a worker process, and their BENCHMARKS.md sections."""
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


def write_section(title, text):
    """Replace (or append) BENCHMARKS.md's section `## {title}` by `text`."""
    path = ROOT / "BENCHMARKS.md"
    doc = path.read_text() if path.exists() else (
        "# Benchmarks\n\nRatios are taken side by side in one run; each section gives the command that produced it.\n")
    start = doc.find(f"\n## {title}\n")
    if start >= 0:
        end = doc.find("\n## ", start + 1)
        doc = doc[:start] + doc[end if end >= 0 else len(doc):]
    path.write_text(doc.rstrip("\n") + "\n\n" + text)
