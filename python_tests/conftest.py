"""Under pytest-xdist (make test), the tests of modules that spawn ranks run on one worker, one after another: two
process groups at once would halve each one's cores, and their rendezvous ports come from the same free pool. Each
worker, and the processes it starts, gets its share of the cores as OpenMP threads: with torch's default of every
core in every worker, the threads wait on each other (on 2 cores, test_chunk_recurrent*.py took 154 s, 24 s with
one thread a worker); inductor's compile workers likewise. The kernels' threaded loops are tested on two threads
where a test asks for ``more_than_one_thread``."""

import os
import sys

import pytest

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # before the test modules import torch; a user's setting stays
    _share = max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(_share))
    # Inductor compiles its kernels in that many processes too: with more than one it starts a pool of them, each
    # importing torch (a cold compile of test_compile.py's inductor step: 68 s of CPU with the pool, 59 without).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(_share))

RANK_MODULES = frozenset(
    {
        "test_activations_ddp",
        "test_apply_distributed",
        "test_examples",
        "test_sequence_parallel",
        "test_sequence_parallel_cuda",
        "test_tiled_mlp_ddp",
    }
)


def pytest_configure(config):
    # Registered here too, for runs without pytest-xdist (the GPU check), where the mark does nothing.
    config.addinivalue_line("markers", "xdist_group(name): run on the same pytest-xdist worker as the group")
    # A module's mark, read by the Makefile (OP_TESTS, GPU_TORCH_TESTS) and test_op_registration.py.
    config.addinivalue_line("markers", "torch_range: the file runs on both ends of the supported torch range too")
    config.addinivalue_line("markers", "gpu_torch: the file runs on the range's oldest end too (the GPU machines')")


@pytest.fixture
def more_than_one_thread():
    """Two threads for this test, whatever the worker's share: the CPU kernels' at::parallel_for loops split."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def stores(monkeypatch):
    """The chunk-recurrent step's ChunkStores, in the order the steps (and their probes) make them."""
    from torch_offload.integrations import chunk_recurrent

    made = []

    class Recorded(chunk_recurrent.ChunkStore):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(chunk_recurrent, "ChunkStore", Recorded)
    return made


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in RANK_MODULES:
            item.add_marker(pytest.mark.xdist_group("ranks"))


def pytest_runtest_logreport(report):
    # The GPU check sets this: a failure's traceback at once, as a later test's segfault would lose pytest's summary.
    if report.failed and os.environ.get("TORCH_OFFLOAD_FAILURES_AT_ONCE"):
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
