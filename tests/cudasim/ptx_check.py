"""Compile every kernel of kernels/cuda_numba/ to PTX for the real CUDA target, without a GPU.

The simulator runs kernels as Python, so it never type-checks them the way the CUDA target does
(shared-array shapes must be compile-time constants, some builtins need a device, ...). NVVM
itself needs no GPU, only libnvvm + libdevice (a CUDA toolkit, or the pip wheel
nvidia-cuda-nvcc-cu12; point CUDA_HOME at it). This script drives every kernel case of
tests/support/kernel_cases.py and transformer_cases.py through the real module with NumPy
stand-ins for device arrays; each launch, instead of running, compiles the kernel for the
launch's argument types with ``numba.cuda.compile_ptx`` (sm_80). Run with NUMBA_ENABLE_CUDASIM unset:

    CUDA_HOME=.../nvidia/cuda_nvcc python -m tests.cudasim.ptx_check    (from the repository root)

Exit 0 and "N kernel specialisations compiled to PTX, 0 cases failed" when all compile. It
patches numba.cuda internals (launch, current device) for that purpose only: a check, not a run.

Two rules are checked on the way (a line each per offence, and exit 1):

- FLOAT64: a float32 specialisation whose PTX has a float64 instruction (a Python float literal
  or an integer divisor promotes the arithmetic around it), outside FLOAT64_BY_DESIGN.
- CACHED-FLOAT16: a float16 launch of a disk-cached kernel (``cuda.jit(cache=True)``). numba-cuda
  links CUDA's fp16 library into a kernel that computes in float16, and saving such a kernel
  raises "Cannot pickle CUDACodeLibrary with linking files" at its first launch on a GPU.

``--launches-only`` drives the cases and checks the second rule without compiling anything (no
libnvvm needed).
"""
import importlib
import re
import sys
import traceback
import types

import numpy as np

import numba
import numba.cuda.compiler as cuda_compiler
from numba import cuda
from numba.cuda import dispatcher

CC = (8, 0)

# Kernels that compute in float64 on purpose, whatever the data's dtype: sums and dot products
# accumulated in float64 (total, count_correct, BatchNorm statistics, softmax, the pools' window
# sums, LayerNorm's and the causal softmax's row sums) and the per-row losses, which follow the
# CPU kernels' float64.
FLOAT64_BY_DESIGN = frozenset({
    "_total_k", "_count_correct_k",
    "_bn_stats_k", "_bn_backward_stats_k", "_bn_moments_k", "_bn_eval_moments_k",
    "_bn_input_coeffs_k", "_bn_param_grads_k",
    "_softmax_k", "_softmax_backward_k", "_softmax_xent_k", "_label_smoothing_k",
    "_avgpool_forward_k", "_avgpool_backward_k", "_global_avgpool_forward_k",
    "_layernorm_forward_k", "_layernorm_backward_x_k", "_layernorm_param_chunks_k",
    "_layernorm_param_sum_k", "_causal_softmax_k", "_causal_softmax_backward_k",
})
_F64_OP = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*\.f64)\b", re.M)   # add.f64, cvt.rn.f32.f64


class HostDev(np.ndarray):
    """A NumPy array that passes for a Numba device array in kernels/cuda_numba/."""

    __cuda_ndarray__ = True

    def copy_to_host(self, ary=None):
        if ary is None:
            return np.array(self)
        ary[...] = self
        return ary

    def copy_to_device(self, ary):
        self[...] = ary

    def is_c_contiguous(self):
        return self.flags.c_contiguous


compiled = {}                   # (kernel name, argument types) -> PTX (None: launches only)
cached_float16 = set()          # (kernel name, argument types) breaking the CACHED-FLOAT16 rule
COMPILE = True


def _dtype(t):
    return getattr(t, "dtype", t)


def _disk_cached(disp):
    return type(getattr(disp, "_cache", None)).__name__ not in ("NullCache", "NoneType")


def _compile_instead_of_launch(self, *args):
    argtypes = tuple(numba.typeof(np.asarray(a) if isinstance(a, HostDev) else a) for a in args)
    disp = self.dispatcher
    key = (disp.py_func.__qualname__, argtypes)
    if _disk_cached(disp) and any(_dtype(t) == numba.types.float16 for t in argtypes):
        cached_float16.add(key)
    if key not in compiled:
        compiled[key] = cuda.compile_ptx(disp.py_func, argtypes, cc=CC)[0] if COMPILE else None


def float64_in_float32():
    """{(kernel name, argument types): float64 instructions} of the float32 specialisations."""
    found = {}
    for (kname, argtypes), ptx in compiled.items():
        if ptx is None or kname in FLOAT64_BY_DESIGN:
            continue
        if any(isinstance(t, numba.types.Array) and t.dtype == numba.float32 for t in argtypes):
            ops = sorted(set(_F64_OP.findall(ptx)))
            if ops:
                found[(kname, argtypes)] = ops
    return found


def load_module():
    fake_device = types.SimpleNamespace(compute_capability=CC, MULTIPROCESSOR_COUNT=132)
    dispatcher.get_current_device = lambda: fake_device
    cuda_compiler.get_current_device = lambda: fake_device
    cuda.get_current_device = lambda: fake_device
    dispatcher._LaunchConfiguration.__call__ = _compile_instead_of_launch
    cuda.is_available = lambda: True
    cuda.device_array = lambda shape, dtype=np.float32, **_: np.zeros(shape, dtype).view(HostDev)
    cuda.to_device = lambda a: np.array(a).view(HostDev)
    cuda.synchronize = lambda: None
    return importlib.import_module("mpitrain.kernels.cuda_numba")     # after the patches above


def main(argv=()):
    global COMPILE
    COMPILE = "--launches-only" not in argv
    if numba.config.ENABLE_CUDASIM:
        print("ptx_check: unset NUMBA_ENABLE_CUDASIM (this compiles for the real target)")
        return 2
    from numba.cuda.cudadrv import nvvm
    if COMPILE and not nvvm.is_available():
        print("ptx_check: libnvvm not found (set CUDA_HOME to a CUDA toolkit or to the "
              "nvidia-cuda-nvcc-cu12 wheel's nvidia/cuda_nvcc folder)")
        return 2
    mod = load_module()
    from tests.support import kernel_cases, transformer_cases
    failed = 0
    for cid, name, build, _ in [*kernel_cases._cases(), *transformer_cases._cases()]:
        args = [np.array(a).view(HostDev) if isinstance(a, np.ndarray) else a
                for a in build(np.random.default_rng(0))]
        try:
            getattr(mod, name)(*args)
        except Exception:  # noqa: BLE001 - report every failing case, then fail
            failed += 1
            print(f"FAIL {cid}:\n" + "\n".join(traceback.format_exc().splitlines()[-12:]))
    f64 = float64_in_float32()
    for (kname, argtypes), ops in sorted(f64.items(), key=str):
        print(f"FLOAT64 {kname}({', '.join(map(str, argtypes))}): {' '.join(ops)}")
    for kname, argtypes in sorted(cached_float16, key=str):
        print(f"CACHED-FLOAT16 {kname}({', '.join(map(str, argtypes))})")
    done = "compiled to PTX" if COMPILE else "launched"
    print(f"{len(compiled)} kernel specialisations {done}, {failed} cases failed, "
          f"{len(f64)} float32 specialisations with float64 instructions, "
          f"{len(cached_float16)} float16 specialisations of disk-cached kernels")
    return 1 if failed or f64 or cached_float16 else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
