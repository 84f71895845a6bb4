"""The Numba flavour's launch set-up, array plumbing (dev, flat, launch, half_safe, scratch of
every module), memory kernels, count_correct (see there) and reduce_into.

Launch shape. Elementwise kernels are 1-D grid-stride loops over the flattened arrays, so one
launch configuration (``TPB`` threads x at most ``MAX_BLOCKS`` blocks) is correct for any size.
The simulator runs every thread as a Python thread, so there the configuration shrinks (2 blocks
of 32 threads; GEMM blocks of 4 x 4 threads with 2 x 2 outputs each); the kernels are the same
code either way, only the launch differs. Under the simulator this module also replaces Numba's
shared-array allocator, whose check-then-set could give two threads of a block two arrays
(``_race_free_sim_shared_arrays``; tests/cudasim/test_sim_shared_memory.py).

Module-level kernels are ``cuda.jit(cache=True)``: on a GPU each rank of each run would otherwise
compile some forty kernels at first use (Numba keeps the PTX/cubin per compute capability in
``__pycache__``, or the user cache when that is read-only); the simulator ignores the flag. The
GEMM factory's per-dtype closures are not cached. Float16 specialisations are never cached:
numba-cuda links CUDA's fp16 library into a kernel that computes in float16, and Numba cannot
pickle a kernel with linked files ("Cannot pickle CUDACodeLibrary with linking files"). The
kernels float16 arrays can reach (``half_safe``) are compiled twice over, disk-cached for the
other dtypes and uncached for float16.
"""
import sys

import numpy as np

if not hasattr(np, "row_stack"):
    # numba-cuda <= 0.30.4 registers an overload for np.row_stack, which NumPy 2.5 removed, when
    # it compiles its first kernel: every launch then fails with AttributeError
    # (NVIDIA/numba-cuda#907, not to be fixed upstream; numba itself has the guard since 0.67).
    # row_stack was an alias of vstack; giving the name back is all the overload needs.
    np.row_stack = np.vstack

from numba import config, cuda, float64  # noqa: E402 - after the NumPy 2.5 shim

from mpitrain.kernels import checks

SIM = bool(config.ENABLE_CUDASIM)
if not SIM and not cuda.is_available():
    raise ImportError("--kernels numba on --device cuda needs a CUDA GPU and driver "
                      "(numba.cuda.is_available() is False); NUMBA_ENABLE_CUDASIM=1 runs the "
                      "simulator instead")

TPB = 32 if SIM else 256          # threads per block of the 1-D kernels (a power of two)
MAX_BLOCKS = 2 if SIM else 2048   # grid-stride loops cover whatever is beyond
if SIM:
    # The simulator runs each GPU thread as a Python thread and busy-polls them at every
    # syncthreads(); a shorter GIL switch interval than the default 5 ms makes those barrier
    # rounds several times faster. Only simulated runs (tests) are affected.
    sys.setswitchinterval(min(sys.getswitchinterval(), 5e-4))


def _race_free_sim_shared_arrays():
    """Make the simulator hand every thread of a launch the same ``cuda.shared.array``.

    Numba's simulator (numba/cuda/simulator/kernelapi.py, FakeCUDAShared.array) keeps a launch's
    shared arrays in a dict keyed by the caller's (file, line) and fills it with check-then-set:
    ``get`` -> None -> ``np.empty`` -> store. Its threads are Python threads, so a GIL switch
    between the ``get`` and the store lets a second thread of the first block miss too and
    allocate its own array; one of the two is orphaned for the whole launch. In the GEMM, that
    thread loads its share of each tile into a private array and reads the rest from
    uninitialised memory, and the others read its share from uninitialised memory of theirs:
    garbage (a weight of -3.76e12 in the flaky CLI test) in the outputs of every tile block 0
    computes. Later blocks (run one after the other) reuse the winning array and are right, so
    the damage shows at a stride of 16 columns (2 simulated blocks x 8-column tiles). Rare (the
    switch must fall within a few bytecodes; likelier on a loaded machine and with the short
    switch interval above) but real. A GPU has no such step: shared memory exists per block
    before its first thread runs, so the kernels themselves are unchanged.

    The replacement looks the caller up with sys._getframe (the original walks the whole stack
    with traceback.extract_stack, slow) and publishes with dict.setdefault, which is atomic under
    the GIL: whoever stores first wins and every thread returns that array. Dynamic shared
    memory (shape 0) is one buffer made before the threads start; it keeps the original path.
    """
    from numba import types
    from numba.np import numpy_support
    try:
        from numba.cuda.simulator import kernelapi
    except ImportError:                  # another simulator layout: nothing known to replace
        return

    fake = getattr(kernelapi, "FakeCUDAShared", None)
    original = getattr(fake, "array", None)
    if original is None or getattr(original, "race_free", False):
        return

    def array(self, shape, dtype):
        if shape == 0:
            return original(self, shape, dtype)
        frame = sys._getframe(1)
        caller = (frame.f_code.co_filename, frame.f_lineno)    # the original's key
        res = self._allocations.get(caller)
        if res is None:
            if isinstance(dtype, types.Type):
                dtype = numpy_support.as_dtype(dtype)
            res = self._allocations.setdefault(caller, np.empty(shape, dtype))
        return res

    array.race_free = True
    fake.array = array


if SIM:
    _race_free_sim_shared_arrays()


# --- Array plumbing -----------------------------------------------------------------------------

