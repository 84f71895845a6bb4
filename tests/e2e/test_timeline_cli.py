"""``--timeline PATH`` through the real CLI on 2 ranks: one merged trace with, on every rank's
track, the spans of a training step (forward, backward, fusion pack, per-bucket allreduce with
its bytes, unpack, update) and the evaluation."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import MPIEXEC, child_env

TINY = ["--dataset", "synthetic", "--synthetic-samples", "256", "--hidden", "16",
        "--batch-size", "8", "--no-progress", "--steps", "4"]


def _run(flags, tmp_path, env=None):
    clean = child_env(**(env or {}))
    cmd = ["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable, "-m", "mpitrain",
           *TINY, *flags]
    proc = subprocess.run(cmd, cwd=tmp_path, env=clean, capture_output=True, text=True,
                          timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def _spans(path):
    evs = json.loads(Path(path).read_text())["traceEvents"]
    return {rank: [e for e in evs if e["pid"] == rank and e["ph"] == "X"] for rank in (0, 1)}


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason=f"no mpiexec at {MPIEXEC}")
def test_timeline_flag_records_step_comm_and_eval_spans_per_rank(tmp_path):
    trace = tmp_path / "trace.json"
    _run(["--timeline", str(trace)], tmp_path)
    for rank, spans in _spans(trace).items():
        names = [e["name"] for e in spans]
        for name in ("data", "forward", "backward", "optimizer.step", "pack", "allreduce",
                     "unpack", "evaluate"):
            assert name in names, (rank, name, sorted(set(names)))
        assert names.count("forward") == 4
        reduces = [e for e in spans if e["name"] == "allreduce"]
        assert all(e["args"]["bytes"] > 0 and "bucket" in e["args"] for e in reduces)
        # every step moves the same buckets: the 4 parameters of a 784-16-10 MLP in float32
        per_step = sum(e["args"]["bytes"] for e in reduces) / 4
        assert per_step == 4 * (784 * 16 + 16 + 16 * 10 + 10)


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason=f"no mpiexec at {MPIEXEC}")
def test_timeline_env_var_still_works(tmp_path):
    trace = tmp_path / "env.json"
    _run([], tmp_path, env={"MPITRAIN_TIMELINE": str(trace)})
    assert "evaluate" in [e["name"] for e in _spans(trace)[1]]
