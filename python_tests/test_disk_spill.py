"""disk_spill / disk_restore: round trips, errors, crash safety, corruption, concurrency,
disk space given back, fork."""

import contextlib
import ctypes
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from torch.testing._internal.optests import opcheck

import torch_offload

pytestmark = pytest.mark.torch_range

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def spill_dir(tmp_path):
    directory = tmp_path / "spill"
    directory.mkdir()
    return str(directory)


def sample(shape, dtype):
    values = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)), dtype=torch.float64) * 100
    return values.gt(0) if dtype == torch.bool else values.to(dtype)


def round_trip(t, spill_dir):
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    return torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_round_trip_is_bitwise_for_every_dtype(dtype, spill_dir):
    t = sample((37, 129), dtype)
    back = round_trip(t, spill_dir)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(
        back.view(torch.uint8) if dtype != torch.bool else back, t.view(torch.uint8) if dtype != torch.bool else t
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(0, 5),
        lambda: torch.tensor(3.25),
        lambda: sample((16, 24), torch.float32).t(),
        lambda: sample((1, 64), torch.float32).expand(9, 64),
        lambda: sample((8, 8, 8), torch.float16)[:, ::3, 1:],
    ],
    ids=["zero_size", "zero_dim", "transposed", "expanded", "strided"],
)
def test_round_trip_of_any_layout(make, spill_dir):
    t = make()
    back = round_trip(t, spill_dir)
    assert back.is_contiguous() and torch.equal(back, t)


def test_extents_span_many_blocks_and_leave_nothing(spill_dir):
    torch_offload.configure_disk_spill(extent_bytes=64 << 10)
    try:
        t = sample((1000, 333), torch.float32)  # about 20 extents of 64 KiB
        before = torch_offload.disk_spill_stats()
        assert torch.equal(round_trip(t, spill_dir), t)
        after = torch_offload.disk_spill_stats()
        assert after["bytes_written"] - before["bytes_written"] == t.numel() * 4
        assert after["bytes_read"] - before["bytes_read"] == t.numel() * 4
        assert after["extents_live"] == before["extents_live"]
    finally:
        torch_offload.configure_disk_spill()


