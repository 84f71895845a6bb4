"""`python -m mpitrain --device cuda` (both flavours) against the same run on the CPU.

LeNet, 3 steps on synthetic data; final parameters (--save) must agree with the CPU's to float32
rounding, on 1 rank and on 2 ranks sharing the GPU (against 1 CPU rank with the double batch).
Launches mpiexec itself, so it is skipped when pytest already runs under mpiexec.
"""
import subprocess
import sys

import numpy as np
import pytest

import mpitrain as mt
from tests.support.launch import MPIEXEC, child_env

pytestmark = pytest.mark.gpu
ARGS = ["--model", "lenet", "--dataset", "synthetic", "--synthetic-samples", "64", "--steps", "3",
        "--lr", "0.05", "--no-progress"]


def run(tmp_path, tag, extra, ranks=1):
    out = tmp_path / f"{tag}.npz"
    cmd = [sys.executable, "-m", "mpitrain"] + ARGS + extra + ["--save", str(out)]
    if ranks > 1:
        cmd = [MPIEXEC, "-n", str(ranks)] + cmd
    env = child_env(settings=True)
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    res = subprocess.run(["timeout", "-k", "5", "240"] + cmd, env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=260)
    assert res.returncode == 0, res.stderr[-3000:]
    with np.load(out) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.parametrize("ranks", [1, 2])
def test_cli_matches_cpu(tmp_path, gpu, ranks):
    if mt.size() > 1:
        pytest.skip("launches mpiexec itself; run it from a plain pytest")
    flavour = "cupy" if gpu.name == "cuda-cupy" else "numba"
    got = run(tmp_path, "gpu", ["--device", "cuda", "--kernels", flavour, "--batch-size", "8"],
              ranks=ranks)
    want = run(tmp_path, "cpu", ["--device", "cpu", "--batch-size", str(8 * ranks)])
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-3, atol=1e-5, err_msg=name)
