"""CUDA backend, Numba flavour: ``numba.cuda.jit`` kernels for every name of the contract.

Nothing here needs CuPy, so the whole training step (GEMM included) also runs under Numba's CUDA
simulator (``NUMBA_ENABLE_CUDASIM=1``) on a machine without a GPU; that is how CI checks this file.
Arrays are Numba device arrays; CuPy arrays (anything exposing ``__cuda_array_interface__``) are
accepted too and wrapped with ``numba.cuda.as_cuda_array`` (zero copy). Host NumPy arrays are
refused with a TypeError: Numba would silently copy them both ways on every launch, which hides
bugs in the layer code and costs two PCIe transfers per kernel.

Launch shape. Elementwise kernels are 1-D grid-stride loops over the flattened arrays, so one
launch configuration (``_TPB`` threads x at most ``_MAX_BLOCKS`` blocks) is correct for any size.
The simulator runs every thread as a Python thread, so there the configuration shrinks (2 blocks
of 32 threads; GEMM blocks of 4 x 4 threads with 2 x 2 outputs each); the kernels are the same
code either way, only the launch differs. Under the simulator this module also replaces Numba's
shared-array allocator, whose check-then-set could give two threads of a block two arrays
(``_race_free_sim_shared_arrays``; tests/cudasim/test_sim_shared_memory.py).

Module-level kernels, the collective reductions excepted, are ``cuda.jit(cache=True)``: on a
GPU each rank of each run would otherwise compile some forty kernels at first use (Numba keeps
the PTX/cubin per compute capability in ``__pycache__``, or the user cache when that is
read-only); the simulator ignores the flag. The GEMM factory's per-dtype closures are not cached.
Float16 specialisations are never cached: numba-cuda links CUDA's fp16 library into a kernel
that computes in float16, and Numba cannot pickle a kernel with linked files ("Cannot pickle
CUDACodeLibrary with linking files"). The kernels float16 arrays can reach (``_half_safe``) are
compiled twice over, disk-cached for the other dtypes and uncached for float16.

Reductions (``total``, ``count_correct``) are deterministic: every block reduces its part in shared
memory into one float64 partial, and the few partials are summed on the host in block order.
BatchNorm's per-channel sums stay on the device: block partials per (chunk, channel), then a
second kernel adds each channel's chunks in order (``_channel_sums``). The GEMM is a tiled
shared-memory kernel with register blocking (16 x 16 threads, each computing 4 x 4 outputs of
a 64 x 64 tile; op(a) and op(b) staged through shared memory in K-stages of 16,
loaded with consecutive threads on each operand's contiguous axis so global reads coalesce
whatever the transposes). Where the output has too few tiles to fill the GPU and K is long (a
convolution's weight gradient), K is split: each split writes its partial tile to a scratch
(S, M, N), and a second kernel adds the partials in split order (``_gemm_splits``).
"""
import functools
import math
import sys

import numpy as np

if not hasattr(np, "row_stack"):
    # numba-cuda <= 0.30.4 registers an overload for np.row_stack, which NumPy 2.5 removed, when
    # it compiles its first kernel: every launch then fails with AttributeError
    # (NVIDIA/numba-cuda#907, not to be fixed upstream; numba itself has the guard since 0.67).
    # row_stack was an alias of vstack; giving the name back is all the overload needs.
    np.row_stack = np.vstack

from numba import config, cuda, float64, from_dtype  # noqa: E402 - after the NumPy 2.5 shim

from mpitrain.kernels import dropout_hash, host_shape, norm_shape

name = "cuda-numba"

_SIM = bool(config.ENABLE_CUDASIM)
if not _SIM and not cuda.is_available():
    raise ImportError("--kernels numba on --device cuda needs a CUDA GPU and driver "
                      "(numba.cuda.is_available() is False); NUMBA_ENABLE_CUDASIM=1 runs the "
                      "simulator instead")

_TPB = 32 if _SIM else 256          # threads per block of the 1-D kernels (a power of two)
_MAX_BLOCKS = 2 if _SIM else 2048   # grid-stride loops cover whatever is beyond
_TILE = 4 if _SIM else 16           # GEMM threads per block edge (_TILE**2 threads)
_MICRO = 2 if _SIM else 4           # GEMM outputs per thread edge: block tile _TILE * _MICRO
_MAX_GEMM_BLOCKS = 2 if _SIM else 2**31 - 1
if _SIM:
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


if _SIM:
    _race_free_sim_shared_arrays()


# --- Array plumbing -----------------------------------------------------------------------------

def _dev(a):
    """A Numba device array for ``a`` (zero-copy for CuPy arrays); refuse host arrays."""
    if getattr(a, "__cuda_ndarray__", False):
        return a
    if hasattr(a, "__cuda_array_interface__") and hasattr(cuda, "as_cuda_array"):
        return cuda.as_cuda_array(a)
    raise TypeError(f"cuda-numba kernels need device arrays, got {type(a).__name__}; "
                    "copy host data with kernels.to_device")


def _flat(a):
    """1-D view of a C-contiguous device array."""
    a = _dev(a)
    return a if a.ndim == 1 else a.reshape(a.size)


