"""Where the chunk-recurrent step (chunk_recurrent.py) keeps what grows with the sequence: ``ChunkStore``, tensors by
key in two tiers, and ``return_freed_memory``, which keeps the heap from holding the chunks' freed blocks.

The tiers: host memory through ``offload_pack`` (on a GPU the pinned arena, copied on the copy stream; on a CPU a
copy, the host tier standing in for a GPU's: the GPU step's test mode) up to a host budget, and past it the disk
tier (torch_offload.disk: the process's unnamed spill file, written by its I/O threads with checksums and O_DIRECT
where the file system takes it, its freed extents given back), where the oldest host entries go first, never to
pageable memory. Without a host budget (the CPU step's default) every tensor goes to the file: the process's memory
then stays flat in the sequence."""

from __future__ import annotations

import ctypes

import torch

from ..disk import disk_prefetch, disk_read, disk_restore, disk_spill, disk_wait

__all__ = ["ChunkStore", "return_freed_memory"]

_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None)  # glibc's; None with another C library
_ARENA_ALIGNMENT = 256  # bytes: the pinned arena's slices (ops/common/pinned_arena.h, kAlignment)


class ChunkStore:
    """Tensors by key: each written once, read back on ``device`` (default: the CPU) as often as asked, its host
    memory or disk space freed when released. ``host_budget`` (bytes, or None for none) is the most host memory the
    store holds (on a GPU counted in the pinned arena's slices); a write past it first moves the oldest host entries
    (in write order; those whose key begins with a name in ``reread``, read again for every later chunk, after the
    others) to the spill file in ``directory`` and waits for those writes (on a GPU their pinned slices are what the
    new entry takes), and a tensor larger than the whole budget goes there at once. On a GPU an entry the arena has
    no room for (other users hold it) goes to the file too, and the oldest host entry with it, so that none waits in
    pageable memory. A tensor changed in place before its copy is done fails: in the file its checksum when read (the
    tier's error, as a removed directory's or a full disk's); in host memory, for the keys whose name is in
    ``watched`` (what the model's own code holds too), ``settle()``, which waits for the writes to the file so far
    (so that the memory of what is being written stays one chunk's) and checks that none of those tensors written
    since the last one changed by then."""

    def __init__(
        self,
        directory: str,
        allow_tmpfs: bool = False,
        *,
        host_budget: int | None = None,
        device: torch.device | None = None,
        reread: frozenset = frozenset(),
        watched: frozenset = frozenset(),
    ):
        self._directory, self._allow_tmpfs = directory, allow_tmpfs
        self._host_budget, self._device = host_budget, device or torch.device("cpu")
        self._reread, self._watched = reread, watched
        self._host: dict = {}  # key: its host copy, oldest first
        self._moved_first: dict = {}  # the keys of _host not in reread, oldest first (values unused)
        self._host_bytes = 0
        self._tickets: dict = {}  # key: (ticket, shape, dtype), in the file
        self._ahead: dict = {}  # key: (its copy on the device, the event its copy's stream records), read ahead
        # Reads ahead wait for their copies on a stream of their own, the step's stream only when it reads them.
        self._side = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._writing: list = []  # the tickets written since the last settle()
        self._copying: list = []  # (key, tensor, its version) of watched keys copied to host memory since then
        self.peak_host_bytes = 0
        self.disk_bytes = 0  # written to the file
        self.moved_to_disk = 0  # host entries the budget sent to the file

    def write(self, key, tensor: torch.Tensor) -> None:
        self.release(key)
        tensor = tensor.detach()
        held = self._held(tensor.nbytes)
        if self._host_budget is None or held > self._host_budget:
            self._spill(key, tensor)
            return
        moved = []
        while self._host_bytes + held > self._host_budget:
            moved.append(self._move_oldest())
        self._wait(moved)
        packed = torch.ops.offload.offload_pack(tensor, True)
        if self._side is not None and tensor.numel() and not packed.is_pinned():  # the arena had no room left
            self._spill(key, packed)
            self._wait([self._move_oldest()] if self._host else [])  # room for the next one
            return
        self._host[key] = packed
        if _name(key) not in self._reread:
            self._moved_first[key] = None
        self._host_bytes += held
        if _name(key) in self._watched:
            self._copying.append((key, tensor, tensor._version))
        self.peak_host_bytes = max(self.peak_host_bytes, self._host_bytes)

    def _held(self, nbytes: int) -> int:
        """The host memory an entry of ``nbytes`` holds: on a GPU, the pinned arena's slices round up."""
        return nbytes if self._side is None else -(-nbytes // _ARENA_ALIGNMENT) * _ARENA_ALIGNMENT

    def _move_oldest(self) -> torch.Tensor:
        """The oldest host entry (not reread, where there is one) to the file; its ticket."""
        key = next(iter(self._moved_first)) if self._moved_first else next(iter(self._host))
        self.moved_to_disk += 1
        return self._spill(key, self._pop_host(key))  # the tier waits for a pending copy before it reads

    @staticmethod
    def _wait(tickets) -> None:
        for ticket in tickets:  # their host memory back before a new copy takes some
            disk_wait(ticket)

    def _spill(self, key, tensor: torch.Tensor) -> torch.Tensor:
        ticket = disk_spill(tensor, directory=self._directory, allow_tmpfs=self._allow_tmpfs)
        self._tickets[key] = (ticket, tensor.shape, tensor.dtype)
        self._writing.append(ticket)
        self.disk_bytes += tensor.nbytes
        return ticket

    def _pop_host(self, key) -> torch.Tensor:
        packed = self._host.pop(key)
        self._moved_first.pop(key, None)
        self._host_bytes -= self._held(packed.nbytes)
        return packed

    def settle(self) -> None:
        """Wait for the writes to the file so far (their tensors held until then); check the watched tensors copied to
        host memory since the last call (held until then too) for an in-place change."""
        self._wait(self._writing)
        self._writing.clear()
        changed = next((key for key, tensor, version in self._copying if tensor._version != version), None)
        self._copying.clear()
        if changed is not None:
            raise RuntimeError(f"the chunk-recurrent step's store: {changed} was modified in place while it was copied")

    def read(self, key) -> torch.Tensor:
        """A new tensor on the store's device with ``key``'s values."""
        if key in self._ahead:
            return self._finish_read(*self._ahead.pop(key))
        if key in self._host:
            return torch.ops.offload.offload_unpack(self._host[key], self._device)
        ticket, shape, dtype = self._tickets[key]
        return disk_read(ticket, shape, dtype, self._device)

    def prefetch(self, key, from_file: bool = True) -> None:
        """Start reading ``key`` back, so that its next read finds it on the device (a host entry: its copy running
        on a copy stream while the step computes) or in memory (one in the file, unless not ``from_file``); nothing
        where it is not kept."""
        if key in self._tickets:
            if from_file:
                disk_prefetch(self._tickets[key][0])
        elif key in self._host and key not in self._ahead:
            self._ahead[key] = self._start_read(self._host[key])

    def _start_read(self, packed: torch.Tensor):
        if self._side is None:  # the CPU: copied now
            return torch.ops.offload.offload_unpack(packed, self._device), None
        with torch.cuda.stream(self._side):  # the side stream, not the step's, waits for the copy
            tensor = torch.ops.offload.offload_unpack(packed, self._device)
            ready = torch.cuda.Event()
            ready.record(self._side)
        return tensor, ready

    def _finish_read(self, tensor: torch.Tensor, ready) -> torch.Tensor:
        if ready is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(ready)
            tensor.record_stream(stream)  # its memory is the copy's stream's
        return tensor

    def pop(self, key) -> torch.Tensor:
        """read, then release."""
        if key in self._ahead or key in self._host:
            tensor = self.read(key)
            self.release(key)
            return tensor
        ticket, shape, dtype = self._tickets.pop(key)
        return disk_restore(ticket, shape, dtype, self._device)

    def has(self, key) -> bool:
        return key in self._host or key in self._tickets

    def release(self, key) -> None:
        self._ahead.pop(key, None)
        if key in self._host:
            self._pop_host(key)
        self._tickets.pop(key, None)  # the ticket's extents are freed with it

    def close(self) -> None:
        self._ahead.clear()
        self._copying.clear()
        self._host.clear()
        self._moved_first.clear()
        self._host_bytes = 0
        self._tickets.clear()
        self._writing.clear()


def _name(key) -> object:
    return key[0] if isinstance(key, tuple) else key


def return_freed_memory() -> None:
    """Hand the heap's free pages back to the system (glibc's malloc_trim): glibc keeps freed blocks of up to 32 MiB
    resident by default, and a chunk's tensors, freed and taken again in other sizes, would pile them up layer after
    layer."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
