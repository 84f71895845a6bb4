"""Timeline under a real ``mpiexec -n 2``: rank 0 gathers both ranks' events into one trace file
(the unit tests use a fake communicator; this one proves the mpi4py gather and the file layout)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MPIEXEC = os.environ.get("MPIEXEC", str(REPO / ".venv" / "bin" / "mpiexec"))

SCRIPT = """
import sys, time
from mpi4py import MPI
from mpitrain import timeline
comm = MPI.COMM_WORLD
time.sleep(0.3 * comm.Get_rank())       # rank 1's clock origin starts 300 ms after rank 0's
tl = timeline.activate(timeline.Timeline(sys.argv[1], comm.Get_rank()))
for step in range(3):
    with timeline.current().span("forward", step=step):
        time.sleep(0.001)
    with timeline.current().span("allreduce", cat="comm", bytes=4 * (step + 1)):
        comm.Barrier()
# one write per rank: mpiexec forwards both ranks' output, and separate writes can interleave
sys.stdout.write(f"wrote {tl.close(comm)}\\n")
sys.stdout.flush()
"""


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason=f"no mpiexec at {MPIEXEC}")
def test_two_ranks_merge_into_one_trace(tmp_path):
    script = tmp_path / "tl.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "trace.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(["timeout", "-k", "5", "120", MPIEXEC, "-n", "2", sys.executable,
                           str(script), str(trace)],
                          capture_output=True, text=True, env=env, timeout=150)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("wrote None") == 1 and f"wrote {trace}" in proc.stdout
    doc = json.loads(trace.read_text())
    evs = doc["traceEvents"]
    procs = {e["pid"]: e["args"]["name"] for e in evs if e["name"] == "process_name"}
    assert procs == {0: "rank 0", 1: "rank 1"}
    for rank in (0, 1):
        spans = [e for e in evs if e["pid"] == rank and e["ph"] == "X"]
        assert [e["name"] for e in spans] == ["forward", "allreduce"] * 3
        assert [e["args"].get("bytes") for e in spans[1::2]] == [4, 8, 12]
        assert all(e["dur"] >= 1000 for e in spans[0::2])
    # The barrier ends at the same moment on both ranks, although rank 1's clock origin is
    # 300 ms later: the merge puts both on one axis (tolerance: a loaded machine's scheduling).
    ends = [[e["ts"] + e["dur"] for e in evs if e["pid"] == r and e["name"] == "allreduce"]
            for r in (0, 1)]
    assert max(abs(a - b) for a, b in zip(*ends)) < 100_000