def _grid(n):
    """(blocks, threads) for a grid-stride loop over n items."""
    return max(1, min((n + _TPB - 1) // _TPB, _MAX_BLOCKS)), _TPB


def _launch(kernel, n, *args):
    """Run the grid-stride ``kernel(*args)`` over ``n`` items; nothing to launch when n is 0."""
    if n:
        kernel[_grid(n)](*args)


def _scalar(a, value):
    """``value`` in the array's float dtype, so fp32 kernels do not compute in fp64."""
    return a.dtype.type(value) if a.dtype.kind == "f" else float(value)


_F16 = np.dtype(np.float16)


class _half_safe:
    """A kernel that float16 arrays can reach, compiled twice over: ``cuda.jit(cache=True)`` for
    every other dtype and uncached for float16 (see the module docstring: a float16 kernel
    links CUDA's fp16 library, and Numba cannot save such a kernel to its disk cache).
    ``kernel.pick(*arrays)`` is the dispatcher to launch for those arrays."""

    def __init__(self, fn):
        self.cached = cuda.jit(cache=True)(fn)
        self.uncached = cuda.jit(fn)

    def pick(self, *arrays):
        for a in arrays:
            if a.dtype == _F16:
                return self.uncached
        return self.cached


# --- Memory -------------------------------------------------------------------------------------

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
    return _dev(a).copy_to_host()


def synchronize():
    cuda.synchronize()


@_half_safe
def _fill_k(a, value):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = value


def fill(a, value):
    a = _flat(a)
    _launch(_fill_k.pick(a), a.size, a, a.dtype.type(value))


@_half_safe
def _copy_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = src[i]


def copy(dst, src):
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("copy", src, dst)
    _launch(_copy_k.pick(dst, src), dst.size, dst, src)


# cast is copy with conversion on store (e.g. float32 -> float16 for fp16 compression)
cast = copy


@_half_safe
def _scale_k(a, factor):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        a[i] = a[i] * factor


def scale(a, factor):
    a = _flat(a)
    _launch(_scale_k.pick(a), a.size, a, _scalar(a, factor))


@_half_safe
def _add_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] + src[i]


def add(dst, src):
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("add", src, dst)
    _launch(_add_k.pick(dst, src), dst.size, dst, src)


_scratch_arrays = {}


def _scratch(shape, dtype=np.float64):
    """A device array for a launch's partial sums or constants, cached per (shape, dtype) so that
    steady-state launches allocate nothing (they run in order on one stream)."""
    key = (shape, np.dtype(dtype).str)
    if key not in _scratch_arrays:
        _scratch_arrays[key] = cuda.device_array(shape, dtype=dtype)
    return _scratch_arrays[key]


@cuda.jit(device=True)
def _block_sum(acc, partials):
    """Tree-reduce one float64 per thread into partials[blockIdx.x] (all threads must call)."""
    buf = cuda.shared.array(_TPB, float64)
    tid = cuda.threadIdx.x
    buf[tid] = acc
    cuda.syncthreads()
    half = _TPB // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partials[cuda.blockIdx.x] = buf[0]


@_half_safe
def _total_k(a, partials):
    acc = float64(0.0)
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        acc += float64(a[i])
    _block_sum(acc, partials)


def total(a):
    a = _flat(a)
    if a.size == 0:
        return 0.0
    blocks, tpb = _grid(a.size)
    partials = _scratch(blocks)
    _total_k.pick(a)[blocks, tpb](a, partials)
    return float(partials.copy_to_host().sum())


# --- GEMM ---------------------------------------------------------------------------------------

# Split K. A convolution's weight gradient has a small output (C_out x C*kh*kw, one to a few
# dozen 64 x 64 tiles) and a long K (N*OH*OW, 50,000 and more): with one block per tile most
# multiprocessors idle while each block walks all of K. When the tiles are fewer than the blocks
# that fill the GPU (two per multiprocessor), K is cut into S splits of at least
# _SPLIT_MIN_STAGES K-stages each (a split's partial tile costs a store and a load, which enough
# of K amortises): S = min(ceil(wanted / tiles), stages // _SPLIT_MIN_STAGES). Split s stores its
# tile in a scratch (S, M, N); _gemm_sum_k then adds each output's S partials in split order.
# Deterministic: every sum has a fixed order, whatever the grid.
_SPLIT_MIN_STAGES = 2 if _SIM else 16


@functools.cache
def _gemm_blocks_wanted():
    """Blocks that fill the GPU: two per multiprocessor (an H100's 132 in the simulator)."""
    return 2 * (132 if _SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _gemm_splits(tiles, kdim):
    """The number of K splits for ``tiles`` output tiles and K = ``kdim`` (1: K is not split).
    Split s covers the K-stages [s * per, (s + 1) * per), per = ceil(stages / S); S is the
    fewest splits of that length, so none is empty."""
    stages = (kdim + _TILE - 1) // _TILE
    wanted = _gemm_blocks_wanted()
    if tiles >= wanted or stages < 2 * _SPLIT_MIN_STAGES:
        return 1
    splits = min((wanted + tiles - 1) // tiles, stages // _SPLIT_MIN_STAGES)
    per = (stages + splits - 1) // splits
    return (stages + per - 1) // per


@functools.cache
def _make_gemm(dtype, split):
    """Tiled shared-memory GEMM for one dtype (shared arrays need the dtype at compile time;
    one kernel per dtype and ``split``, made at its first use).

    A block of _TILE x _TILE threads computes a _BM x _BM output tile (_BM = _TILE * _MICRO):
    each thread accumulates _MICRO x _MICRO outputs in registers, rows ty + p*_TILE and columns
    tx + q*_TILE, so one value read from shared memory feeds _MICRO multiply-adds. K advances in
    stages of _TILE: every thread loads _MICRO elements of op(a) and of op(b), with consecutive
    threads on the operand's contiguous axis (coalesced for either transpose).

    With ``split``, ``out`` is the scratch (S, M, N): the blocks walk (split, tile) pairs, and
    split s stores the product over its K-stages (``_gemm_splits``) in out[s].
    """
    nbt = from_dtype(np.dtype(dtype))
    tt, micro, bm = _TILE, _MICRO, _TILE * _MICRO       # compile-time constants (closure)
    bk = _TILE
    bk_pad, bm_pad = bk + 1, bm + 1                     # +1: no shared-memory bank conflicts

    if split:
        @cuda.jit(device=True)
        def store(out, s, r, c, v, accumulate):
            out[s, r, c] = v
    else:
        @cuda.jit(device=True)
        def store(out, s, r, c, v, accumulate):
            if accumulate:
                out[r, c] += v
            else:
                out[r, c] = v

    @cuda.jit
    def gemm_k(a, b, out, trans_a, trans_b, accumulate):
        # out (M, N) (=|+=) op(a) (M, K) @ op(b) (K, N); block b computes the (split, tile)
        # pairs b, b + gridDim.x, ... (one per block on a GPU; few blocks under the simulator)
        sa = cuda.shared.array((bm, bk_pad), nbt)       # sa[i, k] = op(a)[row0 + i, k0 + k]
        sb = cuda.shared.array((bk, bm_pad), nbt)       # sb[k, j] = op(b)[k0 + k, col0 + j]
        acc = cuda.local.array((micro, micro), nbt)
        m, n = out.shape[-2], out.shape[-1]
        splits = out.shape[0] if split else 1
        kdim = a.shape[0] if trans_a else a.shape[1]
        kchunk = (((kdim + bk - 1) // bk + splits - 1) // splits) * bk
        tiles_n = (n + bm - 1) // bm
        tiles = ((m + bm - 1) // bm) * tiles_n
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * tt + tx
        for st in range(cuda.blockIdx.x, tiles * splits, cuda.gridDim.x):
            s = st // tiles
            t = st - s * tiles
            row0 = (t // tiles_n) * bm
            col0 = (t % tiles_n) * bm
            k_begin = s * kchunk
            k_end = k_begin + kchunk
            if k_end > kdim:            # not min(): see _bn_stats_k
                k_end = kdim
            for p in range(micro):
                for q in range(micro):
                    acc[p, q] = 0
            for k0 in range(k_begin, k_end, bk):
                for e in range(micro):                  # bm * bk = micro * tt**2 elements
                    idx = e * tt * tt + tid
                    if trans_a:                         # a (K, M): i is contiguous
                        i = idx % bm
                        kk = idx // bm
                        r = row0 + i
                        kg = k0 + kk
                        sa[i, kk] = a[kg, r] if (r < m and kg < k_end) else nbt(0)
                    else:                               # a (M, K): k is contiguous
                        kk = idx % bk
                        i = idx // bk
                        r = row0 + i
                        kg = k0 + kk
                        sa[i, kk] = a[r, kg] if (r < m and kg < k_end) else nbt(0)
                    if trans_b:                         # b (N, K): k is contiguous
                        kk = idx % bk
                        j = idx // bk
                        c = col0 + j
                        kg = k0 + kk
                        sb[kk, j] = b[c, kg] if (c < n and kg < k_end) else nbt(0)
                    else:                               # b (K, N): j is contiguous
                        j = idx % bm
                        kk = idx // bm
                        c = col0 + j
                        kg = k0 + kk
                        sb[kk, j] = b[kg, c] if (c < n and kg < k_end) else nbt(0)
                cuda.syncthreads()
                for kk in range(bk):
                    for p in range(micro):
                        av = sa[ty + p * tt, kk]
                        for q in range(micro):
                            acc[p, q] += av * sb[kk, tx + q * tt]
                cuda.syncthreads()
            for p in range(micro):
                r = row0 + ty + p * tt
                for q in range(micro):
                    c = col0 + tx + q * tt
                    if r < m and c < n:
                        store(out, s, r, c, acc[p, q], accumulate)

    return gemm_k


@cuda.jit(cache=True)
def _gemm_sum_k(part, out, accumulate):
    # out (M, N) (=|+=) the sum of part (S, M, N) over S, added in split order
    splits, m, n = part.shape
    for i in range(cuda.grid(1), m * n, cuda.gridsize(1)):
        r = i // n
        c = i - r * n
        acc = part[0, r, c]
        for s in range(1, splits):
            acc += part[s, r, c]
        if accumulate:
            out[r, c] += acc
        else:
            out[r, c] = acc


def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
    a, b, out = _dev(a), _dev(b), _dev(out)
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm needs 2-D arrays, got {a.shape}, {b.shape}, {out.shape}")
    m, ka = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if ka != kb or out.shape != (m, n):
        raise ValueError(f"gemm shapes do not match: op(a) {(m, ka)} @ op(b) {(kb, n)} "
                         f"-> out {out.shape}")
    if m == 0 or n == 0:
        return
    bm = _TILE * _MICRO
    tiles = ((m + bm - 1) // bm) * ((n + bm - 1) // bm)
    splits = _gemm_splits(tiles, ka)
    if splits == 1:
        _make_gemm(out.dtype, False)[min(tiles, _MAX_GEMM_BLOCKS), (_TILE, _TILE)](
            a, b, out, bool(trans_a), bool(trans_b), bool(accumulate))
        return
    part = _scratch((splits, m, n), out.dtype)
    _make_gemm(out.dtype, True)[min(tiles * splits, _MAX_GEMM_BLOCKS), (_TILE, _TILE)](
        a, b, part, bool(trans_a), bool(trans_b), False)
    _gemm_sum_k[_grid(m * n)](part, out, bool(accumulate))


# --- Dense layers -------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _bias_act_k(y, bias, relu):
    f = bias.size
    zero = y.dtype.type(0)          # a Python 0 would make v a float64
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        v = y[i] + bias[i % f]
        if relu and v < zero:
            v = zero
        y[i] = v


def bias_act(y, bias, relu):
    y2, bias = _dev(y), _flat(bias)
    host_shape.bias("bias_act", y2, bias, ("y", "bias"))
    _launch(_bias_act_k, y2.size, _flat(y2), bias, bool(relu))


@cuda.jit(cache=True)
def _relu_k(x, out):
    zero = x.dtype.type(0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        out[i] = v if v > zero else zero


def relu(x, out):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("relu", x, out)
    _launch(_relu_k, x.size, x, out)


@cuda.jit(cache=True)
def _relu_backward_k(y, grad_out, grad_in):
    zero = grad_out.dtype.type(0)
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        grad_in[i] = grad_out[i] if y[i] > zero else zero


def relu_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("relu_backward", y, grad_out, grad_in)
    _launch(_relu_backward_k, y.size, y, grad_out, grad_in)


# bias_grad sums a tall (rows, F) matrix by column: a conv layer's gradient has N*OH*OW rows
# (200k for LeNet at batch 256) and only C columns, so one thread per column would leave the GPU
# idle. Two passes instead: every (chunk of _BIAS_ROWS rows, column) pair is one thread writing a
# partial sum, then one thread per column adds its partials in chunk order (deterministic).
_BIAS_ROWS = 8 if _SIM else 256


@cuda.jit(cache=True)
def _bias_partials_k(grad_out, partials, rows_per_chunk):
    rows, feats = grad_out.shape
    chunks = partials.shape[0]
    for i in range(cuda.grid(1), chunks * feats, cuda.gridsize(1)):
        chunk = i // feats
        f = i - chunk * feats                    # neighbouring threads: neighbouring columns
        acc = grad_out.dtype.type(0)
        end = (chunk + 1) * rows_per_chunk
        if end > rows:
            end = rows
        for r in range(chunk * rows_per_chunk, end):
            acc += grad_out[r, f]
        partials[chunk, f] = acc


@cuda.jit(cache=True)
def _bias_sum_k(partials, grad_bias):
    for f in range(cuda.grid(1), grad_bias.size, cuda.gridsize(1)):
        acc = grad_bias.dtype.type(0)
        for chunk in range(partials.shape[0]):
            acc += partials[chunk, f]
        grad_bias[f] += acc


def bias_grad(grad_out, grad_bias):
    grad_out, grad_bias = _dev(grad_out), _flat(grad_bias)
    host_shape.bias("bias_grad", grad_out, grad_bias, ("grad_out", "grad_bias"))
    rows, feats = grad_out.shape
    if feats == 0 or rows == 0:
        return
    chunks = (rows + _BIAS_ROWS - 1) // _BIAS_ROWS
    partials = _scratch((chunks, feats), grad_bias.dtype)
    _bias_partials_k[_grid(chunks * feats)](grad_out, partials, _BIAS_ROWS)
    _bias_sum_k[_grid(feats)](partials, grad_bias)


# --- Activations and softmax --------------------------------------------------------------------
# Constants arrive as scalars of the array's dtype (``one``) or are made from it in the kernel
# (``x.dtype.type(0)``), so float32 work stays in float32: a Python literal (0, 1.0) is an
# int64 or float64 to Numba and would promote the arithmetic around it to float64.

@cuda.jit(cache=True)
def _tanh_k(x, out):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        out[i] = math.tanh(x[i])


@cuda.jit(cache=True)
def _tanh_backward_k(y, grad_out, grad_in, one):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        grad_in[i] = grad_out[i] * (one - y[i] * y[i])


@cuda.jit(cache=True)
def _sigmoid_k(x, out, one):
    # exp of a non-positive number only: no overflow for large |x|
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        if v >= 0:
            out[i] = one / (one + math.exp(-v))
        else:
            e = math.exp(v)
            out[i] = e / (one + e)


@cuda.jit(cache=True)
def _sigmoid_backward_k(y, grad_out, grad_in, one):
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        grad_in[i] = grad_out[i] * y[i] * (one - y[i])


@cuda.jit(cache=True)
def _leaky_relu_k(x, out, negative_slope):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        out[i] = v if v > 0 else v * negative_slope


@cuda.jit(cache=True)
def _leaky_relu_backward_k(x, grad_out, grad_in, negative_slope):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        grad_in[i] = grad_out[i] if x[i] > 0 else grad_out[i] * negative_slope


def tanh(x, out):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("tanh", x, out)
    _launch(_tanh_k, x.size, x, out)


def tanh_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("tanh_backward", y, grad_out, grad_in)
    _launch(_tanh_backward_k, y.size, y, grad_out, grad_in, _scalar(y, 1))


def sigmoid(x, out):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("sigmoid", x, out)
    _launch(_sigmoid_k, x.size, x, out, _scalar(out, 1))


def sigmoid_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _flat(y), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("sigmoid_backward", y, grad_out, grad_in)
    _launch(_sigmoid_backward_k, y.size, y, grad_out, grad_in, _scalar(y, 1))


def leaky_relu(x, out, negative_slope):
    x, out = _flat(x), _flat(out)
    host_shape.same_size("leaky_relu", x, out)
    _launch(_leaky_relu_k, x.size, x, out, _scalar(x, negative_slope))


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    x, grad_out, grad_in = _flat(x), _flat(grad_out), _flat(grad_in)
    host_shape.same_size("leaky_relu_backward", x, grad_out, grad_in)
    _launch(_leaky_relu_backward_k, x.size, x, grad_out, grad_in,
            _scalar(grad_out, negative_slope))


@cuda.jit(cache=True)
def _softmax_k(x, y, one):
    # one thread per row of x (R, K), like the cross-entropy; the sum in float64
    rows, k = x.shape
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        top = x[r, 0]
        for j in range(1, k):
            if x[r, j] > top:
                top = x[r, j]
        s = float64(0.0)
        for j in range(k):
            e = math.exp(x[r, j] - top)
            y[r, j] = e
            s += e
        inv = one / s
        for j in range(k):
            y[r, j] = y[r, j] * inv


@cuda.jit(cache=True)
def _softmax_backward_k(y, grad_out, grad_in):
    rows, k = y.shape
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        dot = float64(0.0)
        for j in range(k):
            dot += float64(grad_out[r, j]) * float64(y[r, j])
        for j in range(k):
            grad_in[r, j] = y[r, j] * (grad_out[r, j] - dot)


def _rows(a, r, k):
    """(R, K) view of a C-contiguous (..., K) device array."""
    return _flat(a).reshape(r, k)


def softmax(x, y):
    x, y = _dev(x), _dev(y)
    r, k = host_shape.rows("softmax", x.shape, y)
    if r and k:
        _launch(_softmax_k, r, _rows(x, r, k), _rows(y, r, k), _scalar(y, 1))


def softmax_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = _dev(y), _dev(grad_out), _dev(grad_in)
    r, k = host_shape.rows("softmax_backward", y.shape, grad_out, grad_in)
    if r and k:
        _launch(_softmax_backward_k, r, _rows(y, r, k), _rows(grad_out, r, k),
                _rows(grad_in, r, k))


# --- Loss ---------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _softmax_xent_k(logits, labels, grad, losses):
    rows, k = logits.shape
    inv_rows = 1.0 / rows
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        top = logits[r, 0]
        for j in range(1, k):
            if logits[r, j] > top:
                top = logits[r, j]
        s = 0.0
        for j in range(k):
            s += math.exp(logits[r, j] - top)
        label = labels[r]
        losses[r] = top + math.log(s) - logits[r, label]
        for j in range(k):
            p = math.exp(logits[r, j] - top) / s
            if j == label:
                p -= 1.0
            grad[r, j] = p * inv_rows


def softmax_xent(logits, labels, grad, losses):
    logits, labels, grad, losses = _dev(logits), _flat(labels), _dev(grad), _flat(losses)
    if logits.ndim != 2 or labels.size != logits.shape[0] or grad.shape != logits.shape:
        raise ValueError(f"softmax_xent: logits {logits.shape}, labels ({labels.size},), "
                         f"grad {grad.shape} do not match")
    _launch(_softmax_xent_k, logits.shape[0], logits, labels, grad, losses)


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
    logits, labels = _dev(logits), _flat(labels)
    if logits.shape[0] == 0:
        return 0
    blocks, tpb = _grid(logits.shape[0])
    partials = _scratch(blocks)
    _count_correct_k[blocks, tpb](logits, labels, partials)
    return int(round(partials.copy_to_host().sum()))


@cuda.jit(cache=True)
def _label_smoothing_k(logits, labels, grad, losses, smoothing):
    rows, k = logits.shape
    inv_rows = 1.0 / rows
    off = smoothing * inv_rows / k
    for r in range(cuda.grid(1), rows, cuda.gridsize(1)):
        s = float64(0.0)
        for j in range(k):
            s += logits[r, j]
            grad[r, j] -= off
        label = labels[r]
        losses[r] += smoothing * (logits[r, label] - s / k)
        grad[r, label] += smoothing * inv_rows


def label_smoothing(logits, labels, grad, losses, smoothing):
    logits, labels, grad, losses = _dev(logits), _dev(labels), _dev(grad), _dev(losses)
    host_shape.xent("label_smoothing", logits, labels, grad, losses)
    if smoothing != 0:
        _launch(_label_smoothing_k, logits.shape[0], logits, labels, grad, losses,
                float(smoothing))


@cuda.jit(cache=True)
def _mse_k(x, target, grad, losses, scale):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        d = x[i] - target[i]
        losses[i] = d * d
        grad[i] = d * scale


@cuda.jit(cache=True)
def _bce_logits_k(x, target, grad, losses, inv_n, zero, one):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        t = target[i]
        e = math.exp(-abs(v))                       # <= 1: no overflow for any logit
        losses[i] = (v if v > 0 else zero) - v * t + math.log1p(e)
        p = one / (one + e) if v >= 0 else e / (one + e)
        grad[i] = (p - t) * inv_n


def mse(x, target, grad, losses):
    x, target, grad, losses = _flat(x), _flat(target), _flat(grad), _flat(losses)
    host_shape.same_size("mse", x, target, grad, losses)
    if x.size:
        _launch(_mse_k, x.size, x, target, grad, losses, _scalar(x, 2.0 / x.size))


def bce_logits(x, target, grad, losses):
    x, target, grad, losses = _flat(x), _flat(target), _flat(grad), _flat(losses)
    host_shape.same_size("bce_logits", x, target, grad, losses)
    if x.size:
        _launch(_bce_logits_k, x.size, x, target, grad, losses, _scalar(x, 1.0 / x.size),
                _scalar(x, 0), _scalar(x, 1))


# --- Convolution --------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _im2col_k(x, cols, kh, kw, stride, pad, oh_n, ow_n):
    n_, c_n, h_n, w_n = x.shape
    ck = cols.shape[1]
    total_ = cols.shape[0] * ck
    for i in range(cuda.grid(1), total_, cuda.gridsize(1)):
        row = i // ck
        col = i - row * ck
        n = row // (oh_n * ow_n)
        rem = row - n * (oh_n * ow_n)
        oh = rem // ow_n
        ow = rem - oh * ow_n
        c = col // (kh * kw)
        rem = col - c * (kh * kw)
        ki = rem // kw
        kj = rem - ki * kw
        h = oh * stride - pad + ki
        w = ow * stride - pad + kj
        if 0 <= h < h_n and 0 <= w < w_n:
            cols[row, col] = x[n, c, h, w]
        else:
            cols[row, col] = 0


def im2col(x, cols, kh, kw, stride, pad):
    x, cols = _dev(x), _dev(cols)
    *_, oh, ow = host_shape.dims("im2col", x.shape, cols.shape, kh, kw, stride, pad)
    _launch(_im2col_k, cols.size, x, cols, kh, kw, stride, pad, oh, ow)


@cuda.jit(cache=True)
def _col2im_k(cols, dx, kh, kw, stride, pad, oh_n, ow_n, zero):
    # gather (one thread per input pixel) instead of scatter: no atomics, deterministic sums;
    # zero: dx's dtype (dx[...] * 0 would be NaN where dx is NaN, and dx is an output)
    n_n, c_n, h_n, w_n = dx.shape
    for i in range(cuda.grid(1), dx.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        acc = zero
        for ki in range(kh):
            th = h + pad - ki
            if th < 0 or th % stride != 0:
                continue
            oh = th // stride
            if oh >= oh_n:
                continue
            for kj in range(kw):
                tw = w + pad - kj
                if tw < 0 or tw % stride != 0:
                    continue
                ow = tw // stride
                if ow >= ow_n:
                    continue
                acc += cols[(n * oh_n + oh) * ow_n + ow, (c * kh + ki) * kw + kj]
        dx[n, c, h, w] = acc


def col2im(cols, dx, kh, kw, stride, pad):
    cols, dx = _dev(cols), _dev(dx)
    *_, oh, ow = host_shape.dims("col2im", dx.shape, cols.shape, kh, kw, stride, pad)
    _launch(_col2im_k, dx.size, cols, dx, kh, kw, stride, pad, oh, ow, _scalar(dx, 0))


@cuda.jit(cache=True)
def _nhwc_to_nchw_k(src, dst):
    n_n, c_n, h_n, w_n = dst.shape
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        dst[n, c, h, w] = src[(n * h_n + h) * w_n + w, c]


@cuda.jit(cache=True)
def _nchw_to_nhwc_k(src, dst):
    n_n, c_n, h_n, w_n = src.shape
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        c = i % c_n
        pix = i // c_n
        w = pix % w_n
        h = (pix // w_n) % h_n
        n = pix // (w_n * h_n)
        dst[pix, c] = src[n, c, h, w]


def nhwc_to_nchw(src, dst):
    src, dst = _dev(src), _dev(dst)
    host_shape.layout("nhwc_to_nchw", dst.shape, src, "src")
    _launch(_nhwc_to_nchw_k, dst.size, src, dst)


def nchw_to_nhwc(src, dst):
    src, dst = _dev(src), _dev(dst)
    host_shape.layout("nchw_to_nhwc", src.shape, dst, "dst")
    _launch(_nchw_to_nhwc_k, dst.size, src, dst)


# --- Pooling and dropout ------------------------------------------------------------------------

@cuda.jit(cache=True)
def _maxpool_forward_k(x, y, argmax, k, stride):
    n_n, c_n, h_n, w_n = x.shape
    oh_n, ow_n = y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c = (i // (ow_n * oh_n)) % c_n
        n = i // (ow_n * oh_n * c_n)
        h0 = oh * stride
        w0 = ow * stride
        best = x[n, c, h0, w0]
        where = h0 * w_n + w0
        for h in range(h0, h0 + k):
            for w in range(w0, w0 + k):
                v = x[n, c, h, w]
                if v > best:                          # first maximum wins (row-major)
                    best = v
                    where = h * w_n + w
        y[n, c, oh, ow] = best
        argmax[n, c, oh, ow] = where


def maxpool_forward(x, y, argmax, k, stride):
    x, y, argmax = _dev(x), _dev(y), _dev(argmax)
    n, c, h, w = x.shape
    expect = (n, c, (h - k) // stride + 1, (w - k) // stride + 1)
    if y.shape != expect or argmax.shape != expect:
        raise ValueError(f"maxpool_forward: y {y.shape} / argmax {argmax.shape} != {expect}")
    _launch(_maxpool_forward_k, y.size, x, y, argmax, k, stride)


@cuda.jit(cache=True)
def _maxpool_backward_k(grad_y, argmax, grad_x, hw_in, hw_out):
    # windows may overlap (stride < k), so routed gradients are added atomically
    for i in range(cuda.grid(1), grad_y.size, cuda.gridsize(1)):
        plane = i // hw_out
        cuda.atomic.add(grad_x, plane * hw_in + argmax[i], grad_y[i])


def maxpool_backward(grad_y, argmax, grad_x):
    grad_y, argmax, grad_x = _dev(grad_y), _dev(argmax), _dev(grad_x)
    if grad_y.shape != argmax.shape or grad_y.shape[:2] != grad_x.shape[:2]:
        raise ValueError(f"maxpool_backward: grad_y {grad_y.shape}, argmax {argmax.shape}, "
                         f"grad_x {grad_x.shape} do not match")
    fill(grad_x, 0)
    if grad_y.size:
        hw_in = grad_x.shape[2] * grad_x.shape[3]
        hw_out = grad_y.shape[2] * grad_y.shape[3]
        _maxpool_backward_k[_grid(grad_y.size)](_flat(grad_y), _flat(argmax), _flat(grad_x),
                                                 hw_in, hw_out)


@cuda.jit(cache=True)
def _avgpool_forward_k(x, y, k, stride):
    # gather over y (N, C, OH, OW), summed in float64
    c_n = x.shape[1]
    oh_n, ow_n = y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c = (i // (ow_n * oh_n)) % c_n
        n = i // (ow_n * oh_n * c_n)
        s = float64(0.0)
        for ki in range(k):
            for kj in range(k):
                s += x[n, c, oh * stride + ki, ow * stride + kj]
        y[n, c, oh, ow] = s / (k * k)


@cuda.jit(cache=True)
def _avgpool_backward_k(grad_y, grad_x, k, stride):
    # gather over grad_x (N, C, H, W): the windows oh with oh*stride <= h < oh*stride + k
    c_n, h_n, w_n = grad_x.shape[1], grad_x.shape[2], grad_x.shape[3]
    oh_n, ow_n = grad_y.shape[2], grad_y.shape[3]
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        i_lo = h - k + 1
        i_lo = 0 if i_lo <= 0 else (i_lo + stride - 1) // stride
        i_hi = h // stride
        if i_hi > oh_n - 1:
            i_hi = oh_n - 1
        j_lo = w - k + 1
        j_lo = 0 if j_lo <= 0 else (j_lo + stride - 1) // stride
        j_hi = w // stride
        if j_hi > ow_n - 1:
            j_hi = ow_n - 1
        s = float64(0.0)
        for a in range(i_lo, i_hi + 1):
            for b in range(j_lo, j_hi + 1):
                s += grad_y[n, c, a, b]
        grad_x[n, c, h, w] = s / (k * k)


def avgpool_forward(x, y, k, stride):
    x, y = _dev(x), _dev(y)
    host_shape.pool("avgpool_forward", x.shape, y.shape, k, stride)
    _launch(_avgpool_forward_k, y.size, x, y, int(k), int(stride))


def avgpool_backward(grad_y, grad_x, k, stride):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    host_shape.pool("avgpool_backward", grad_x.shape, grad_y.shape, k, stride)
    _launch(_avgpool_backward_k, grad_x.size, grad_y, grad_x, int(k), int(stride))


_MASK32 = np.uint64(0xFFFFFFFF)


@cuda.jit(device=True)
def _mix32(x):
    """lowbias32 (the contract's exact dropout hash), on a uint64 holding a uint32."""
    x = x & _MASK32
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x7FEB352D)) & _MASK32
    x = x ^ (x >> np.uint64(15))
    x = (x * np.uint64(0x846CA68B)) & _MASK32
    return x ^ (x >> np.uint64(16))


@cuda.jit(cache=True)
def _dropout_forward_k(x, y, mask, threshold, keep_scale, seed_hash):
    zero = mask.dtype.type(0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        h = _mix32(_mix32(np.uint64(i)) ^ seed_hash)
        m = keep_scale if (h >> np.uint64(8)) >= threshold else zero
        mask[i] = m
        y[i] = x[i] * m


def dropout_forward(x, y, mask, p, seed):
    x, y, mask = _flat(x), _flat(y), _flat(mask)
    host_shape.same_size("dropout_forward", x, y, mask)
    threshold = np.uint64(dropout_hash.keep_threshold(p))
    seed_hash = np.uint64(dropout_hash.mix32(int(seed)))
    _launch(_dropout_forward_k, x.size, x, y, mask, threshold, _scalar(mask, 1.0 / (1.0 - p)),
            seed_hash)


@_half_safe
def _mul_k(a, b, out):
    for i in range(cuda.grid(1), a.size, cuda.gridsize(1)):
        out[i] = a[i] * b[i]


def dropout_backward(grad_y, mask, grad_x):
    grad_y, mask, grad_x = _flat(grad_y), _flat(mask), _flat(grad_x)
    host_shape.same_size("dropout_backward", grad_y, mask, grad_x)
    _launch(_mul_k.pick(grad_y, mask, grad_x), grad_y.size, grad_y, mask, grad_x)


# --- Optimizer updates --------------------------------------------------------------------------

@_half_safe
def _sgd_k(param, grad, buf, lr, momentum, nesterov, weight_decay):
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        g = grad[i] + weight_decay * param[i]
        if momentum != 0:
            b = momentum * buf[i] + g
            buf[i] = b
            g = g + momentum * b if nesterov else b
        param[i] = param[i] - lr * g


def sgd_update(param, grad, buf, lr, momentum, nesterov, weight_decay):
    # buf is unused (and may be None) without momentum
    param, grad = _flat(param), _flat(grad)
    buf = _flat(buf) if momentum != 0 else param
    host_shape.same_size("sgd_update", param, grad, buf)
    s = lambda v: _scalar(param, v)  # noqa: E731
    _launch(_sgd_k.pick(param, grad, buf), param.size, param, grad, buf, s(lr), s(momentum),
            bool(nesterov), s(weight_decay))


@_half_safe
def _adam_k(param, grad, m, v, step_size, beta1, beta2, eps, weight_decay, inv_sqrt_bc2):
    one = param.dtype.type(1)
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        g = grad[i] + weight_decay * param[i]
        mi = beta1 * m[i] + (one - beta1) * g
        vi = beta2 * v[i] + (one - beta2) * g * g
        m[i] = mi
        v[i] = vi
        param[i] = param[i] - step_size * mi / (math.sqrt(vi) * inv_sqrt_bc2 + eps)


def adam_update(param, grad, m, v, lr, beta1, beta2, eps, weight_decay, step):
    param, grad, m, v = _flat(param), _flat(grad), _flat(m), _flat(v)
    host_shape.same_size("adam_update", param, grad)
    if step < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step}")
    if param.size:
        # PyTorch: step_size = lr / (1 - b1^t); denom = sqrt(v) / sqrt(1 - b2^t) + eps
        s = lambda x: _scalar(param, x)  # noqa: E731
        _adam_k.pick(param, grad, m, v)[_grid(param.size)](
            param, grad, m, v, s(lr / (1 - beta1 ** step)), s(beta1), s(beta2), s(eps),
            s(weight_decay), s(1 / math.sqrt(1 - beta2 ** step)))


@_half_safe
def _rmsprop_k(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay, momentum,
               centered, one):
    for i in range(cuda.grid(1), param.size, cuda.gridsize(1)):
        g = grad[i] + weight_decay * param[i]
        v = alpha * square_avg[i] + (one - alpha) * g * g
        square_avg[i] = v
        if centered:
            ga = alpha * grad_avg[i] + (one - alpha) * g
            grad_avg[i] = ga
            v = v - ga * ga
        step = g / (math.sqrt(v) + eps)
        if momentum != 0:
            b = momentum * buf[i] + step
            buf[i] = b
            step = b
        param[i] = param[i] - lr * step


def rmsprop_update(param, grad, square_avg, grad_avg, buf, lr, alpha, eps, weight_decay,
                   momentum, centered):
    # grad_avg and buf are unused (and may be None) without centering / momentum
    param, grad, square_avg = _flat(param), _flat(grad), _flat(square_avg)
    grad_avg = _flat(grad_avg) if centered else param
    buf = _flat(buf) if momentum != 0 else param
    host_shape.same_size("rmsprop_update", param, grad, square_avg, grad_avg, buf)
    s = lambda v: _scalar(param, v)  # noqa: E731
    kernel = _rmsprop_k.pick(param, grad, square_avg, grad_avg, buf)
    _launch(kernel, param.size, param, grad, square_avg, grad_avg, buf, s(lr), s(alpha), s(eps),
            s(weight_decay), s(momentum), bool(centered), s(1))


# --- Collective reductions ----------------------------------------------------------------------
# Not cached: their float16 versions (fp16 compression) link CUDA's fp16 library, and Numba cannot
# pickle a kernel with linked files ("Cannot pickle CUDACodeLibrary with linking files", seen on
# an H100 with numba-cuda 0.30.4). Four one-line kernels compile in well under a second.

@cuda.jit
def _reduce_sum_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] + src[i]


@cuda.jit
def _reduce_min_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        if src[i] < dst[i]:
            dst[i] = src[i]


@cuda.jit
def _reduce_max_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        if src[i] > dst[i]:
            dst[i] = src[i]


@cuda.jit
def _reduce_prod_k(dst, src):
    for i in range(cuda.grid(1), dst.size, cuda.gridsize(1)):
        dst[i] = dst[i] * src[i]


_REDUCE = {"sum": _reduce_sum_k, "min": _reduce_min_k, "max": _reduce_max_k,
           "prod": _reduce_prod_k}


def reduce_into(dst, src, op):
    if op not in _REDUCE:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {list(_REDUCE)}")
    dst, src = _flat(dst), _flat(src)
    host_shape.same_size("reduce_into", src, dst)
    _launch(_REDUCE[op], dst.size, dst, src)


# --- Normalisation, pooling and shortcuts -------------------------------------------------------

# Per-channel sums (BatchNorm's stats and the two sums of its backward) reduce N*L values for
# each of only C channels (16 in ResNet-20's first stage), so one block per channel would leave
# most of a GPU idle. Each channel's values are cut into chunks of at most _BN_CHUNK: block b
# reduces chunk b // C of channel b % C, its threads striding through the chunk (consecutive
# threads, consecutive addresses), in float64 in shared memory, into partials (chunks, 2*C); a
# second pass adds each channel's chunk partials in chunk order. Deterministic, no atomics.
_BN_CHUNK = 2 * _TPB if _SIM else 32 * _TPB


@cuda.jit(device=True)
def _block_sum_pair(s, s2, partials, row, c, channels):
    """Tree-reduce two float64 per thread into partials[row, c] and partials[row, channels + c]
    (every thread of the block must call)."""
    buf = cuda.shared.array(_TPB, float64)
    buf2 = cuda.shared.array(_TPB, float64)
    tid = cuda.threadIdx.x
    buf[tid] = s
    buf2[tid] = s2
    cuda.syncthreads()
    half = _TPB // 2
    while half > 0:
        if tid < half:
            buf[tid] += buf[tid + half]
            buf2[tid] += buf2[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        partials[row, c] = buf[0]
        partials[row, channels + c] = buf2[0]
    cuda.syncthreads()              # a block's next (chunk, channel) reuses buf after this read


@cuda.jit(cache=True)
def _bn_stats_k(x, partials, chunk):
    # x (N, C, L) -> partials (chunks, 2*C): per (chunk, channel) the sums of x and of x**2
    n_n, c_n, l_n = x.shape
    values = n_n * l_n
    for b in range(cuda.blockIdx.x, partials.shape[0] * c_n, cuda.gridDim.x):
        k = b // c_n
        c = b - k * c_n
        end = (k + 1) * chunk
        if end > values:            # not min(): ptx_check's CUDA build (Numba 0.68) rejects it
            end = values
        s = float64(0.0)
        s2 = float64(0.0)
        for i in range(k * chunk + cuda.threadIdx.x, end, _TPB):
            n = i // l_n
            v = float64(x[n, c, i - n * l_n])
            s += v
            s2 += v * v
        _block_sum_pair(s, s2, partials, k, c, c_n)


@cuda.jit(cache=True)
def _bn_backward_stats_k(grad_y, x, mean, invstd, partials, chunk):
    # partials (chunks, 2*C): per (chunk, channel) the sums of grad_y and of grad_y * xhat
    n_n, c_n, l_n = x.shape
    values = n_n * l_n
    for b in range(cuda.blockIdx.x, partials.shape[0] * c_n, cuda.gridDim.x):
        k = b // c_n
        c = b - k * c_n
        m = float64(mean[c])
        end = (k + 1) * chunk
        if end > values:
            end = values
        s = float64(0.0)
        s2 = float64(0.0)
        for i in range(k * chunk + cuda.threadIdx.x, end, _TPB):
            n = i // l_n
            j = i - n * l_n
            g = float64(grad_y[n, c, j])
            s += g
            s2 += g * (float64(x[n, c, j]) - m)
        _block_sum_pair(s, s2 * float64(invstd[c]), partials, k, c, c_n)


@cuda.jit(cache=True)
def _sum_chunks_k(partials, out):
    # out (2*C,) = partials (chunks, 2*C) summed over chunks, in chunk order
    for j in range(cuda.grid(1), out.size, cuda.gridsize(1)):
        acc = float64(0.0)
        for k in range(partials.shape[0]):
            acc += partials[k, j]
        out[j] = acc


def _channel_sums(kernel, arrays, values, channels, stats):
    """Launch a per-channel sum ``kernel(*arrays, partials, chunk)`` over ``values`` values per
    channel, then add its chunk partials into stats (2, C)."""
    if channels == 0:
        return
    chunks = max(1, -(-values // _BN_CHUNK))
    chunk = -(-values // chunks) if values else 1               # balanced, <= _BN_CHUNK
    partials = _scratch((chunks, 2 * channels))
    kernel[min(chunks * channels, _MAX_BLOCKS), _TPB](*arrays, partials, chunk)
    _sum_chunks_k[_grid(2 * channels)](partials, _flat(stats))


def bn_stats(x, stats):
    x, stats = _dev(x), _dev(stats)
    n, c, l = norm_shape.ncl("bn_stats", x.shape)
    norm_shape.stats("bn_stats", stats, c)
    _channel_sums(_bn_stats_k, (x.reshape(n, c, l),), n * l, c, stats)


@cuda.jit(cache=True)
def _bn_moments_k(stats, count, eps, momentum, unbias, mean, invstd, running_mean, running_var):
    for c in range(cuda.grid(1), mean.size, cuda.gridsize(1)):
        m = stats[0, c] / count
        var = stats[1, c] / count - m * m                       # biased; >= 0 but for rounding
        if var < 0.0:
            var = 0.0
        mean[c] = m
        invstd[c] = 1.0 / math.sqrt(var + eps)
        running_mean[c] = (1.0 - momentum) * float64(running_mean[c]) + momentum * m
        running_var[c] = (1.0 - momentum) * float64(running_var[c]) + momentum * var * unbias


def bn_moments(stats, count, eps, momentum, mean, invstd, running_mean, running_var):
    stats, mean, invstd = _dev(stats), _dev(mean), _dev(invstd)
    running_mean, running_var = _dev(running_mean), _dev(running_var)
    c = mean.size
    norm_shape.stats("bn_moments", stats, c)
    norm_shape.same_shape("bn_moments", (c,), invstd=invstd, running_mean=running_mean,
                          running_var=running_var)
    count = norm_shape.count("bn_moments", count)
    unbias = count / (count - 1.0) if count > 1.0 else 1.0     # running_var is unbiased
    _launch(_bn_moments_k, c, stats, count, float(eps), float(momentum), unbias, mean, invstd,
            running_mean, running_var)


@cuda.jit(cache=True)
def _bn_eval_moments_k(running_mean, running_var, eps, mean, invstd):
    for c in range(cuda.grid(1), mean.size, cuda.gridsize(1)):
        mean[c] = running_mean[c]
        invstd[c] = 1.0 / math.sqrt(float64(running_var[c]) + eps)


def bn_eval_moments(running_mean, running_var, eps, mean, invstd):
    running_mean, running_var = _dev(running_mean), _dev(running_var)
    mean, invstd = _dev(mean), _dev(invstd)
    c = mean.size
    norm_shape.same_shape("bn_eval_moments", (c,), invstd=invstd, running_mean=running_mean,
                          running_var=running_var)
    _launch(_bn_eval_moments_k, c, running_mean, running_var, float(eps), mean, invstd)


@cuda.jit(cache=True)
def _bn_forward_k(x, mean, invstd, weight, bias, y, l_n, c_n):
    # x, y flat (N*C*L,); element i is in channel (i // L) % C
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        c = (i // l_n) % c_n
        y[i] = (x[i] - mean[c]) * (invstd[c] * weight[c]) + bias[c]


def bn_forward(x, mean, invstd, weight, bias, y):
    x, y = _dev(x), _dev(y)
    n, c, l = norm_shape.ncl("bn_forward", x.shape)
    norm_shape.same_shape("bn_forward", x.shape, y=y)
    mean, invstd, weight, bias = _dev(mean), _dev(invstd), _dev(weight), _dev(bias)
    norm_shape.same_shape("bn_forward", (c,), mean=mean, invstd=invstd, weight=weight, bias=bias)
    _launch(_bn_forward_k, x.size, _flat(x), mean, invstd, weight, bias, _flat(y), l, c)


def bn_backward_stats(grad_y, x, mean, invstd, stats):
    grad_y, x, stats = _dev(grad_y), _dev(x), _dev(stats)
    n, c, l = norm_shape.ncl("bn_backward_stats", x.shape)
    norm_shape.same_shape("bn_backward_stats", x.shape, grad_y=grad_y)
    mean, invstd = _dev(mean), _dev(invstd)
    norm_shape.same_shape("bn_backward_stats", (c,), mean=mean, invstd=invstd)
    norm_shape.stats("bn_backward_stats", stats, c)
    _channel_sums(_bn_backward_stats_k, (grad_y.reshape(n, c, l), x.reshape(n, c, l), mean,
                                         invstd), n * l, c, stats)


@cuda.jit(cache=True)
def _bn_param_grads_k(stats, grad_weight, grad_bias, accumulate):
    for c in range(cuda.grid(1), grad_weight.size, cuda.gridsize(1)):
        if accumulate:
            grad_weight[c] += stats[1, c]
            grad_bias[c] += stats[0, c]
        else:
            grad_weight[c] = stats[1, c]
            grad_bias[c] = stats[0, c]


def bn_param_grads(stats, grad_weight, grad_bias, accumulate):
    stats, grad_weight, grad_bias = _dev(stats), _dev(grad_weight), _dev(grad_bias)
    c = grad_weight.size
    norm_shape.stats("bn_param_grads", stats, c)
    norm_shape.same_shape("bn_param_grads", (c,), grad_bias=grad_bias)
    _launch(_bn_param_grads_k, c, stats, grad_weight, grad_bias, bool(accumulate))


@cuda.jit(cache=True)
def _bn_input_coeffs_k(invstd, weight, stats, count, coeffs):
    # grad_x = k*g - k*s0/count - k*invstd*(s1/count)*(x - mean), k = weight*invstd: the three
    # per-channel constants in float64, stored in x's dtype so the element pass stays in it
    for c in range(cuda.grid(1), invstd.size, cuda.gridsize(1)):
        inv = float64(invstd[c])
        k = float64(weight[c]) * inv
        coeffs[0, c] = k
        coeffs[1, c] = k * stats[0, c] / count
        coeffs[2, c] = k * inv * stats[1, c] / count


@cuda.jit(cache=True)
def _bn_backward_input_k(grad_y, x, mean, coeffs, grad_x, l_n, c_n):
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        c = (i // l_n) % c_n
        grad_x[i] = coeffs[0, c] * grad_y[i] - coeffs[1, c] - coeffs[2, c] * (x[i] - mean[c])


def bn_backward_input(grad_y, x, mean, invstd, weight, stats, count, grad_x):
    grad_y, x, grad_x, stats = _dev(grad_y), _dev(x), _dev(grad_x), _dev(stats)
    n, c, l = norm_shape.ncl("bn_backward_input", x.shape)
    norm_shape.same_shape("bn_backward_input", x.shape, grad_y=grad_y, grad_x=grad_x)
    mean, invstd, weight = _dev(mean), _dev(invstd), _dev(weight)
    norm_shape.same_shape("bn_backward_input", (c,), mean=mean, invstd=invstd, weight=weight)
    norm_shape.stats("bn_backward_input", stats, c)
    count = norm_shape.count("bn_backward_input", count)
    if x.size == 0:
        return
    coeffs = _scratch((3, c), x.dtype)                          # (3, C) in x's dtype
    _bn_input_coeffs_k[_grid(c)](invstd, weight, stats, count, coeffs)
    _bn_backward_input_k[_grid(x.size)](_flat(grad_y), _flat(x), mean, coeffs, _flat(grad_x),
                                        l, c)


@cuda.jit(cache=True)
def _global_avgpool_forward_k(x, y, l_n):
    # one thread per (n, c) plane, summed in float64: the planes at the end of a network are
    # small (8 x 8 in ResNet-20), so a block per plane would idle most of its threads
    for p in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        s = float64(0.0)
        for j in range(p * l_n, (p + 1) * l_n):
            s += float64(x[j])
        y[p] = s / l_n


def global_avgpool_forward(x, y):
    x, y = _dev(x), _dev(y)
    n, c, l = norm_shape.pool("global_avgpool_forward", x.shape, y.shape)
    _launch(_global_avgpool_forward_k, y.size, _flat(x), _flat(y), l)


@cuda.jit(cache=True)
def _global_avgpool_backward_k(grad_y, grad_x, l_n):
    count = grad_x.dtype.type(l_n)  # dividing by the integer l_n would compute in float64
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        grad_x[i] = grad_y[i // l_n] / count


def global_avgpool_backward(grad_y, grad_x):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    n, c, l = norm_shape.pool("global_avgpool_backward", grad_x.shape, grad_y.shape)
    _launch(_global_avgpool_backward_k, grad_x.size, _flat(grad_y), _flat(grad_x), l)


@cuda.jit(cache=True)
def _shortcut_forward_k(x, y, stride, offset):
    # gather over y (N, C2, OH, OW): channel c2 reads x's channel c2 - offset, or is zero
    c_n = x.shape[1]
    c2_n, oh_n, ow_n = y.shape[1], y.shape[2], y.shape[3]
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        ow = i % ow_n
        oh = (i // ow_n) % oh_n
        c2 = (i // (ow_n * oh_n)) % c2_n
        n = i // (ow_n * oh_n * c2_n)
        c = c2 - offset
        if 0 <= c < c_n:
            y[n, c2, oh, ow] = x[n, c, oh * stride, ow * stride]
        else:
            y[n, c2, oh, ow] = 0


def shortcut_forward(x, y, stride, offset):
    x, y = _dev(x), _dev(y)
    stride, offset = norm_shape.shortcut("shortcut_forward", x.shape, y.shape, stride, offset)
    _launch(_shortcut_forward_k, y.size, x, y, stride, offset)


@cuda.jit(cache=True)
def _shortcut_backward_k(grad_y, grad_x, stride, offset):
    # gather over grad_x (N, C, H, W): only pixels on the stride grid received a value
    c_n, h_n, w_n = grad_x.shape[1], grad_x.shape[2], grad_x.shape[3]
    for i in range(cuda.grid(1), grad_x.size, cuda.gridsize(1)):
        w = i % w_n
        h = (i // w_n) % h_n
        c = (i // (w_n * h_n)) % c_n
        n = i // (w_n * h_n * c_n)
        if h % stride == 0 and w % stride == 0:
            grad_x[n, c, h, w] = grad_y[n, c + offset, h // stride, w // stride]
        else:
            grad_x[n, c, h, w] = 0


def shortcut_backward(grad_y, grad_x, stride, offset):
    grad_y, grad_x = _dev(grad_y), _dev(grad_x)
    stride, offset = norm_shape.shortcut("shortcut_backward", grad_x.shape, grad_y.shape,
                                         stride, offset, names=("grad_x", "grad_y"))
    _launch(_shortcut_backward_k, grad_x.size, grad_y, grad_x, stride, offset)