def dev(a):
    """A Numba device array for ``a`` (zero-copy for CuPy arrays); refuse host arrays."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    if hasattr(a, "__cuda_array_interface__") and hasattr(cuda, "as_cuda_array"):
        return cuda.as_cuda_array(a)
    raise TypeError(f"cuda-numba kernels need device arrays, got {type(a).__name__}; "
                    "copy host data with kernels.to_device")


def flat(a):
    """1-D view of a C-contiguous device array."""
    a = dev(a)
    return a if a.ndim == 1 else a.reshape(a.size)


def grid(n):
    """(blocks, threads) for a grid-stride loop over n items."""
    return max(1, min((n + TPB - 1) // TPB, MAX_BLOCKS)), TPB


def launch(kernel, n, *args):
    """Run the grid-stride ``kernel(*args)`` over ``n`` items; nothing to launch when n is 0."""
    if n:
        kernel[grid(n)](*args)


def scalar(a, value):
    """``value`` in the array's float dtype, so fp32 kernels do not compute in fp64."""
    return a.dtype.type(value) if a.dtype.kind == "f" else float(value)


_F16 = np.dtype(np.float16)


class half_safe:
    """A kernel that float16 arrays can reach, compiled twice over (see the module docstring):
    ``kernel.pick(*arrays)`` is the dispatcher to launch for those arrays."""

    def __init__(self, fn):
        self.cached = cuda.jit(cache=True)(fn)
        self.uncached = cuda.jit(fn)

    def pick(self, *arrays):
        for a in arrays:
            if a.dtype == _F16:
                return self.uncached
        return self.cached


def empty(shape, dtype=np.float32):
    return cuda.device_array(shape, dtype=np.dtype(dtype))


def zeros(shape, dtype=np.float32):
    a = empty(shape, dtype)
    fill(a, 0)
    return a


def to_device(host):
    if getattr(host, "__cuda_ndarray__", False) or hasattr(host, "__cuda_array_interface__"):
        host = to_host(host)
    return cuda.to_device(np.ascontiguousarray(host))


def to_host(a):
    return dev(a).copy_to_host()


def synchronize():
    cuda.synchronize()


@half_safe
def _fill_k(a, value):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = value


def fill(a, value):
    a = flat(a)
    launch(_fill_k.pick(a), a.size, a, a.dtype.type(value))


@half_safe
def _copy_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[i]


def copy(dst, src):
    dst, src = flat(dst), flat(src)
    checks.same_size("copy", src, dst)
    launch(_copy_k.pick(dst, src), dst.size, dst, src)


# cast is copy with conversion on store (e.g. float32 -> float16 for fp16 compression)
cast = copy


@half_safe
def _scale_k(a, factor):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = a[i] * factor


def scale(a, factor):
    a = flat(a)
    launch(_scale_k.pick(a), a.size, a, scalar(a, factor))


@half_safe
def _add_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] + src[i]


def add(dst, src):
    dst, src = flat(dst), flat(src)
    checks.same_size("add", src, dst)
    launch(_add_k.pick(dst, src), dst.size, dst, src)


_scratch_arrays = {}


def scratch(shape, dtype=np.float64):
    """A device array for a launch's partial sums or constants, cached per (shape, dtype) so that
    steady-state launches allocate nothing (they run in order on one stream)."""
    key = (shape, np.dtype(dtype).str)
    if key not in _scratch_arrays:
        _scratch_arrays[key] = cuda.device_array(shape, dtype=dtype)
    return _scratch_arrays[key]


@cuda.jit(device=True)
def _block_sum(acc, partials):
    """Tree-reduce one float64 per thread into partials[blockIdx.x] (all threads must call)."""
    buf = cuda.shared.array(TPB, float64)
    tid = cuda.threadIdx.x
    buf[tid] = acc
    cuda.syncthreads()
    half = TPB // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partials[cuda.blockIdx.x] = buf[0]


@half_safe
def _total_k(a, partials):
    acc = float64(0.0)
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        acc += float64(a[i])
    _block_sum(acc, partials)


def total(a):
    a = flat(a)
    if a.size == 0:
        return 0.0
    blocks, tpb = grid(a.size)
    partials = scratch(blocks)
    _total_k.pick(a)[blocks, tpb](a, partials)
    return float(partials.copy_to_host().sum())


# count_correct sits beside total: under the simulator a device function (_block_sum) must be in
# its kernel's module (the simulator swaps each module's cuda per call, racing across threads).
@cuda.jit(cache=True)
def _count_correct_k(logits, labels, partials):
    rows, k = logits.shape
    hits = float64(0.0)
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        best = 0
        for j in range(1, k):
            if logits[r, j] > logits[r, best]:      # first maximum wins, like numpy.argmax
                best = j
        if best == labels[r]:
            hits += 1.0
    _block_sum(hits, partials)


def count_correct(logits, labels):
    logits, labels = dev(logits), flat(labels)
    if logits.shape[0] == 0:
        return 0
    blocks, tpb = grid(logits.shape[0])
    partials = scratch(blocks)
    _count_correct_k[blocks, tpb](logits, labels, partials)
    return int(round(partials.copy_to_host().sum()))


# Collective reductions: half_safe like the memory kernels (the fp16 compression reduces float16).

@half_safe
def _reduce_min_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        if src[i] < dst[i]:
            dst[i] = src[i]


@half_safe
def _reduce_max_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        if src[i] > dst[i]:
            dst[i] = src[i]


@half_safe
def _reduce_prod_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] * src[i]


_REDUCE = {"sum": _add_k, "min": _reduce_min_k, "max": _reduce_max_k, "prod": _reduce_prod_k}


def reduce_into(dst, src, op):
    if op not in _REDUCE:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {list(_REDUCE)}")
    dst, src = flat(dst), flat(src)
    checks.same_size("reduce_into", src, dst)
    launch(_REDUCE[op].pick(dst, src), dst.size, dst, src)
