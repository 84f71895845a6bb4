"""benchmarks/scaling.py: the sweep runner end to end.

Most tests put a fake ``mpiexec`` in $MPIEXEC: it parses ``-n N python -m mpitrain ... --batch-size
B --metrics-json P`` and writes a summary record from a known formula, so the runner's arithmetic
(speedup, efficiency, comm share, strong/weak batches), its outputs (table, JSON, PNG) and its
failure handling are checked exactly and in a second. The last test runs the real CLI with tiny
settings (skipped until ``python -m mpitrain`` exists)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCALING = REPO / "benchmarks" / "scaling.py"
MPIEXEC = os.environ.get("MPIEXEC", str(REPO / ".venv" / "bin" / "mpiexec"))

# Throughput of the fake job: 1000 * B/64 samples/s per rank at N=1, each extra rank adds 0.8 of
# one; comm = 10% of a 100 ms step per extra rank. Exit 3 when FAKE_FAIL_N equals N.
FAKE = r'''#!{python}
import json, os, sys
argv = sys.argv[1:]
n = int(argv[argv.index("-n") + 1])
assert argv[argv.index("-n") + 2:][1:3] == ["-m", "mpitrain"], argv
batch = int(argv[argv.index("--batch-size") + 1])
steps = int(argv[argv.index("--steps") + 1])
if os.environ.get("FAKE_FAIL_N") == str(n):
    print("Traceback ...\nValueError: boom on rank 1", file=sys.stderr)
    sys.exit(3)
sps = 1000.0 * batch / 64 * (1 + 0.8 * (n - 1))
step_ms = 1000.0 * batch * n / sps
recs = [{{"event": "step", "step": 1, "loss": 2.3}}]
if os.environ.get("FAKE_NO_SUMMARY") != "1":
    recs.append({{"event": "summary", "samples_per_sec": sps, "step_time_ms": step_ms,
                 "comm_time_ms": step_ms * 0.1 * (n - 1), "ranks": n, "steps": steps,
                 "test_accuracy": 0.1, "batch_seen": batch}})
with open(argv[argv.index("--metrics-json") + 1], "w") as f:
    f.write("\n".join(json.dumps(r) for r in recs) + "\n")
'''


def load_scaling():
    spec = importlib.util.spec_from_file_location("scaling_under_test", SCALING)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def fake_env(tmp_path):
    fake = tmp_path / "fake-mpiexec"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(0o755)
    return dict(os.environ, MPIEXEC=str(fake))


def run_scaling(args, env, timeout=120):
    return subprocess.run([sys.executable, str(SCALING)] + args, capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=REPO)


def test_weak_sweep_with_fake_launcher(tmp_path, fake_env):
    out = tmp_path / "out"
    proc = run_scaling(["--ranks", "1", "2", "4", "--model", "mlp", "lenet", "--mode", "weak",
                        "--steps", "5", "--batch-size", "32", "--out", str(out)], fake_env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "scaling-weak.json").read_text())
    assert (out / "scaling-weak.png").stat().st_size > 10_000
    assert doc["mode"] == "weak" and doc["steps"] == 5
    cores = load_scaling().usable_cores()
    pts = {(p["model"], p["ranks"]): p for p in doc["points"]}
    assert sorted(pts) == [("lenet", 1), ("lenet", 2), ("lenet", 4),
                           ("mlp", 1), ("mlp", 2), ("mlp", 4)]
    for (model, n), p in pts.items():
        assert p["per_rank_batch"] == 32 and p["global_batch"] == 32 * n
        assert p["samples_per_sec"] == pytest.approx(500.0 * (1 + 0.8 * (n - 1)))
        assert p["speedup"] == pytest.approx(1 + 0.8 * (n - 1))
        assert p["efficiency"] == pytest.approx((1 + 0.8 * (n - 1)) / n)
        assert p["comm_share"] == pytest.approx(0.1 * (n - 1))
        assert p["oversubscribed"] == (n > cores)
    table = proc.stdout
    assert "samples/s" in table and "efficiency" in table and "comm share" in table
    assert ("4*" in table) == (4 > cores)
    if 4 > cores:
        assert "oversubscribed" in proc.stderr and "oversubscribed" in table
    assert len(list((out / "runs").glob("*.log"))) == 6
    assert all(p["load_before"] >= 0 for p in doc["points"]) and "load average" in table


def test_ceiling_runs_independent_single_rank_jobs(tmp_path, fake_env):
    """--ceiling: N concurrent 1-rank jobs per N > 1; the fake gives each 1000 samples/s at
    batch 64, so the ceiling is N x the 1-rank point: speedup exactly N."""
    out = tmp_path / "out"
    proc = run_scaling(["--ranks", "1", "2", "3", "--steps", "4", "--out", str(out),
                        "--ceiling", "--markdown"], fake_env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "scaling-weak.json").read_text())
    by_n = {p["ranks"]: p for p in doc["points"]}
    assert "ceiling_speedup" not in by_n[1] and doc["ceiling"] is True
    for n in (2, 3):
        assert by_n[n]["ceiling_samples_per_sec"] == pytest.approx(1000.0 * n)
        assert by_n[n]["ceiling_speedup"] == pytest.approx(n)
        assert by_n[n]["speedup"] == pytest.approx(1 + 0.8 * (n - 1))
    logs = sorted((out / "runs").glob("*alone*.log"))
    assert len(logs) == 2 + 3
    cores = load_scaling().usable_cores()
    assert f"--threads {max(1, cores // 3)}" in [p for p in logs if "-n3-" in p.name][0].read_text()
    assert "no-comm ceiling" in proc.stdout and "| 2.00 |" in proc.stdout
    env = dict(fake_env, FAKE_FAIL_N="1")       # the independent jobs are 1-rank jobs
    proc = run_scaling(["--ranks", "2", "--steps", "2", "--out", str(tmp_path / "o2"),
                        "--ceiling"], env)
    assert proc.returncode == 1
    assert "mlp ceiling N=2: an independent 1-rank job failed (3)" in proc.stderr


def test_strong_sweep_divides_global_batch(tmp_path, fake_env):
    out = tmp_path / "out"
    proc = run_scaling(["--ranks", "1", "2", "--mode", "strong", "--steps", "3",
                        "--batch-size", "64", "--out", str(out), "--markdown"], fake_env)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((out / "scaling-strong.json").read_text())
    by_n = {p["ranks"]: p for p in doc["points"]}
    assert by_n[1]["per_rank_batch"] == 64 and by_n[2]["per_rank_batch"] == 32
    assert by_n[2]["global_batch"] == 64
    # The fake job at batch 32/rank and N=2: 500 * 1.8 samples/s, vs 1000 at N=1.
    assert by_n[2]["speedup"] == pytest.approx(0.9)
    assert "| model | N |" in proc.stdout


def test_strong_batch_not_divisible_is_one_line_error(tmp_path, fake_env):
    proc = run_scaling(["--ranks", "1", "3", "--mode", "strong", "--batch-size", "64",
                        "--out", str(tmp_path)], fake_env)
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines() == [
        "scaling: error: strong scaling: global batch 64 is not divisible by N=3"]


def test_failed_run_is_one_line_error(tmp_path, fake_env):
    env = dict(fake_env, FAKE_FAIL_N="2")
    proc = run_scaling(["--ranks", "1", "2", "--steps", "2", "--out", str(tmp_path)], env)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("scaling: error: mlp N=2 failed (exit 3): ValueError: boom on rank 1")
    assert not (tmp_path / "scaling-weak.json").exists()


def test_missing_summary_is_an_error(tmp_path, fake_env):
    env = dict(fake_env, FAKE_NO_SUMMARY="1")
    proc = run_scaling(["--ranks", "1", "--steps", "2", "--out", str(tmp_path)], env)
    assert proc.returncode == 1
    assert "no summary record" in proc.stderr.strip().splitlines()[-1]


def test_missing_launcher(tmp_path):
    env = dict(os.environ, MPIEXEC=str(tmp_path / "nope"))
    proc = run_scaling(["--ranks", "1", "--out", str(tmp_path)], env)
    assert proc.returncode == 1 and "no MPI launcher" in proc.stderr


def test_points_reject_impossible_values():
    sc = load_scaling()
    ok = {"samples_per_sec": 100.0, "step_time_ms": 10.0, "comm_time_ms": 1.0, "ranks": 2,
          "steps": 5}
    p = sc.make_point(ok, "mlp", "weak", 2, 64, cores=1)
    assert p["oversubscribed"] and p["comm_share"] == pytest.approx(0.1)
    for bad in ({"ranks": 3}, {"samples_per_sec": 0.0}, {"step_time_ms": float("nan")},
                {"comm_time_ms": 50.0}):
        with pytest.raises(sc.ScalingError):
            sc.make_point(dict(ok, **bad), "mlp", "weak", 2, 64, cores=4)


def test_best_of_repeats_and_speedup_base():
    sc = load_scaling()

    def pt(n, sps):
        return {"model": "lenet", "ranks": n, "samples_per_sec": sps}
    best = sc.add_speedup(sc.best_of([pt(2, 90.0), pt(4, 150.0), pt(2, 100.0), pt(4, 120.0)]))
    assert [(p["ranks"], p["samples_per_sec"]) for p in best] == [(2, 100.0), (4, 150.0)]
    # Without an N=1 point, speedup is relative to the smallest N, scaled by it.
    assert [p["speedup"] for p in best] == pytest.approx([2.0, 3.0])
    assert [p["efficiency"] for p in best] == pytest.approx([1.0, 0.75])


def _have_cli():
    return all((REPO / "mpitrain" / f).exists() for f in ("__main__.py", "train.py"))


@pytest.mark.skipif(not Path(MPIEXEC).exists(), reason=f"no mpiexec at {MPIEXEC}")
@pytest.mark.skipif(not _have_cli(), reason="python -m mpitrain has not landed")
def test_real_cli_tiny_sweep(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, MPIEXEC=MPIEXEC, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    proc = run_scaling(["--ranks", "1", "2", "--model", "mlp", "--steps", "6",
                        "--batch-size", "16", "--out", str(out), "--timeout", "240",
                        "--", "--hidden", "32", "--synthetic-samples", "256"], env, timeout=560)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "scaling-weak.json").read_text())
    assert [p["ranks"] for p in doc["points"]] == [1, 2]
    for p in doc["points"]:
        assert p["samples_per_sec"] > 0 and p["steps"] == 6 and 0 <= p["comm_share"] <= 1.05
    assert doc["points"][0]["speedup"] == pytest.approx(1.0)
    assert (out / "scaling-weak.png").exists()
