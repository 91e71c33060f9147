"""The examples run as users would run them."""
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(command, tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run(command, check=True, cwd=tmp_path, env=env, timeout=600)


def test_ddp_example_with_torchrun_matches_one_process(tmp_path):
    script = os.path.join(ROOT, "examples", "ddp", "train.py")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    run(torchrun + [script, "--steps", "4", "--out", "ddp.json"], tmp_path)
    run([sys.executable, script, "--steps", "4", "--out", "single.json"], tmp_path)
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    single = json.loads((tmp_path / "single.json").read_text())
    assert len(ddp) == 4 and ddp[-1] < ddp[0]
    torch.testing.assert_close(torch.tensor(ddp), torch.tensor(single), rtol=1e-5, atol=1e-6)
