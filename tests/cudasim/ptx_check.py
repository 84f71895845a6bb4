"""Compile every kernel of kernels/cuda_numba.py to PTX for the real CUDA target, without a GPU.

The simulator runs kernels as Python, so it never type-checks them the way the CUDA target does
(shared-array shapes must be compile-time constants, some builtins need a device, ...). NVVM
itself needs no GPU, only libnvvm + libdevice (a CUDA toolkit, or the pip wheel
nvidia-cuda-nvcc-cu12; point CUDA_HOME at it). This script drives every kernel case of
tests/support/kernel_cases.py through the real module with NumPy stand-ins for device arrays; each launch,
instead of running, compiles the kernel for the launch's argument types with
``numba.cuda.compile_ptx`` (sm_80). Run with NUMBA_ENABLE_CUDASIM unset:

    CUDA_HOME=.../nvidia/cuda_nvcc python -m tests.cudasim.ptx_check    (from the repository root)

Exit 0 and "N kernel specialisations compiled to PTX, 0 cases failed" when all compile. It
patches numba.cuda internals (launch, current device) for that purpose only: a check, not a run.
"""
import importlib.util
import pathlib
import sys
import traceback
import types

import numpy as np

import numba
import numba.cuda.compiler as cuda_compiler
from numba import cuda
from numba.cuda import dispatcher

HERE = pathlib.Path(__file__).resolve().parent
CC = (8, 0)


class HostDev(np.ndarray):
    """A NumPy array that passes for a Numba device array in kernels/cuda_numba.py."""

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


compiled = set()


def _compile_instead_of_launch(self, *args):
    argtypes = tuple(numba.typeof(np.asarray(a) if isinstance(a, HostDev) else a) for a in args)
    key = (self.dispatcher.py_func.__qualname__, argtypes)
    if key not in compiled:
        cuda.compile_ptx(self.dispatcher.py_func, argtypes, cc=CC)
        compiled.add(key)


def load_module():
    fake_device = types.SimpleNamespace(compute_capability=CC)
    dispatcher.get_current_device = lambda: fake_device
    cuda_compiler.get_current_device = lambda: fake_device
    dispatcher._LaunchConfiguration.__call__ = _compile_instead_of_launch
    cuda.is_available = lambda: True
    cuda.device_array = lambda shape, dtype=np.float32, **_: np.zeros(shape, dtype).view(HostDev)
    cuda.to_device = lambda a: np.array(a).view(HostDev)
    cuda.synchronize = lambda: None
    spec = importlib.util.spec_from_file_location(
        "cuda_numba_ptx", HERE.parent.parent / "kernels" / "cuda_numba.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    if numba.config.ENABLE_CUDASIM:
        print("ptx_check: unset NUMBA_ENABLE_CUDASIM (this compiles for the real target)")
        return 2
    from numba.cuda.cudadrv import nvvm
    if not nvvm.is_available():
        print("ptx_check: libnvvm not found (set CUDA_HOME to a CUDA toolkit or to the "
              "nvidia-cuda-nvcc-cu12 wheel's nvidia/cuda_nvcc folder)")
        return 2
    mod = load_module()
    from tests.support.kernel_cases import _cases
    failed = 0
    for cid, name, build, _ in _cases():
        args = [np.array(a).view(HostDev) if isinstance(a, np.ndarray) else a
                for a in build(np.random.default_rng(0))]
        try:
            getattr(mod, name)(*args)
        except Exception:  # noqa: BLE001 - report every failing case, then fail
            failed += 1
            print(f"FAIL {cid}:\n" + "\n".join(traceback.format_exc().splitlines()[-12:]))
    print(f"{len(compiled)} kernel specialisations compiled to PTX, {failed} cases failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