# The payload moves between the tensor and the disk in place from the tensor's
# first block boundary on; the bytes before it (head) and after the last whole
# block (tail) go through staging blocks. Every mix of the two, over several
# extents, with O_DIRECT (spill_dir) and without it (tmpfs refuses O_DIRECT).
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
@pytest.mark.parametrize("offset", [0, 1, 64, 4000, 4095])
@pytest.mark.parametrize("nbytes", [1, 96, 4096, 3 * 4096 + 5, 5 * (16 << 10) + 4097])
def test_round_trip_at_any_offset_within_a_block(direct, offset, nbytes, spill_dir):
    directory, allow_tmpfs = (spill_dir, False) if direct else ("/dev/shm", True)
    buffer = torch.randint(0, 256, (nbytes + 8192,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    start = (offset - buffer.data_ptr()) % 4096
    src = buffer[start : start + nbytes]
    assert src.data_ptr() % 4096 == offset
    torch_offload.configure_disk_spill(extent_bytes=16 << 10)
    try:
        # A ticket not restored keeps the spill file open for the check below.
        anchor = torch_offload.disk_spill(torch.ones(1), directory=directory, allow_tmpfs=allow_tmpfs)
        ticket = torch_offload.disk_spill(src, directory=directory, allow_tmpfs=allow_tmpfs)
        fd = torch.ops.offload._disk_ticket_location(ticket)[0]
        assert torch.equal(torch_offload.disk_restore(ticket, src.shape, src.dtype, "cpu"), src)
    finally:
        torch_offload.configure_disk_spill()
    if direct and supports_o_direct(directory):  # no transfer made the file drop to buffered I/O
        with open(f"/proc/self/fdinfo/{fd}") as info:
            assert int(next(line for line in info if line.startswith("flags:")).split()[1], 8) & os.O_DIRECT
    del anchor


def supports_o_direct(directory):
    try:
        os.close(os.open(os.path.join(directory, "o_direct_probe"), os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600))
    except OSError:
        return False
    os.unlink(os.path.join(directory, "o_direct_probe"))
    return True


def test_more_than_one_gib_round_trips(spill_dir):
    t = torch.empty((1 << 30) + 12345, dtype=torch.uint8)
    t.view(-1)[::4096] = torch.arange(t.numel() // 4096 + 1, dtype=torch.int64).remainder(251).to(torch.uint8)
    back = round_trip(t, spill_dir)
    assert torch.equal(back, t)


def test_four_threads_spill_and_restore_concurrently(spill_dir):
    errors, results = [], {}

    def work(worker):
        try:
            for step in range(20):
                t = sample((64 + worker, 100 + step), torch.float32) + worker
                ticket = torch_offload.disk_spill(t, directory=spill_dir)
                if step % 2:
                    torch_offload.disk_prefetch(ticket)
                results[(worker, step)] = torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(results) == 80 and all(results.values())


def test_prefetch_reads_once_and_restore_uses_it(spill_dir):
    t = sample((512, 512), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    before = torch_offload.disk_spill_stats()["bytes_read"]
    torch_offload.disk_prefetch(ticket)
    torch_offload.disk_prefetch(ticket)  # a second prefetch is a no-op
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
    assert torch_offload.disk_spill_stats()["bytes_read"] - before == t.numel() * 4


def test_a_freed_restore_buffer_is_reused_for_the_next_restore_of_that_size(spill_dir):
    first, second = sample((300, 700), torch.float32), sample((300, 700), torch.float32) + 1
    torch_offload.configure_disk_spill(restore_cache_bytes=8 << 20)
    try:
        tickets = [torch_offload.disk_spill(t, directory=spill_dir) for t in (first, second)]
        back = torch_offload.disk_restore(tickets[0], first.shape, first.dtype, "cpu")
        assert torch.equal(back, first)
        address = back.data_ptr()
        del back
        before = torch_offload.disk_spill_stats()
        assert before["restore_cache_kept_bytes"] >= first.numel() * 4
        back = torch_offload.disk_restore(tickets[1], second.shape, second.dtype, "cpu")
        after = torch_offload.disk_spill_stats()
        # The same buffer; the data sits at each source's own offset within its first block.
        assert back.data_ptr() // 4096 == address // 4096
        assert after["restore_cache_hits"] == before["restore_cache_hits"] + 1
        assert torch.equal(back, second)  # the new data, none of the old
        del back
    finally:
        torch_offload.configure_disk_spill()


def test_restore_buffers_outlive_a_spill_and_serve_the_next_backward(spill_dir):
    """Kept buffers (lazily freed) outlive a spill: the next backward's restore of that size reuses one.
    A buffer of exactly restore_cache_bytes is kept (its extra block for the data's offset is not counted)."""
    t = sample((256, 1024), torch.float32)  # 1 MiB
    torch_offload.configure_disk_spill(restore_cache_bytes=t.numel() * 4)
    try:
        first = torch_offload.disk_spill(t, directory=spill_dir)
        back = torch_offload.disk_restore(first, t.shape, t.dtype, "cpu")
        address = back.data_ptr()
        del back
        assert torch_offload.disk_spill_stats()["restore_cache_kept_bytes"] == t.numel() * 4
        second = torch_offload.disk_spill(t + 1, directory=spill_dir)  # the next forward
        assert torch_offload.disk_spill_stats()["restore_cache_kept_bytes"] == t.numel() * 4
        hits = torch_offload.disk_spill_stats()["restore_cache_hits"]
        back = torch_offload.disk_restore(second, t.shape, t.dtype, "cpu")
        assert torch_offload.disk_spill_stats()["restore_cache_hits"] == hits + 1
        assert back.data_ptr() // 4096 == address // 4096
        assert torch.equal(back, t + 1)
    finally:
        torch_offload.configure_disk_spill()


def test_configure_waits_for_io_in_flight(spill_dir):
    t = sample((1000, 1000), torch.float32)
    kept = torch_offload.disk_spill(t, directory=spill_dir)
    torch_offload.disk_spill(t, directory=spill_dir)  # freed at once, its write still running
    torch_offload.configure_disk_spill(extent_bytes=64 << 10)
    try:
        assert torch.equal(torch_offload.disk_restore(kept, t.shape, t.dtype, "cpu"), t)
        assert torch.equal(round_trip(t, spill_dir), t)  # and the new extent size works
    finally:
        torch_offload.configure_disk_spill()


def test_the_default_keeps_no_restore_buffer_and_a_negative_size_is_refused(spill_dir):
    """Kept buffers count in the resident set until the kernel takes them: the default keeps none."""
    torch_offload.configure_disk_spill(restore_cache_bytes=1 << 20)
    torch_offload.configure_disk_spill()
    try:
        t = sample((64, 64), torch.float32)
        hits = torch_offload.disk_spill_stats()["restore_cache_hits"]
        tickets = [torch_offload.disk_spill(t, directory=spill_dir) for _ in range(2)]
        for ticket in tickets:
            assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
        stats = torch_offload.disk_spill_stats()
        assert stats["restore_cache_hits"] == hits and stats["restore_cache_kept_bytes"] == 0
        with pytest.raises(RuntimeError, match="restore_cache_bytes must be >= 0, got -1"):
            torch_offload.configure_disk_spill(restore_cache_bytes=-1)
    finally:
        torch_offload.configure_disk_spill()


def test_freeing_a_ticket_frees_its_extents(spill_dir):
    before = torch_offload.disk_spill_stats()
    tickets = [torch_offload.disk_spill(sample((256, 256), torch.float32), directory=spill_dir) for _ in range(3)]
    for ticket in tickets:
        torch_offload.disk_wait(ticket)
    assert torch_offload.disk_spill_stats()["tickets_live"] == before["tickets_live"] + 3
    del tickets, ticket
    after = torch_offload.disk_spill_stats()
    assert after["extents_live"] == before["extents_live"] and after["tickets_live"] == before["tickets_live"]


def test_tickets_freed_while_their_io_is_in_flight(spill_dir):
    before = torch_offload.disk_spill_stats()
    for _ in range(50):
        ticket = torch_offload.disk_spill(torch.randn(1 << 18), directory=spill_dir)
        torch_offload.disk_prefetch(ticket)  # reads start once the write is done
        del ticket  # the buffers must outlive the I/O still running on them
    t = torch.randn(1000)
    assert torch.equal(round_trip(t, spill_dir), t)
    after = torch_offload.disk_spill_stats()
    assert after["tickets_live"] == before["tickets_live"]


def test_restore_errors_name_the_problem(spill_dir):
    t = sample((4, 6), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    with pytest.raises(
        RuntimeError, match=r"disk_restore: size is \[6, 4\] but ticket \d+ holds a tensor of size \[4, 6\]"
    ):
        torch_offload.disk_restore(ticket, (6, 4), t.dtype, "cpu")
    with pytest.raises(RuntimeError, match="disk_restore: dtype is Half but ticket .* holds Float"):
        torch_offload.disk_restore(ticket, t.shape, torch.float16, "cpu")
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)  # still restorable
    with pytest.raises(RuntimeError, match="was already restored"):
        torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu")
    with pytest.raises(RuntimeError, match="ticket must be the CPU int64 tensor of 2 elements"):
        torch_offload.disk_restore(torch.zeros(3), t.shape, t.dtype, "cpu")
    with pytest.raises(RuntimeError, match="not made by disk_spill in this process"):
        torch_offload.disk_restore(torch.tensor([1, 2]), t.shape, t.dtype, "cpu")
    if not torch.cuda.is_available():
        fresh = torch_offload.disk_spill(t, directory=spill_dir)
        with pytest.raises(RuntimeError, match="disk_restore: device is cuda.*no CUDA device"):
            torch_offload.disk_restore(fresh, t.shape, t.dtype, "cuda")


def test_bad_directories_are_refused_by_name(tmp_path):
    t = torch.ones(4)
    missing = tmp_path / "missing"
    with pytest.raises(RuntimeError, match=f"disk_spill: directory '{missing}' cannot be used: No such file"):
        torch_offload.disk_spill(t, directory=str(missing))
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(RuntimeError, match="is not a directory"):
        torch_offload.disk_spill(t, directory=str(a_file))


def test_a_directory_removed_while_its_spill_file_is_open_is_refused_by_name_and_the_held_data_stays(tmp_path):
    """The open file (held by a live ticket) would still take data: the error must not hang on whether an
    earlier ticket (or the I/O thread holding it) is gone yet."""
    directory = tmp_path / "spill"
    directory.mkdir()
    t = sample((4, 6), torch.float32)
    held = torch_offload.disk_spill(t, directory=str(directory))
    torch_offload.disk_wait(held)
    directory.rmdir()
    with pytest.raises(RuntimeError, match=f"disk_spill: directory '{directory}' cannot be used: No such file"):
        torch_offload.disk_spill(t, directory=str(directory))
    assert torch.equal(torch_offload.disk_restore(held, t.shape, t.dtype, "cpu"), t)


def test_restore_to_meta_is_refused_before_the_ticket_is_used(spill_dir):
    t = sample((4, 6), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    with pytest.raises(RuntimeError, match="disk_restore: device is meta, which would drop the ticket's data"):
        torch_offload.disk_restore(ticket, t.shape, t.dtype, "meta")
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)


def test_tmpfs_is_refused_unless_allowed():
    t = sample((10,), torch.float32)
    with pytest.raises(RuntimeError, match="is on tmpfs, which is RAM, not disk"):
        torch_offload.disk_spill(t, directory="/dev/shm")
    ticket = torch_offload.disk_spill(t, directory="/dev/shm", allow_tmpfs=True)
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
    with pytest.raises(RuntimeError, match="is on tmpfs"):  # allowed once is not allowed for good
        torch_offload.disk_spill(t, directory="/dev/shm")


def run_child(code, timeout=300):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=timeout
    )


# Root may write almost anywhere; /proc/sys refuses even root.
def test_unwritable_directory_is_refused():
    with pytest.raises(RuntimeError, match="disk_spill: directory '/proc/sys' is not writable"):
        torch_offload.disk_spill(torch.ones(4), directory="/proc/sys")


def test_the_engine_writes_from_a_tensor_of_its_own(spill_dir):
    # The I/O thread that finishes a write lets go of its source. Letting go of the last C++ reference to a tensor
    # Python has seen takes the GIL, which that thread would wait for behind the caller, and a thread waiting for it
    # when the interpreter exits dies inside a noexcept destructor: std::terminate (a child of the test below, once
    # in CI). The engine writes from a tensor of its own over the caller's memory: while a C++ reference to t's own
    # holds one to its Python object, t's reference count shows it.
    t = torch.ones(64 << 20)  # 256 MiB: still being written when disk_spill returns
    before = sys.getrefcount(t)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    assert sys.getrefcount(t) == before
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)


# glibc's heap keeps what is freed in it resident; the tier's I/O threads give it back (spill_engine.cpp, trim_heap).
HOLES_IN_THE_HEAP = """
        import time, torch, torch_offload
        def resident():
            with open("/proc/self/status") as status:
                return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))
        def trims():
            return torch_offload.disk_spill_stats()["heap_trims"]
        def wait_for(condition):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not condition():
                time.sleep(0.05)
        def written(t):
            ticket = torch_offload.disk_spill(t, directory={directory!r})
            torch_offload.disk_wait(ticket)
            return ticket
        torch.ones(6 << 20).sum()  # a 24 MiB block mmapped and freed: glibc then serves blocks up to that from its heap
        blocks = [torch.ones(2 << 20) for _ in range(40)]  # 8 MiB each: 320 MiB of heap
        pinned = torch.ones(1 << 18)  # 1 MiB above them: the heap cannot shrink from its top
        del blocks
        held = resident()
        first = written(torch.ones(8 << 20))  # 32 MiB: no trim yet
        time.sleep(0.5)
        print(trims(), (held - resident()) >> 20)
        second = written(torch.ones(8 << 20) + 1)  # 64 MiB in all: one trim
        wait_for(lambda: trims() == 1 and resident() < held - (200 << 20))
        print(trims(), (held - resident()) >> 20)
        for ticket in (first, second):  # 64 MiB restored: one more
            torch_offload.disk_restore(ticket, (8 << 20,), torch.float32, "cpu")
        wait_for(lambda: trims() == 2)
        print(trims())
"""


def test_the_io_threads_give_back_the_heap_that_glibc_keeps(spill_dir, monkeypatch):
    # In a fresh process with glibc's default settings: 320 MiB freed in holes of the heap stay resident until 64 MiB
    # written through the tier make an I/O thread trim the heap; 64 MiB restored make it trim again.
    if platform.libc_ver()[0] != "glibc":
        unavailable("the heap's retention and its trimming are glibc's")
    for name in [name for name in os.environ if name.startswith("MALLOC_")] + ["LD_PRELOAD", "GLIBC_TUNABLES"]:
        monkeypatch.delenv(name, raising=False)  # glibc's malloc with its defaults
    child = run_child(HOLES_IN_THE_HEAP.format(directory=spill_dir))
    assert child.returncode == 0, child.stderr
    after_32, after_64, after_restores = child.stdout.splitlines()
    trims, given_back_mib = map(int, after_32.split())
    assert trims == 0 and given_back_mib < 100, child.stdout
    trims, given_back_mib = map(int, after_64.split())
    assert trims == 1 and given_back_mib > 200, child.stdout
    assert int(after_restores) == 2, child.stdout


# The engine's first spill as the user nobody with no thread allowed, then with threads allowed again.
SPILL_AS_NOBODY_WITHOUT_THREADS = """
        import os, pwd, resource, torch, torch_offload
        t = torch.arange(10000.0)
        nobody = pwd.getpwnam("nobody")
        os.setgid(nobody.pw_gid)
        os.setuid(nobody.pw_uid)
        _, hard = resource.getrlimit(resource.RLIMIT_NPROC)
        resource.setrlimit(resource.RLIMIT_NPROC, (0, hard))
        try:
            torch_offload.disk_spill(t, directory={directory!r})
        except RuntimeError as error:
            print("refused:", error)
        stats = torch_offload.disk_spill_stats()
        assert stats["tickets_live"] == 0 and stats["extents_live"] == 0, stats
        assert stats["peak_file_bytes"] == 0 and stats["bytes_written"] == 0, stats
        resource.setrlimit(resource.RLIMIT_NPROC, (hard, hard))
        ticket = torch_offload.disk_spill(t, directory={directory!r})
        assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
        print("recovered")
"""


def test_worker_threads_that_cannot_start_leave_no_ticket_behind():
    # The child runs as an unprivileged user allowed no more threads (RLIMIT_NPROC 0), so the engine's first
    # spill cannot start its I/O threads: it fails with nothing registered, and works once threads may start.
    if os.getuid() != 0:
        unavailable("needs root, to run the child as the unprivileged user nobody")
    with tempfile.TemporaryDirectory(prefix="torch_offload_nobody_") as directory:  # pytest's tmp_path is root's
        os.chmod(directory, 0o777)
        child = run_child(SPILL_AS_NOBODY_WITHOUT_THREADS.format(directory=directory))
    assert child.returncode == 0, child.stderr
    assert "refused: disk_spill: cannot start an I/O thread (" in child.stdout, child.stdout
    assert child.stdout.rstrip().endswith("recovered"), child.stdout


def test_file_size_limit_fails_clearly_and_the_process_recovers(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    child = run_child(f"""
        import resource, torch, torch_offload
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
        big = torch.ones(4 << 20)  # 16 MiB: past the 8 MiB limit
        ticket = torch_offload.disk_spill(big, directory={str(first)!r})
        try:
            torch_offload.disk_wait(ticket)
            print("NO ERROR")
        except RuntimeError as e:
            print("ERROR", e)
        small = torch.arange(1000.0)
        ticket = torch_offload.disk_spill(small, directory={str(second)!r})
        back = torch_offload.disk_restore(ticket, small.shape, small.dtype, "cpu")
        print("RECOVERED", torch.equal(back, small))
    """)
    assert "ERROR disk_spill: writing extent" in child.stdout and "File too large" in child.stdout, (
        child.stdout + child.stderr
    )
    assert "RECOVERED True" in child.stdout, child.stdout + child.stderr


def test_no_memory_for_a_restore_is_an_error_the_data_stays_and_the_process_goes_on(spill_dir):
    # RLIMIT_AS leaves no room for the 256 MiB restore buffer, whether the prefetch
    # allocates it (write done) or an I/O thread does (when the write finishes).
    # The write itself succeeded: disk_wait is clean, and once memory is back
    # the same ticket restores.
    child = run_child(f"""
        import resource, torch, torch_offload
        small = torch.arange(1000.0)
        ticket = torch_offload.disk_spill(small, directory={spill_dir!r})
        torch_offload.disk_restore(ticket, small.shape, small.dtype, "cpu")
        big = torch.ones(64 << 20)
        with open("/proc/self/status") as status:
            vm_size = next(int(line.split()[1]) << 10 for line in status if line.startswith("VmSize:"))
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (vm_size + (64 << 20), hard))
        ticket = torch_offload.disk_spill(big, directory={spill_dir!r})
        try:
            torch_offload.disk_prefetch(ticket)
        except RuntimeError as e:
            print("PREFETCH", e)
        torch_offload.disk_wait(ticket)
        print("WRITTEN")
        try:
            torch_offload.disk_restore(ticket, big.shape, big.dtype, "cpu")
            print("NO ERROR")
        except RuntimeError as e:
            print("ERROR", e)
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
        print("RESTORED", torch.equal(torch_offload.disk_restore(ticket, big.shape, big.dtype, "cpu"), big))
        small_ticket = torch_offload.disk_spill(small, directory={spill_dir!r})
        back = torch_offload.disk_restore(small_ticket, small.shape, small.dtype, "cpu")
        print("RECOVERED", torch.equal(back, small))
    """)
    out = child.stdout + child.stderr
    assert "WRITTEN" in child.stdout, out
    assert "ERROR disk_restore: cannot allocate 268435456 bytes" in child.stdout, out
    assert "Exception raised from" not in child.stdout  # the message, not a C++ backtrace
    assert "RESTORED True" in child.stdout and "RECOVERED True" in child.stdout, out


def test_spilling_a_ticket_tensor_does_not_hang_the_engine(spill_dir):
    # The inner ticket dies when the outer write is done, and its deleter calls back
    # into the engine: the worker must not hold the engine's lock then.
    child = run_child(f"""
        import torch, torch_offload
        t = torch.arange(10.0)
        outer = torch_offload.disk_spill(torch_offload.disk_spill(t, directory={spill_dir!r}), directory={spill_dir!r})
        torch_offload.disk_wait(outer)
        back = torch_offload.disk_restore(torch_offload.disk_spill(t, directory={spill_dir!r}), t.shape, t.dtype, "cpu")
        print("DONE", torch.equal(back, t), torch_offload.disk_spill_stats()["tickets_live"])
    """)
    assert "DONE True 1" in child.stdout, child.stdout + child.stderr


def test_sigkill_mid_spill_leaves_no_file(spill_dir):
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
            import sys, torch, torch_offload
            t = torch.randn(16 << 20)
            tickets = []
            while True:
                tickets.append(torch_offload.disk_spill(t, directory={spill_dir!r}))
                if len(tickets) == 2:
                    print("spilling", flush=True)
                if len(tickets) > 8:
                    tickets.pop(0)
        """),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.path.dirname(HERE)),
    )
    try:
        assert child.stdout.readline().strip() == "spilling"
        assert os.listdir(spill_dir) == []  # anonymous even while in use
        time.sleep(0.5)  # let it write for a while: the kill must land mid-spill
        child.send_signal(signal.SIGKILL)
    finally:
        child.wait(timeout=60)
    assert child.returncode == -signal.SIGKILL
    assert os.listdir(spill_dir) == []


def corrupt(ticket, where):
    fd, offset, payload_at = torch.ops.offload._disk_ticket_location(ticket)
    with open(f"/proc/self/fd/{fd}", "r+b") as f:
        position = offset + (payload_at + 10 if where == "payload" else 3)
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("where, message", [("payload", "failed its checksum"), ("header", "has no valid header")])
def test_corrupted_extent_is_an_error_not_data(where, message, spill_dir):
    t = sample((300, 300), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    torch_offload.disk_wait(ticket)
    corrupt(ticket, where)
    with pytest.raises(RuntimeError, match=message):
        torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu")


# Each ticket is new (its id differs from eager's) and is restored once, so the
# AOT-dispatch checks, which run an op twice and compare, do not apply; the
# compile test below covers tracing. The other checks run with a fresh ticket each.
OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


@pytest.mark.parametrize("check", OPCHECKS)
def test_opcheck(check, spill_dir):
    t = sample((5, 7), torch.float32).requires_grad_(True)
    for src in (t, t.detach(), t.detach().to(torch.int64)):
        opcheck(torch.ops.offload.disk_spill.default, (src,), {"directory": spill_dir}, test_utils=check)
    ticket = torch_offload.disk_spill(t.detach(), directory=spill_dir)
    opcheck(
        torch.ops.offload.disk_restore.default, (ticket, [5, 7], torch.float32, torch.device("cpu")), test_utils=check
    )
    ticket = torch_offload.disk_spill(t.detach(), directory=spill_dir)
    opcheck(torch.ops.offload.disk_wait.default, (ticket,), test_utils=check)
    opcheck(torch.ops.offload.disk_prefetch.default, (ticket,), test_utils=check)
    # disk_read keeps the ticket: the AOT-dispatch checks (which run it twice and compare) apply to it too.
    for utils in (check, "test_aot_dispatch_dynamic"):
        opcheck(
            torch.ops.offload.disk_read.default, (ticket, [5, 7], torch.float32, torch.device("cpu")), test_utils=utils
        )


def test_a_read_keeps_the_ticket_for_more_reads_a_prefetch_and_a_restore(spill_dir):
    t = sample((33, 65), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    first = torch_offload.disk_read(ticket, t.shape, t.dtype, "cpu")
    second = torch_offload.disk_read(ticket, t.shape, t.dtype, "cpu")
    assert torch.equal(first, t) and torch.equal(second, t) and first.data_ptr() != second.data_ptr()
    torch_offload.disk_prefetch(ticket)
    assert torch.equal(torch_offload.disk_read(ticket, t.shape, t.dtype, "cpu"), t)  # the prefetch served
    assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
    with pytest.raises(RuntimeError, match="disk_read: ticket .* was already restored"):
        torch_offload.disk_read(ticket, t.shape, t.dtype, "cpu")


@pytest.mark.parametrize(
    "size, dtype, message",
    [
        ([33, 64], torch.float32, r"disk_read: size is \[33, 64\] but ticket"),
        ([33, 65], torch.float64, "disk_read: dtype is Double but ticket"),
    ],
)
def test_a_read_of_another_size_or_dtype_is_refused_by_name_and_the_ticket_stays(size, dtype, message, spill_dir):
    t = sample((33, 65), torch.float32)
    ticket = torch_offload.disk_spill(t, directory=spill_dir)
    with pytest.raises(RuntimeError, match=message):
        torch_offload.disk_read(ticket, size, dtype, "cpu")
    assert torch.equal(torch_offload.disk_read(ticket, t.shape, t.dtype, "cpu"), t)


def test_compiled_spill_and_restore_match_eager(spill_dir):
    def fn(x):
        ticket = torch.ops.offload.disk_spill(x * 3, spill_dir)
        y = x.sin()
        return y + torch.ops.offload.disk_restore(ticket, x.shape, x.dtype, x.device)

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for n in (16, 40):
        x = torch.randn(n, 3)
        torch.testing.assert_close(compiled(x), fn(x))


def unavailable(reason):
    """What a test needs (root, mount, mkfs, hole punching) is missing: a skip on a developer's machine, a
    failure on CI, whose machines have it, so the disk-space tests never pass there by being skipped."""
    if os.environ.get("CI"):
        pytest.fail(reason)
    pytest.skip(reason)


@contextlib.contextmanager
def mounted(target, *mount_args):
    """A file system mounted at target for the test (needs root); skips where this machine cannot mount."""
    target.mkdir()
    if shutil.which("mount") is None:
        unavailable("no mount command")
    result = subprocess.run(["mount", *mount_args, str(target)], capture_output=True, text=True)
    if result.returncode != 0:
        unavailable(f"cannot mount {' '.join(mount_args)} here (root only): {result.stderr.strip()}")
    try:
        yield str(target)
    finally:
        # Busy while a spill file is still open in it: a failure, then a lazy unmount.
        busy = subprocess.run(["umount", str(target)], capture_output=True, text=True)
        if busy.returncode != 0:
            subprocess.run(["umount", "-l", str(target)])
            pytest.fail(f"umount {target}: {busy.stderr.strip()}")


@pytest.fixture
def small_fs(tmp_path):
    """A 64 MiB ext4 file system on a loop device."""
    if shutil.which("mkfs.ext4") is None:
        unavailable("no mkfs.ext4")
    image = tmp_path / "fs.img"
    with open(image, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], check=True, capture_output=True)
    with mounted(tmp_path / "small", "-o", "loop", str(image)) as directory:
        yield directory


def wait_for_io():
    """Freed extents are given back by the I/O threads; configure waits for all their work."""
    torch_offload.configure_disk_spill()


def free_bytes(directory):
    stats = os.statvfs(directory)
    return stats.f_bfree * stats.f_frsize  # root may write into the reserved blocks too


def allocated_bytes(fd):
    return os.stat(f"/proc/self/fd/{fd}").st_blocks * 512


def punches_holes(directory):
    libc = ctypes.CDLL(None, use_errno=True)
    with open(os.path.join(directory, "hole_probe"), "wb") as f:
        f.write(bytes(8192))
        f.flush()
        punched = libc.fallocate(f.fileno(), 3, ctypes.c_long(0), ctypes.c_long(4096)) == 0  # PUNCH_HOLE|KEEP_SIZE
    os.unlink(os.path.join(directory, "hole_probe"))
    return punched


def spill_files_in(directory):
    """The descriptors of this process open on files in directory (the spill files, anonymous)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(directory + "/"):
                found.append(fd)
    return found


def test_freed_extents_give_their_blocks_back_to_the_file_system(spill_dir):
    if not punches_holes(spill_dir):
        unavailable(f"the file system of {spill_dir} cannot punch holes")
    anchor = torch_offload.disk_spill(torch.ones(1024), directory=spill_dir)  # keeps the spill file open
    torch_offload.disk_wait(anchor)
    fd = torch.ops.offload._disk_ticket_location(anchor)[0]
    held = allocated_bytes(fd)
    t = sample((2048, 2048), torch.float32)  # 16 MiB
    restored = torch_offload.disk_spill(t, directory=spill_dir)
    torch_offload.disk_wait(restored)
    assert allocated_bytes(fd) >= held + t.numel() * 4
    assert torch.equal(torch_offload.disk_restore(restored, t.shape, t.dtype, "cpu"), t)
    wait_for_io()
    assert allocated_bytes(fd) == held  # restored: its extents are free
    freed = torch_offload.disk_spill(t, directory=spill_dir)
    torch_offload.disk_wait(freed)
    assert allocated_bytes(fd) >= held + t.numel() * 4
    del freed
    wait_for_io()
    assert allocated_bytes(fd) == held


def test_a_directory_spill_file_is_closed_once_no_ticket_uses_it(tmp_path):
    t = sample((64, 64), torch.float32)
    for i in range(20):
        directory = tmp_path / f"spill{i}"
        directory.mkdir()
        ticket = torch_offload.disk_spill(t, directory=str(directory))
        assert len(spill_files_in(str(directory))) == 1
        assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
        del ticket
        wait_for_io()
        assert spill_files_in(str(directory)) == []


def test_blocks_of_a_failed_write_go_back_once_its_ticket_is_freed(spill_dir):
    # The file size limit (EFBIG) stands in for a full disk, which the test below
    # needs a small file system for: a write fails part way, its blocks stay taken.
    if not punches_holes(spill_dir):
        unavailable(f"the file system of {spill_dir} cannot punch holes")
    child = run_child(f"""
        import os, resource, torch, torch_offload
        anchor = torch_offload.disk_spill(torch.ones(1024), directory={spill_dir!r})  # keeps the file open
        torch_offload.disk_wait(anchor)
        fd = torch.ops.offload._disk_ticket_location(anchor)[0]
        held = os.fstat(fd).st_blocks
        resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
        ticket = torch_offload.disk_spill(torch.ones(4 << 20), directory={spill_dir!r})  # 16 MiB
        try:
            torch_offload.disk_wait(ticket)
        except RuntimeError as e:
            print("FAILED", "File too large" in str(e))
        print("PARTLY WRITTEN", os.fstat(fd).st_blocks > held)
        del ticket
        torch_offload.configure_disk_spill()  # waits for the I/O threads to give the blocks back
        print("GIVEN BACK", os.fstat(fd).st_blocks == held)
    """)
    assert "FAILED True" in child.stdout and "PARTLY WRITTEN True" in child.stdout, child.stdout + child.stderr
    assert "GIVEN BACK True" in child.stdout, child.stdout + child.stderr


def test_free_space_comes_back_after_restore_free_and_enospc(small_fs):
    anchor = torch_offload.disk_spill(torch.ones(1024), directory=small_fs)  # keeps the spill file open
    torch_offload.disk_wait(anchor)
    empty = free_bytes(small_fs)
    slack = 1 << 20  # file system metadata
    t = torch.randn(10 << 20)  # 40 MiB
    assert torch.equal(round_trip(t, small_fs), t)
    wait_for_io()
    assert free_bytes(small_fs) >= empty - slack
    ticket = torch_offload.disk_spill(torch.ones(20 << 20), directory=small_fs)  # 80 MiB: does not fit
    with pytest.raises(RuntimeError, match="No space left on device"):
        torch_offload.disk_wait(ticket)
    del ticket
    wait_for_io()
    assert free_bytes(small_fs) >= empty - slack
    assert torch.equal(round_trip(t, small_fs), t)  # and the space is usable again
    del anchor
    wait_for_io()
    assert spill_files_in(small_fs) == []  # closed: the file system unmounts


def test_ramfs_is_refused_like_tmpfs(tmp_path):
    with mounted(tmp_path / "ramfs", "-t", "ramfs", "ramfs") as directory:
        t = sample((10,), torch.float32)
        with pytest.raises(RuntimeError, match=f"directory '{directory}' is on ramfs, which is RAM, not disk"):
            torch_offload.disk_spill(t, directory=directory)
        ticket = torch_offload.disk_spill(t, directory=directory, allow_tmpfs=True)
        assert torch.equal(torch_offload.disk_restore(ticket, t.shape, t.dtype, "cpu"), t)
        del ticket
        wait_for_io()


def test_fork_gives_the_child_a_fresh_engine_and_the_parent_goes_on(spill_dir):
    # A DataLoader worker forks a process whose disk tier runs: the child's I/O
    # threads are gone and its file is the parent's. The child must get its own.
    child = run_child(
        f"""
        import os, signal, torch, torch_offload
        directory = {spill_dir!r}
        t = torch.arange(100000.0)
        kept = torch_offload.disk_spill(t, directory=directory)
        torch_offload.disk_wait(kept)
        busy = [torch_offload.disk_spill(t + i, directory=directory) for i in range(8)]  # I/O in flight
        parent_file = os.fstat(torch.ops.offload._disk_ticket_location(kept)[0]).st_ino
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)  # a hung child dies rather than hang the test
            torch.set_num_threads(1)  # as in a DataLoader worker: OpenMP's threads did not survive either
            try:
                torch_offload.disk_restore(kept, t.shape, t.dtype, "cpu")
                print("CHILD RESTORED A TICKET OF THE PARENT", flush=True)
            except RuntimeError as e:
                print("CHILD REFUSED", "not made by disk_spill in this process" in str(e), flush=True)
            del kept, busy  # the parent's tickets: must not free the parent's extents
            mine = torch_offload.disk_spill(t * 2, directory=directory)
            own_file = os.fstat(torch.ops.offload._disk_ticket_location(mine)[0]).st_ino
            back = torch_offload.disk_restore(mine, t.shape, t.dtype, "cpu")
            print("CHILD", torch.equal(back, t * 2), own_file != parent_file, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print("CHILD EXIT", os.waitstatus_to_exitcode(status))
        restored = [torch_offload.disk_restore(b, t.shape, t.dtype, "cpu") for b in busy]
        print("PARENT", torch.equal(torch_offload.disk_restore(kept, t.shape, t.dtype, "cpu"), t),
              all(torch.equal(r, t + i) for i, r in enumerate(restored)), flush=True)
        again = torch.randn(1000)
        back = torch_offload.disk_restore(torch_offload.disk_spill(again, directory=directory), again.shape,
                                          again.dtype, "cpu")
        print("AGAIN", torch.equal(back, again))
    """,
        timeout=120,
    )
    out = child.stdout + child.stderr
    assert "CHILD REFUSED True" in child.stdout, out
    assert "CHILD True True" in child.stdout and "CHILD EXIT 0" in child.stdout, out
    assert "PARENT True True" in child.stdout and "AGAIN True" in child.stdout, out
