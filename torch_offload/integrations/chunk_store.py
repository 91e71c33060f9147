"""Where the chunk-recurrent step (chunk_recurrent.py) keeps what grows with the sequence: ``ChunkStore``, tensors by
key in the disk tier (torch_offload.disk: the process's unnamed spill file, written by its I/O threads with
checksums and O_DIRECT where the file system takes it, its freed extents given back); and ``return_freed_memory``,
which keeps the heap from holding the chunks' freed blocks."""

from __future__ import annotations

import ctypes

import torch

from ..disk import disk_prefetch, disk_read, disk_restore, disk_spill, disk_wait

__all__ = ["ChunkStore", "return_freed_memory"]

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None with another C library


class ChunkStore:
    """Tensors by key in the disk tier's spill file in ``directory``: each written once, read back as often as asked,
    prefetched ahead of a read, its disk space freed when released. A tensor changed in place before its write is
    done fails its checksum when read (the tier's error, as a removed directory's or a full disk's); ``settle()``
    waits for the writes so far, so that the memory of what is being written stays one chunk's."""

    def __init__(self, directory: str, allow_tmpfs: bool = False):
        self._directory, self._allow_tmpfs = directory, allow_tmpfs
        self._tickets: dict = {}  # key: (ticket, shape, dtype)
        self._writing: list = []  # the tickets written since the last settle()

    def write(self, key, tensor: torch.Tensor) -> None:
        self.release(key)
        ticket = disk_spill(tensor.detach(), directory=self._directory, allow_tmpfs=self._allow_tmpfs)
        self._tickets[key] = (ticket, tensor.shape, tensor.dtype)
        self._writing.append(ticket)

    def settle(self) -> None:
        """Wait for the writes so far (their tensors held until then)."""
        for ticket in self._writing:
            disk_wait(ticket)
        self._writing.clear()

    def read(self, key) -> torch.Tensor:
        ticket, shape, dtype = self._tickets[key]
        return disk_read(ticket, shape, dtype, "cpu")

    def prefetch(self, key) -> None:
        """Start reading ``key`` back, so that its next read finds it in memory (nothing where it is not kept)."""
        if key in self._tickets:
            disk_prefetch(self._tickets[key][0])

    def pop(self, key) -> torch.Tensor:
        """read, then release."""
        ticket, shape, dtype = self._tickets.pop(key)
        return disk_restore(ticket, shape, dtype, "cpu")

    def has(self, key) -> bool:
        return key in self._tickets

    def release(self, key) -> None:
        self._tickets.pop(key, None)  # the ticket's extents are freed with it

    def close(self) -> None:
        self._tickets.clear()
        self._writing.clear()


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): glibc keeps freed blocks of up to 32 MiB
    resident by default, and a chunk's tensors, freed and taken again in other sizes, would pile them up layer after
    layer."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
