"""The Numba flavour's disk cache and float16, on a real GPU.

numba-cuda links CUDA's fp16 library into a kernel that computes in float16, and Numba cannot save
such a kernel to its disk cache ("Cannot pickle CUDACodeLibrary with linking files", raised at the
kernel's first launch). The fp16 gradient compression runs scale, add, fill, copy and total on
float16 buffers, so those must never be disk-cached for float16, while their float32 versions stay
cached. Offline, tests/cudasim/test_cuda_numba_kernels.py checks the same rule on the dispatchers
(without the linking, which needs numba-cuda and a GPU).
"""
import pathlib
import subprocess
import sys

import pytest

from tests.support.gpu_backend import load_backend
from tests.support.launch import child_env

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = """
import numpy as np
from mpitrain.comm import device
device.select_device()
from mpitrain import kernels
k = kernels.get("cuda", "numba")
for dt in (np.float16, np.float32):
    a = k.to_device(np.arange(8, dtype=dt))                 # 0..7
    b = k.empty((8,), dt)
    k.fill(b, 1)
    k.scale(a, 0.5)
    k.add(a, b)                                             # 1, 1.5, ..., 4.5
    k.copy(b, a)
    k.dropout_backward(a, b, b)                             # b = a * a
    k.sgd_update(a, b, None, 0.5, 0.0, False, 0.0)          # a -= a * a / 2
    x = np.arange(8) * 0.5 + 1
    want = x - x * x / 2
    got = k.to_host(a)
    assert got.dtype == dt and np.array_equal(got, want.astype(dt)), (dt, got, want)
    assert k.total(a) == float(want.astype(dt).astype(np.float64).sum())
k.synchronize()
print("float16 and float32 ok")
"""


def test_float16_kernels_run_and_float32_kernels_stay_cached(tmp_path):
    load_backend("numba")                                   # skips without a GPU
    # not a rank of the job this test may run in (2 ranks share the GPU in the GPU check)
    env = child_env(settings=True, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("NUMBA_ENABLE_CUDASIM", None)
    res = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=240)
    assert res.returncode == 0 and "float16 and float32 ok" in res.stdout, \
        res.stdout[-2000:] + res.stderr[-4000:]
    for kernel in ("_scale_k", "_add_k", "_fill_k", "_copy_k", "_total_k"):
        assert list(tmp_path.rglob(f"*{kernel}*.nbi")), f"{kernel} was not saved to the cache"
