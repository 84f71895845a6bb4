"""Overlap through the CLI on 2 ranks: the same parameters with and without --no-overlap, and
the timeline puts the overlapped allreduces on the comm thread's own track."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.launch import MPIEXEC, child_env

# 64-byte buckets: the tiny MLP's four gradients travel as four buckets
TINY = ["--dataset", "synthetic", "--synthetic-samples", "256", "--hidden", "16",
        "--batch-size", "8", "--no-progress", "--steps", "6", "--fusion-threshold-bytes", "64"]


def _run(flags, tmp_path):
    env = child_env()
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain",
           *TINY, *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]


def _allreduce_threads(trace):
    evs = json.loads(Path(trace).read_text())["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in evs if e["name"] == "thread_name"}
    return {names[(e["pid"], e["tid"])] for e in evs
            if e.get("ph") == "X" and e["name"] == "allreduce"}


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason=f"no mpiexec at {MPIEXEC}")
def test_overlap_matches_no_overlap_and_runs_on_the_comm_thread(tmp_path):
    _run(["--save", "on.npz", "--timeline", "on.json"], tmp_path)
    _run(["--save", "off.npz", "--timeline", "off.json", "--no-overlap"], tmp_path)
    on, off = np.load(tmp_path / "on.npz"), np.load(tmp_path / "off.npz")
    assert sorted(on.files) == sorted(off.files)
    for k in on.files:
        np.testing.assert_allclose(on[k], off[k], rtol=1e-5, atol=1e-7)
    assert _allreduce_threads(tmp_path / "on.json") == {"comm"}
    assert _allreduce_threads(tmp_path / "off.json") == {"main"}
