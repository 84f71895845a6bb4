"""A CPU stand-in for the slice of CuPy that kernels/cuda_cupy/ uses, to check its CUDA C.

No GPU and no CuPy here, yet cuda_cupy/ is mostly CUDA C source strings (ElementwiseKernel
bodies, one RawKernel). This module compiles those strings with the host C++ compiler and runs
them over NumPy arrays with CuPy's calling rules as we rely on them:

- ElementwiseKernel: the body (CuPy appends its ``;``) runs for ``i`` over the broadcast shape
  of the non-raw array arguments; a non-raw argument is the element at ``i`` (inputs broadcast,
  outputs written in place), a ``raw`` one the whole flat array, scalars are converted to their
  declared type; ``T`` is the dtype of the first array bound to a ``T`` parameter; ``preamble``
  is prepended.
- RawKernel: ``kernel(grid, block, args)`` runs every (block, thread) in turn, with blockIdx /
  blockDim / threadIdx / gridDim set (up to three dimensions each); arrays are passed as
  pointers, NumPy scalars by value.
- ReductionKernel (one output, no raw parameters): every output element folds its reduced
  elements in index order (see the class).
- ``atomicAdd`` is a plain add (threads run one at a time).
- A RawKernel whose source calls ``__syncthreads`` runs the threads of each block at the same
  time instead, as host threads meeting at a barrier, one block after the other; its
  ``__shared__`` variables are statics, which every thread of the running block shares.
The array functions (empty, matmul, copyto, add, ...) are NumPy's. What this proves: the kernels'
index arithmetic, types and semantics match the CPU backend. What it cannot: anything about CuPy
itself (broadcasting corner cases, cuBLAS, streams) or the GPU -- tests/gpu does that.
"""
import atexit
import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
import types

import numpy as np

_CTYPE = {"float32": "float", "float64": "double", "int32": "int", "uint32": "unsigned int",
          "int64": "long long", "bool": "bool", "int8": "signed char", "uint8": "unsigned char",
          "int16": "short"}
_CACHE_DIR = tempfile.mkdtemp(prefix="fake_cupy_")
atexit.register(shutil.rmtree, _CACHE_DIR, ignore_errors=True)
_libs = {}
DEVICE_SOURCES = {}             # host source -> the same kernel as CUDA C, for nvcc_check()

_PRELUDE = r"""
#include <cmath>
#include <cstddef>
using std::exp; using std::log; using std::sqrt;
#define __device__
#define __global__
template <typename A> A atomicAdd(A* p, A v) { A old = *p; *p = old + v; return old; }
"""


def compiler_available():
    try:
        subprocess.run(["g++", "--version"], capture_output=True, check=True, timeout=30)
        return True
    except (OSError, subprocess.SubprocessError):
        return False


def _compile(source):
    key = hashlib.sha1(source.encode()).hexdigest()[:16]
    if key not in _libs:
        src = os.path.join(_CACHE_DIR, f"{key}.cpp")
        lib = os.path.join(_CACHE_DIR, f"{key}.so")
        with open(src, "w") as f:
            f.write(source)
        res = subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-o", lib, src],
                             capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"kernel source does not compile:\n{res.stderr}\n{source}")
        _libs[key] = ctypes.CDLL(lib)
    return _libs[key]


