"""Under pytest-xdist (make test), the tests of modules that spawn ranks run on one worker, one after another: two
process groups at once would halve each one's cores, and their rendezvous ports come from the same free pool."""

import os
import sys

import pytest

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


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__ in RANK_MODULES:
            item.add_marker(pytest.mark.xdist_group("ranks"))


def pytest_runtest_logreport(report):
    # The GPU check sets this: a failure's traceback at once, as a later test's segfault would lose pytest's summary.
    if report.failed and os.environ.get("TORCH_OFFLOAD_FAILURES_AT_ONCE"):
        sys.stderr.write(f"\n=== FAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
