"""`make gpu-check`'s own steps under NUMBA_ENABLE_CUDASIM=1 (a fake nvidia-smi on PATH).

The train step runs for real on the simulated GPU: a tiny MLP on the CPU and with the Numba CUDA
flavour, --save parameters compared; the CuPy flavour is skipped with the reason. And
benchmarks/allreduce_device.py on 2 simulated GPUs: the host transport verified and timed, the
NCCL references skipped because the ranks share a GPU, a forced NCCL transport skipped.
"""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
MPIEXEC = os.environ.get("MPIEXEC", str(ROOT / ".venv" / "bin" / "mpiexec"))


def sim_env(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "nvidia-smi").write_text('#!/bin/sh\necho "GPU 0: Simulated (UUID: GPU-0)"\n')
    (bin_dir / "nvidia-smi").chmod(0o755)
    return dict(os.environ, NUMBA_ENABLE_CUDASIM="1", OMP_NUM_THREADS="1",
                PATH=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")


def test_train_step_on_the_simulator(tmp_path, dev):
    out = tmp_path / "out"
    args = ["--only", "train", "--models", "mlp", "--out", str(out), "--train-args",
            "--hidden 8 --synthetic-samples 16 --steps 2 --batch-size 4"]
    if os.path.exists(MPIEXEC):
        args += ["--mpiexec", MPIEXEC]
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")] + args,
                         env=sim_env(tmp_path), cwd=tmp_path, capture_output=True, text=True,
                         timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((out / "report.json").read_text())
    train = next(s for s in doc["steps"] if s["name"] == "train")
    runs = {r["name"]: r for r in train["runs"]}
    assert train["status"] == "passed"
    assert runs["mlp cpu"]["status"] == "passed"
    numba = runs["mlp cuda-numba"]
    assert numba["status"] == "passed"
    assert set(numba["results"]["max_abs_err"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    if doc["facts"]["flavours"]["cupy"] is not None:           # no CuPy here: skipped, with why
        assert runs["mlp cuda-cupy"]["status"] == "skipped"
        assert runs["mlp cuda-cupy"]["reason"] == doc["facts"]["flavours"]["cupy"]
    assert doc["finished"] and doc["summary"] == {"passed": 1, "skipped": len(doc["steps"]) - 1}
    assert "backend cuda-numba" in (out / "gpu-check.log").read_text()


# a CuPy without NVRTC: imports and sees a device, compiles nothing (tests/support/fake_cupy.py)
NO_NVRTC_CUPY = """
import sys, types
from tests.support import fake_cupy
cp = fake_cupy.module()
cp.cuda.Device = lambda i: types.SimpleNamespace(use=lambda: None)
class ElementwiseKernel(fake_cupy.ElementwiseKernel):
    def __call__(self, *args):
        raise RuntimeError("CuPy failed to load libnvrtc.so.12")
cp.ElementwiseKernel = ElementwiseKernel
sys.modules["cupy"] = cp
"""
# a Numba that cannot compile a kernel for the device: every launch fails
NO_NVVM_NUMBA = """
from numba.cuda.simulator import kernel
def launch(self, *args):
    raise RuntimeError("libNVVM cannot be found")
kernel.FakeCUDAKernel.__call__ = launch
"""


def dry_run(tmp_path, stubs):
    """gpu_check --dry-run on the simulator with the stub modules {name: source} importable."""
    stub = tmp_path / "stub"
    stub.mkdir()
    for name, text in stubs.items():
        (stub / f"{name}.py").write_text(text)
    out = tmp_path / "out"
    args = ["--dry-run", "--out", str(out)]
    if os.path.exists(MPIEXEC):
        args += ["--mpiexec", MPIEXEC]
    env = dict(sim_env(tmp_path), PYTHONPATH=os.pathsep.join([str(stub), str(ROOT)]))
    res = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")] + args,
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    doc = json.loads((out / "report.json").read_text())
    return res.stdout, {s["name"]: s for s in doc["steps"]}


def test_a_cupy_without_nvrtc_is_one_line_and_its_runs_are_left_out(tmp_path, dev):
    stdout, steps = dry_run(tmp_path, {"cupy": NO_NVRTC_CUPY})
    why = "a 4-element test kernel failed: RuntimeError: CuPy failed to load libnvrtc.so.12"
    assert [line for line in stdout.splitlines() if "unusable" in line] == [
        f"gpu-check: cupy flavour unusable: {why}"]
    kernels = {r["name"]: r for r in steps["kernels"]["runs"]}
    assert kernels["pytest"]["skip"] is None and " -k numba " in kernels["pytest"]["cmd"]
    assert kernels["cupy"]["skip"] == f"cupy flavour unusable: {why}"
    train = {r["name"]: r for r in steps["train"]["runs"]}
    assert train["lenet cuda-cupy"]["skip"] == why
    assert train["lenet cuda-numba"]["skip"] is None         # its probe kernel ran
    assert [r["name"] for r in steps["step"]["runs"]][:2] == ["numba batch 64", "numba batch 256"]


def test_a_numba_that_cannot_compile_is_one_line(tmp_path, dev):
    stdout, steps = dry_run(tmp_path, {"sitecustomize": NO_NVVM_NUMBA})
    why = "a 4-element test kernel failed: RuntimeError: libNVVM cannot be found"
    assert f"gpu-check: numba flavour unusable: {why}" in stdout.splitlines()
    train = {r["name"]: r for r in steps["train"]["runs"]}
    assert train["lenet cuda-numba"]["skip"] == why


def run_allreduce(tmp_path, name, **env):
    path = tmp_path / f"{name}.json"
    cmd = [MPIEXEC, "-n", "2", sys.executable, str(ROOT / "benchmarks" / "allreduce_device.py"),
           "--kernels", "numba", "--max-bytes", "16K", "--iters", "2", "--json", str(path)]
    res = subprocess.run(["timeout", "-k", "5", "200"] + cmd, env=dict(sim_env(tmp_path), **env),
                         cwd=tmp_path, capture_output=True, text=True, timeout=220)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(path.read_text())


def test_device_allreduce_benchmark_on_two_simulated_gpus(tmp_path, dev):
    if not os.path.exists(MPIEXEC) and "/" in MPIEXEC:
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    doc = run_allreduce(tmp_path, "auto")
    assert (doc["ranks"], doc["transport"], doc["shared_gpu"]) == (2, "host", True)
    assert [r["bytes"] for r in doc["results"]] == [4096, 16384]
    assert all(r["mpitrain-host"]["busbw_GBps"] > 0 for r in doc["results"])
    for ref in ("cupy-nccl", "torch-nccl"):
        assert doc["references_skipped"][ref] == "ranks share a GPU (NCCL needs one rank per GPU)"
    forced = run_allreduce(tmp_path, "nccl", MPITRAIN_DEVICE_COMM="nccl")
    assert forced["skipped"].startswith("MPITRAIN_DEVICE_COMM=nccl")
