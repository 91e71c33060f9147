"""The examples run as users would run them."""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(command, check=True, cwd=tmp_path, env=env, timeout=600, capture_output=True, text=True)


def test_ddp_example_with_torchrun_matches_one_process(tmp_path):
    script = os.path.join(ROOT, "examples", "ddp", "train.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run(torchrun + [script, "--steps", "4", "--out", "ddp.json"], tmp_path)
    run([sys.executable, script, "--steps", "4", "--out", "single.json"], tmp_path)
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert len(ddp) == 4 and ddp[-1] < ddp[0]
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single), rtol=1e-5, atol=1e-6)


def test_demo_measures_every_configuration_and_their_losses_agree(tmp_path):
    # make demo's configurations, and one of apply()'s alternatives that BENCHMARKS.md's table of defaults compares
    # (they differ only in the options given to apply(), which test_apply.py tests; each point is a process of
    # about 6 s, mostly imports), in one run (one baseline).
    demo = os.path.join(ROOT, "examples", "demo.py")
    configs = ["baseline", "checkpointing", "torch_offload", "torch_offload_packed", "apply_disk_layer"]
    result = run(
        [sys.executable, demo, "--seq-lens", "128,256", "--configs", ",".join(configs), "--out", str(tmp_path / "out")],
        tmp_path,
    )
    # The packed configuration's loss is its own documents'.
    assert "losses agree across the 4 configurations on one sequence at every length" in result.stdout
    rows = [line.split(" | ")[0] for line in result.stdout.splitlines() if line.startswith("| ")]
    assert [row for row in rows if not row.startswith("| ---") and "configuration" not in row] == [
        f"| {name}" for name in configs
    ]
    assert (tmp_path / "out" / "memory.png").stat().st_size > 0
    for name in ("baseline", "torch_offload", "torch_offload_packed", "apply_disk_layer"):
        assert json.loads((tmp_path / "out" / f"{name}-256.json").read_text())["training_bytes"] > 0
    assert not list((tmp_path / "out").glob("tmp*")), "a spill directory was left behind"


def test_sequence_parallel_example_with_torchrun_matches_one_process(tmp_path):
    script = os.path.join(ROOT, "examples", "sequence_parallel", "train.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    small = ["--tokens", "256", "--steps", "3", "--hidden", "128", "--intermediate", "256", "--layers", "2"]
    run(torchrun + [script, *small, "--out", "ranks.json"], tmp_path)
    run([sys.executable, script, *small, "--out", "single.json"], tmp_path)
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert len(ranks) == 3 and ranks[-1] < ranks[0]
    torch.testing.assert_close(torch.tensor(ranks), torch.tensor(single), rtol=1e-5, atol=1e-6)
