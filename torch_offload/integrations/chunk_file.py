"""Where the chunk-recurrent step (chunk_recurrent.py) keeps what grows with the sequence: ``ChunkFile``, tensors by
key in one unnamed file; and ``return_freed_memory``, which keeps the heap from holding the chunks' freed blocks."""

from __future__ import annotations

import ctypes
import os
import tempfile
from collections import defaultdict

import torch

__all__ = ["ChunkFile", "return_freed_memory"]

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None with another C library


class ChunkFile:
    """Tensors by key in one unnamed file in ``directory`` (gone on any exit), each written and read whole; a
    released tensor's bytes are taken by the next tensor of the same size."""

    largest_bytes = 0  # the largest any chunk file of this process has grown (bench/long_context.py reads it)

    def __init__(self, directory: str):
        self._directory = directory
        try:
            self._file = tempfile.TemporaryFile(dir=directory)  # O_TMPFILE, or unlinked at once
        except OSError as error:
            raise self._error(error, "cannot hold the step's file") from None
        self._end = 0
        self._slots: dict = {}  # key: (offset, shape, dtype)
        self._free: defaultdict[int, list[int]] = defaultdict(list)  # bytes: offsets

    def write(self, key, tensor: torch.Tensor) -> None:
        data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        self.release(key)
        size = data.numel()
        offset = self._free[size].pop() if self._free[size] else self._grow(size)
        view, done = memoryview(data.numpy()), 0
        try:
            while done < size:
                done += os.pwrite(self._file.fileno(), view[done:], offset + done)
        except OSError as error:  # a full disk, say: the caller closes the file, and nothing is left behind
            raise self._error(error, f"took {offset + done} bytes and no more") from None
        self._slots[key] = (offset, tensor.shape, tensor.dtype)

    def _error(self, error: OSError, what: str) -> OSError:
        return OSError(
            error.errno, f"chunk_recurrent_loss: the spill directory {self._directory!r} {what}: {error.strerror}"
        )

    def read(self, key) -> torch.Tensor:
        offset, shape, dtype = self._slots[key]
        out = torch.empty(shape, dtype=dtype)
        view, done = memoryview(out.reshape(-1).view(torch.uint8).numpy()), 0
        while done < len(view):
            read = os.preadv(self._file.fileno(), [view[done:]], offset + done)
            if read == 0:
                raise OSError(f"chunk_recurrent_loss: the chunk file ended inside {key}")
            done += read
        return out

    def has(self, key) -> bool:
        return key in self._slots

    def pop(self, key) -> torch.Tensor:
        """read, then release."""
        tensor = self.read(key)
        self.release(key)
        return tensor

    def release(self, key) -> None:
        slot = self._slots.pop(key, None)
        if slot is not None:
            offset, shape, dtype = slot
            self._free[shape.numel() * dtype.itemsize].append(offset)

    def close(self) -> None:
        self._file.close()

    def __del__(self):  # a graph freed without backward, or kept for a second one
        if hasattr(self, "_file"):  # not when the file could not be made
            self.close()

    def _grow(self, size: int) -> int:
        offset, self._end = self._end, self._end + size
        ChunkFile.largest_bytes = max(ChunkFile.largest_bytes, self._end)
        return offset


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): glibc keeps freed blocks of up to 32 MiB
    resident by default, and a chunk's tensors, freed and taken again in other sizes, would pile them up layer after
    layer."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