def _params(text):
    """'raw T x, int32 n' -> [(raw, type, name), ...]."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        words = part.split()
        raw = words[0] == "raw"
        typ, name = words[-2], words[-1]
        out.append((raw, typ, name))
    return out


class ElementwiseKernel:
    def __init__(self, in_params, out_params, operation, name="kernel", preamble="", **_):
        self.ins, self.outs = _params(in_params), _params(out_params)
        self.operation, self.name, self.preamble = operation, name, preamble

    def __call__(self, *args):
        params = self.ins + self.outs
        if len(args) != len(params):
            raise TypeError(f"{self.name}: {len(params)} arguments expected, got {len(args)}")
        t = next((a.dtype for (_, typ, _), a in zip(params, args)
                  if typ == "T" and isinstance(a, np.ndarray)), None)
        shape = np.broadcast_shapes(*[a.shape for (raw, _, _), a in zip(params, args)
                                      if not raw and isinstance(a, np.ndarray)])
        keep, ptrs, decls = [], [], []
        for k, ((raw, typ, name), a) in enumerate(zip(params, args)):
            dtype = t if typ == "T" else np.dtype(typ)
            ctype = _CTYPE[dtype.name]
            is_out = k >= len(self.ins)
            if isinstance(a, np.ndarray):
                if a.dtype != dtype:
                    raise TypeError(f"{self.name}: {name} is {a.dtype}, expected {dtype}")
                if raw or is_out:
                    if not a.flags.c_contiguous or (is_out and not raw and a.shape != shape):
                        raise ValueError(f"{self.name}: output {name} must be C-contiguous "
                                         f"with shape {shape}")
                    buf = a
                else:
                    buf = np.ascontiguousarray(np.broadcast_to(a, shape))
                if raw:
                    decls.append(f"{ctype}* {name} = ({ctype}*)_args[{k}];")
                else:
                    decls.append(f"{ctype}& {name} = (({ctype}*)_args[{k}])[i];")
            else:
                buf = np.array([a], dtype=dtype)
                decls.append(f"const {ctype} {name} = *({ctype}*)_args[{k}];")
            keep.append(buf)
            ptrs.append(buf.ctypes.data)
        source = (_PRELUDE + f"typedef {_CTYPE[t.name] if t is not None else 'float'} T;\n"
                  + self.preamble + '\nextern "C" void run(long long n, void** _args) {\n'
                  + "  for (long long i = 0; i < n; ++i) {\n    " + "\n    ".join(decls)
                  + "\n    {\n" + self.operation + ";\n    }\n  }\n}\n")
        lib = _compile(source)
        lib.run(ctypes.c_longlong(math.prod(shape)), (ctypes.c_void_p * len(ptrs))(*ptrs))
        # the same body as real CUDA device code, for nvcc_check()
        DEVICE_SOURCES.setdefault(
            source, f"typedef {_CTYPE[t.name] if t is not None else 'float'} T;\n"
            + self.preamble + "\n__global__ void run(long long n, void** _args) {\n"
            + "  long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n"
            + "  if (i >= n) return;\n  " + "\n  ".join(decls)
            + "\n  {\n" + self.operation + ";\n  }\n}\n")


class ReductionKernel:
    """CuPy's ReductionKernel for one output: ``kernel(*ins, out, axis=...)`` or ``out=``.

    Each output element starts from ``identity`` and folds the ``map_expr`` of every reduced
    element with ``reduce_expr`` (``a``, ``b``) in index order, then runs ``post_map_expr`` with
    ``a``; non-raw inputs broadcast, scalars are converted to their declared type. (CuPy's
    own order is a tree within each thread group: for float64 sums of a few hundred values the
    difference is rounding.)"""

    def __init__(self, in_params, out_params, map_expr, reduce_expr, post_map_expr, identity,
                 name="reduce_kernel", reduce_type=None, preamble="", **_):
        self.ins, self.outs = _params(in_params), _params(out_params)
        if len(self.outs) != 1 or any(raw for raw, _, _ in self.ins + self.outs):
            raise NotImplementedError(f"{name}: one output and no raw parameters emulated")
        self.map_expr, self.reduce_expr, self.post_map_expr = map_expr, reduce_expr, post_map_expr
        self.identity, self.name, self.preamble = identity, name, preamble
        self.reduce_type = reduce_type

    def __call__(self, *args, out=None, axis=None, keepdims=False):
        if keepdims:
            raise NotImplementedError(f"{self.name}: keepdims is not emulated")
        if len(args) == len(self.ins) + 1 and out is None:
            args, out = args[:-1], args[-1]
        if len(args) != len(self.ins) or not isinstance(out, np.ndarray):
            raise TypeError(f"{self.name}: {len(self.ins)} inputs and an output array expected")
        t = next((a.dtype for (_, typ, _), a in zip(self.ins, args)
                  if typ == "T" and isinstance(a, np.ndarray)), None)
        shape = np.broadcast_shapes(*[a.shape for a in args if isinstance(a, np.ndarray)])
        axes = tuple(range(len(shape))) if axis is None else tuple(
            sorted(d % len(shape) for d in ((axis,) if isinstance(axis, int) else axis)))
        kept = [d for d in range(len(shape)) if d not in axes]
        out_shape = tuple(shape[d] for d in kept)
        out_type = t if self.outs[0][1] == "T" else np.dtype(self.outs[0][1])
        if out.shape != out_shape or out.dtype != out_type or not out.flags.c_contiguous:
            raise ValueError(f"{self.name}: output must be C-contiguous {out_type} of shape "
                             f"{out_shape}, got {out.dtype} {out.shape}")
        n_out, n_red = math.prod(out_shape), math.prod(shape[d] for d in axes)
        keep, ptrs, decls = [], [], []
        for k, ((_, typ, name), a) in enumerate(zip(self.ins, args)):
            dtype = t if typ == "T" else np.dtype(typ)
            ctype = _CTYPE[dtype.name]
            if isinstance(a, np.ndarray):
                if a.dtype != dtype:
                    raise TypeError(f"{self.name}: {name} is {a.dtype}, expected {dtype}")
                # (outputs..., reduced...) so that element (o, r) is at o * n_red + r
                buf = np.ascontiguousarray(np.broadcast_to(a, shape).transpose(kept + list(axes)))
                decls.append(f"const {ctype} {name} = (({ctype}*)_args[{k}])[_o * _n_red + _r];")
            else:
                buf = np.array([a], dtype=dtype)
                decls.append(f"const {ctype} {name} = *({ctype}*)_args[{k}];")
            keep.append(buf)
            ptrs.append(buf.ctypes.data)
        res = np.empty(out_shape, out_type)
        keep.append(res)
        ptrs.append(res.ctypes.data)
        octype, oname = _CTYPE[out_type.name], self.outs[0][2]
        rtype = self.reduce_type or octype
        body = (f"typedef {_CTYPE[t.name] if t is not None else 'float'} T;\n" + self.preamble
                + f"\n#define REDUCE(a, b) ({self.reduce_expr})\n"
                + f"#define POST_MAP(a) ({self.post_map_expr})\ntypedef {rtype} _type_reduce;\n")
        loop = ("    _type_reduce _s = _type_reduce(" + self.identity + ");\n"
                "    for (long long _r = 0; _r < _n_red; ++_r) {\n      " + "\n      ".join(decls)
                + f"\n      _type_reduce _a = static_cast<_type_reduce>({self.map_expr});\n"
                "      _s = REDUCE(_s, _a);\n    }\n"
                f"    {octype}& {oname} = (({octype}*)_args[{len(self.ins)}])[_o];\n"
                "    POST_MAP(_s);\n")
        source = (_PRELUDE + body + '\nextern "C" void run(long long _n_out, long long _n_red, '
                  "void** _args) {\n  for (long long _o = 0; _o < _n_out; ++_o) {\n" + loop
                  + "  }\n}\n")
        _compile(source).run(ctypes.c_longlong(n_out), ctypes.c_longlong(n_red),
                             (ctypes.c_void_p * len(ptrs))(*ptrs))
        out[...] = res
        # the same reduction as CUDA device code (one thread per output), for nvcc_check()
        DEVICE_SOURCES.setdefault(
            source, body + "\n__global__ void run(long long _n_out, long long _n_red, "
            "void** _args) {\n  long long _o = blockIdx.x * (long long)blockDim.x + threadIdx.x;"
            "\n  if (_o >= _n_out) return;\n" + loop + "}\n")
        return out


_SERIAL_BLOCKS = r"""
struct mpitrain_dim3 { unsigned int x, y, z; };
static mpitrain_dim3 blockIdx, blockDim, threadIdx, gridDim;
extern "C" void mpitrain_set(unsigned int* v) {
    blockIdx = {v[0], v[1], v[2]}; threadIdx = {v[3], v[4], v[5]};
    gridDim = {v[6], v[7], v[8]}; blockDim = {v[9], v[10], v[11]};
}
"""
# Kernels with __syncthreads: a block's threads are host threads (ctypes releases the GIL) that
# meet at a barrier; threadIdx is per thread, the rest per block (blocks run one at a time).
_THREADED_BLOCKS = r"""
#include <pthread.h>
#define __shared__ static
struct mpitrain_dim3 { unsigned int x, y, z; };
static mpitrain_dim3 blockIdx, blockDim, gridDim;
static thread_local mpitrain_dim3 threadIdx;
static pthread_barrier_t mpitrain_barrier;
static bool mpitrain_barrier_made = false;
static inline void __syncthreads() { pthread_barrier_wait(&mpitrain_barrier); }
extern "C" void mpitrain_set(unsigned int* v) {
    blockIdx = {v[0], v[1], v[2]};
    gridDim = {v[6], v[7], v[8]}; blockDim = {v[9], v[10], v[11]};
    if (mpitrain_barrier_made) pthread_barrier_destroy(&mpitrain_barrier);
    pthread_barrier_init(&mpitrain_barrier, nullptr, blockDim.x * blockDim.y * blockDim.z);
    mpitrain_barrier_made = true;
}
extern "C" void mpitrain_set_thread(unsigned int x, unsigned int y, unsigned int z) {
    threadIdx = {x, y, z};
}
"""


class RawKernel:
    def __init__(self, code, name, **_):
        self.name = name
        self.threaded = "__syncthreads" in code
        DEVICE_SOURCES.setdefault(code, code.replace(name, "run"))
        self.lib = _compile(_PRELUDE + (_THREADED_BLOCKS if self.threaded else _SERIAL_BLOCKS)
                            + code)

    def __call__(self, grid, block, args):
        cargs = []
        for a in args:
            if isinstance(a, np.ndarray):
                cargs.append(ctypes.c_void_p(a.ctypes.data))
            else:
                cargs.append(np.ctypeslib.as_ctypes_type(np.asarray(a).dtype)(a))
        fn = getattr(self.lib, self.name)
        grid, block = (tuple(grid) + (1, 1))[:3], (tuple(block) + (1, 1))[:3]
        dims = (ctypes.c_uint * 12)()
        dims[6:12] = grid + block
        for b in np.ndindex(*grid[::-1]):             # (z, y, x): blocks in CUDA's order
            if self.threaded:
                dims[0:3] = b[::-1]
                self.lib.mpitrain_set(dims)
                self._run_block(fn, cargs, block)
                continue
            for t in np.ndindex(*block[::-1]):
                dims[0:6] = b[::-1] + t[::-1]
                self.lib.mpitrain_set(dims)
                fn(*cargs)

    def _run_block(self, fn, cargs, block):
        """Every thread of one block at once (the kernel's barriers need them all)."""
        def thread(t):
            self.lib.mpitrain_set_thread(*(ctypes.c_uint(v) for v in t))
            fn(*cargs)
        threads = [threading.Thread(target=thread, args=(t[::-1],))
                   for t in np.ndindex(*block[::-1])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class _Stream:
    def synchronize(self):
        pass


def module():
    """A module object to put in sys.modules['cupy'] while importing kernels/cuda_cupy/."""
    cp = types.ModuleType("cupy")
    cp.ndarray = np.ndarray
    for fn in ("empty", "zeros", "matmul", "add", "multiply", "minimum", "maximum", "float64",
               "copyto"):
        setattr(cp, fn, getattr(np, fn))
    cp.array = lambda a, copy=True, order="K": np.array(a, copy=copy, order=order)
    cp.asarray = np.asarray
    cp.asnumpy = lambda a: np.array(a, copy=True)
    cp.ElementwiseKernel, cp.RawKernel = ElementwiseKernel, RawKernel
    cp.ReductionKernel = ReductionKernel
    cp.cuda = types.SimpleNamespace(
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1),
        get_current_stream=lambda: _Stream())
    return cp


def load_cuda_cupy():
    """kernels/cuda_cupy/ imported against this module, then taken out of sys.modules and the
    registry package again (what was there before, a real CuPy flavour or none, is put back), so
    the emulated flavour is only this function's result; sys.modules['cupy'] is restored too."""
    import importlib
    import sys
    from mpitrain import kernels
    name = "mpitrain.kernels.cuda_cupy"
    ours = lambda key: key in ("cupy", name) or key.startswith(name + ".")  # noqa: E731
    saved = {key: sys.modules.pop(key) for key in [key for key in sys.modules if ours(key)]}
    attribute = vars(kernels).get("cuda_cupy")
    sys.modules["cupy"] = module()
    try:
        return importlib.import_module(name)
    finally:
        for key in [key for key in sys.modules if ours(key)]:
            del sys.modules[key]
        sys.modules.update(saved)
        if attribute is None:
            vars(kernels).pop("cuda_cupy", None)
        else:
            kernels.cuda_cupy = attribute


def nvcc():
    """Path of nvcc (PATH, $CUDA_HOME/bin, /usr/local/cuda/bin) or None."""
    import shutil
    for cand in (shutil.which("nvcc"), os.path.join(os.environ.get("CUDA_HOME", ""), "bin/nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def nvcc_check(arch="sm_80"):
    """Compile every kernel body seen so far as CUDA device code; (ok, nvcc's messages)."""
    parts = [f"namespace k{n} {{\n{src}\n}}\n" for n, src in enumerate(DEVICE_SOURCES.values())]
    path = os.path.join(_CACHE_DIR, "all_kernels.cu")
    with open(path, "w") as f:
        f.write("\n".join(p.replace('extern "C" ', "") for p in parts))
    res = subprocess.run([nvcc(), "--ptx", f"-arch={arch}", "-o", path + ".ptx", path],
                         capture_output=True, text=True, timeout=240)
    return res.returncode == 0, res.stdout + res.stderr
