"""The disk tier: tensors written asynchronously to an anonymous per-process spill file.

The spill file lives in ``directory``, else ``$TORCH_OFFLOAD_SPILL_DIR``, else the
system temp directory. It has no name (O_TMPFILE, or unlinked at once), so
nothing is left behind on any exit, SIGKILL included; it is closed once no ticket
uses it, and the I/O threads give freed extents' blocks back to the file system. RAM
file systems (tmpfs, ramfs) are refused unless ``allow_tmpfs=True``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import torch

from ._options import check_bool, check_path

__all__ = [
    "disk_spill",
    "disk_restore",
    "disk_read",
    "disk_prefetch",
    "disk_wait",
    "disk_spill_stats",
    "configure_disk_spill",
]

_STATS = (
    "bytes_written",
    "bytes_read",
    "extents_live",
    "peak_file_bytes",
    "write_ns",
    "read_ns",
    "tickets_live",
    "restore_cache_hits",
    "restore_cache_kept_bytes",
    "heap_trims",
)


_RAM_FILE_SYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


def default_spill_directory() -> str:
    """Where disk_spill writes when given no directory: ``$TORCH_OFFLOAD_SPILL_DIR``, else the temp
    directory as the library finds it (``std::filesystem::temp_directory_path``: the first of TMPDIR,
    TMP, TEMP and TEMPDIR that is set, else /tmp)."""
    spill_dir = os.environ.get("TORCH_OFFLOAD_SPILL_DIR")
    if spill_dir:
        return spill_dir
    return next((os.environ[name] for name in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if name in os.environ), "/tmp")


def spill_directory_in_ram(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is on a RAM file system (what disk_spill refuses without allow_tmpfs), by
    the longest mount point of /proc/self/mounts above it."""
    path = os.path.realpath(directory)
    mount_point, file_system = "", None
    with open("/proc/self/mounts") as mounts:
        for line in mounts:
            _, point, kind = line.split()[:3]
            point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape.group(1), 8)), point)  # e.g. \040
            inside = path == point or path.startswith(point.rstrip("/") + "/")
            if inside and len(point) >= len(mount_point):
                mount_point, file_system = point, kind
    return file_system in _RAM_FILE_SYSTEMS


def disk_spill(
    src: torch.Tensor, *, directory: str | os.PathLike | None = None, allow_tmpfs: bool = False
) -> torch.Tensor:
    """Start writing ``src`` to disk and return its ticket (a small CPU int64 tensor) at once.

    The write runs on I/O threads; do not modify ``src`` in place until
    :func:`disk_wait` returns. Freeing the ticket frees the disk space.
    """
    directory = check_path(directory, "directory", "disk_spill")
    return torch.ops.offload.disk_spill(src, directory, check_bool(allow_tmpfs, "allow_tmpfs", "disk_spill"))


def disk_restore(ticket: torch.Tensor, size: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """The spilled tensor back on ``device`` (cpu or cuda). A ticket is restored once; ``size``
    and ``dtype`` must be those of the spilled tensor. Raises the write's error if it failed."""
    return torch.ops.offload.disk_restore(ticket, list(size), dtype, torch.device(device))


def disk_read(ticket: torch.Tensor, size: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """The spilled tensor back on ``device``, as disk_restore gives it, the ticket kept: read it again as often as
    asked (a disk_prefetch serves the next read), until restored or freed."""
    return torch.ops.offload.disk_read(ticket, list(size), dtype, torch.device(device))


def disk_prefetch(ticket: torch.Tensor) -> None:
    """Start reading the ticket back (once its write is done) so :func:`disk_restore` finds it in memory."""
    torch.ops.offload.disk_prefetch(ticket)


def disk_wait(ticket: torch.Tensor) -> None:
    """Block until the ticket is on disk; raise the write's error (e.g. ENOSPC, EFBIG) if it failed."""
    torch.ops.offload.disk_wait(ticket)


def disk_spill_stats() -> dict[str, float]:
    """bytes_written, bytes_read, extents_live, peak_file_bytes, tickets_live,
    write_seconds / read_seconds (summed over the I/O threads), restore_cache_hits
    (restores that reused a freed restore buffer), restore_cache_kept_bytes and heap_trims
    (how often the I/O threads gave the heap's free pages back to the system: every 64 MiB
    written or restored, with glibc)."""
    stats = dict(zip(_STATS, torch.ops.offload.disk_spill_stats()))
    stats["write_seconds"] = stats.pop("write_ns") / 1e9
    stats["read_seconds"] = stats.pop("read_ns") / 1e9
    return stats


def configure_disk_spill(
    *,
    num_threads: int = 4,
    extent_bytes: int = 32 << 20,
    checksums: bool = True,
    max_in_flight_bytes: int = 512 << 20,
    restore_cache_bytes: int = 0,
) -> None:
    """Set the I/O threads, the extent size (one checksummed header each), whether
    payloads are checksummed, how many bytes of unfinished writes ``disk_spill``
    allows before it waits, and how many bytes of freed restored tensors are kept
    for the next restores of the same size (fresh memory costs a page fault and
    zeroing per page, and in a VM a round trip to the hypervisor; kept buffers are
    lazily freed, MADV_FREE, so the kernel takes them back when memory runs short,
    but they count in the resident set until then: 0, the default, keeps none).
    Waits for the I/O in flight (freed tickets' too, their disk space given back) to finish first."""
    torch.ops.offload.disk_spill_configure(
        num_threads, extent_bytes, checksums, max_in_flight_bytes, restore_cache_bytes
    )
