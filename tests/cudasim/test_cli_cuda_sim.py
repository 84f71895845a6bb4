"""`python -m mpitrain --device cuda --kernels numba` under the simulator matches the CPU run.

Two SGD steps of a tiny MLP (784-8-10) on the synthetic dataset; the final parameters (--save)
must match the CPU backend's within float32 rounding, on 1 rank and on 2 ranks (simulated GPUs,
device gradient allreduce) against 1 CPU rank with the double batch (N x b == 1 x N*b).
"""
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
MPIEXEC = os.environ.get("MPIEXEC", str(ROOT / ".venv" / "bin" / "mpiexec"))
ARGS = ["--dataset", "synthetic", "--synthetic-samples", "16", "--steps", "2", "--hidden", "8",
        "--lr", "0.1", "--no-progress"]


def run(tmp_path, tag, extra, ranks=1, sim=True):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    if sim:
        env["NUMBA_ENABLE_CUDASIM"] = "1"
    out = tmp_path / f"{tag}.npz"
    cmd = [sys.executable, "-m", "mpitrain"] + ARGS + extra + ["--save", str(out)]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    res = subprocess.run(["timeout", "-k", "5", "240"] + cmd, env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=260)
    return res, out


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def assert_same_params(got, want):
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_one_rank_matches_cpu(tmp_path, dev):
    gpu, gpu_out = run(tmp_path, "gpu", ["--device", "cuda", "--kernels", "numba",
                                         "--batch-size", "4"])
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert "backend cuda-numba" in gpu.stdout + gpu.stderr
    cpu, cpu_out = run(tmp_path, "cpu", ["--device", "cpu", "--batch-size", "4"], sim=False)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert_same_params(load(gpu_out), load(cpu_out))


def test_two_simulated_gpus_match_one_cpu_rank_with_the_double_batch(tmp_path, dev):
    if "/" in MPIEXEC and not os.path.exists(MPIEXEC):
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    gpu, gpu_out = run(tmp_path, "gpu2", ["--device", "cuda", "--kernels", "numba",
                                          "--batch-size", "4"], ranks=2)
    assert gpu.returncode == 0, gpu.stderr[-3000:]
    assert "device allreduce via host" in gpu.stderr
    cpu, cpu_out = run(tmp_path, "cpu8", ["--device", "cpu", "--batch-size", "8"], sim=False)
    assert cpu.returncode == 0, cpu.stderr[-3000:]
    assert_same_params(load(gpu_out), load(cpu_out))


def test_without_a_gpu_device_cuda_exits_2_with_one_line(tmp_path):
    probe = subprocess.run([sys.executable, "-c", "from numba import cuda; "
                            "print(cuda.is_available())"], capture_output=True, text=True,
                           env={k: v for k, v in os.environ.items()
                                if k != "NUMBA_ENABLE_CUDASIM"}, timeout=120)
    if probe.stdout.strip() != "False":
        pytest.skip("a CUDA device is present")
    for flavour in ("numba", "cupy"):
        res, _ = run(tmp_path, flavour, ["--device", "cuda", "--kernels", flavour], sim=False)
        assert res.returncode == 2, res.stderr[-3000:]
        lines = [line for line in res.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "--device cuda" in lines[0], res.stderr
