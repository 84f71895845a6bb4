"""The benchmark scripts without their optional modules (benchmarks/benchdeps.py).

Each script runs in a subprocess whose sitecustomize makes matplotlib (and torch) unimportable,
as on a machine where mpitrain was pip-installed without the `bench` extra:
- a PNG that is a side product of --out (scaling.py, perfmodel.py): the JSON and markdown are
  written, the PNG is skipped with one line, exit 0 -- the sweep's results are not lost;
- a module asked for by name (allreduce.py --plot, step.py --torch): one line and exit 2 before
  anything is measured or written.
Seconds each: scaling.py runs against a fake launcher, perfmodel.py on synthetic inputs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"
MPIEXEC = os.environ.get("MPIEXEC", str(REPO / ".venv" / "bin" / "mpiexec"))
HINT = "(pip install 'mpitrain[bench]')"

# What `python -m mpitrain` would write: one summary record (see tests/e2e/test_scaling.py).
FAKE_MPIEXEC = r'''#!{python}
import json, sys
argv = sys.argv[1:]
n = int(argv[argv.index("-n") + 1])
summary = {{"event": "summary", "samples_per_sec": 1000.0 * n, "step_time_ms": 64.0,
           "comm_time_ms": 6.4 * (n - 1), "ranks": n, "steps": 5, "test_accuracy": 0.1}}
with open(argv[argv.index("--metrics-json") + 1], "w") as f:
    f.write(json.dumps(summary) + "\n")
'''


def env_without(tmp_path, *modules, **more):
    """os.environ plus a sitecustomize that makes `modules` fail to import."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    path = os.pathsep.join(filter(None, [str(shim), os.environ.get("PYTHONPATH")]))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL"))}
    return dict(clean, PYTHONPATH=path, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
                NUMBA_NUM_THREADS="1", **more)


def run(cmd, env, cwd, timeout=120):
    cmd = ["timeout", "-k", "5", str(timeout)] + [str(c) for c in cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                          timeout=timeout + 30)
    assert proc.returncode not in (124, 137), f"timed out: {cmd}\n{proc.stderr[-2000:]}"
    return proc


def test_the_shim_hides_matplotlib(tmp_path):
    proc = run([sys.executable, "-c", "import matplotlib"], env_without(tmp_path, "matplotlib"),
               tmp_path)
    assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr


def test_scaling_keeps_its_results_without_matplotlib(tmp_path):
    fake = tmp_path / "fake-mpiexec"
    fake.write_text(FAKE_MPIEXEC.format(python=sys.executable))
    fake.chmod(0o755)
    out = tmp_path / "out"
    proc = run([sys.executable, BENCH / "scaling.py", "--ranks", "1", "2", "--steps", "5",
                "--out", out, "--markdown", out / "scaling.md"],
               env_without(tmp_path, "matplotlib", MPIEXEC=str(fake)), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    doc = json.loads((out / "scaling-weak.json").read_text())
    assert [p["ranks"] for p in doc["points"]] == [1, 2]
    assert "| mlp |" in (out / "scaling.md").read_text()
    assert not (out / "scaling-weak.png").exists()
    png = out / "scaling-weak.png"
    assert f"matplotlib not installed: skipped {png} {HINT}" in proc.stderr.splitlines()
    assert f"wrote {out / 'scaling-weak.json'}" in proc.stderr


def test_perfmodel_keeps_its_results_without_matplotlib(tmp_path):
    sizes = [1 << k for k in range(12, 24, 2)]
    ring = [{"bytes": n, "ours_s": 2e-5 + n / 1e9, "ours_min_s": 2e-5 + n / 1e9,
             "mpi_s": 3e-5 + n / 1e9, "mpi_min_s": 3e-5 + n / 1e9} for n in sizes]
    (tmp_path / "a.json").write_text(json.dumps({"ranks": 2, "algo": "ring", "results": ring}))
    (tmp_path / "s.json").write_text(json.dumps(
        {"results": [{"model": "mlp", "batch": 64, "step_time_ms": 20.0}]}))
    out = tmp_path / "out"
    proc = run([sys.executable, BENCH / "perfmodel.py", "--allreduce", tmp_path / "a.json",
                "--step", tmp_path / "s.json", "--model", "mlp", "--max-ranks", "8",
                "--no-measure", "--out", out, "--markdown", out / "pm.md"],
               env_without(tmp_path, "matplotlib"), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert json.loads((out / "perfmodel.json").read_text())["benchmark"] == "perfmodel"
    assert (out / "pm.md").stat().st_size > 0
    assert not (out / "perfmodel.png").exists()
    assert f"matplotlib not installed: skipped {out / 'perfmodel.png'} {HINT}" in \
        proc.stderr.splitlines()


def test_allreduce_plot_without_matplotlib_stops_before_timing(tmp_path):
    out = tmp_path / "out"
    proc = run([MPIEXEC, "-n", "2", sys.executable, BENCH / "allreduce.py", "--max-bytes", "64",
                "--budget", "0.01", "--out", out, "--plot"],
               env_without(tmp_path, "matplotlib"), tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip().splitlines() == [
        f"allreduce: error: --plot needs matplotlib, which is not installed {HINT}"]
    assert proc.stdout == "" and not out.exists()


def test_step_torch_without_torch_stops_before_timing(tmp_path):
    out = tmp_path / "out"
    proc = run([sys.executable, BENCH / "step.py", "--model", "mlp", "--steps", "1",
                "--rounds", "1", "--warmup", "0", "--torch", "--out", out],
               env_without(tmp_path, "torch"), tmp_path)
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    assert proc.stderr.strip().splitlines() == [
        "step: error: --torch needs torch, which is not installed (pip install torch)"]
    assert proc.stdout == "" and not out.exists()
