"""The Numba flavour's GEMM (tiled in shared memory, register-blocked, K split where the output
has too few tiles to fill the GPU: ``make_gemm``, ``_gemm_splits``), dense-layer kernels and
activations."""
import functools
import math

import numpy as np
from numba import cuda, float64, from_dtype

from mpitrain.kernels import checks
from mpitrain.kernels.cuda_numba.arrays import SIM, dev, flat, grid, launch, scalar, scratch

TILE = 4 if SIM else 16           # GEMM threads per block edge (TILE**2 threads)
MICRO = 2 if SIM else 4           # GEMM outputs per thread edge: block tile TILE * MICRO
MAX_GEMM_BLOCKS = 2 if SIM else 2**31 - 1

# Split K. A convolution's weight gradient has a small output (C_out x C*kh*kw, one to a few
# dozen 64 x 64 tiles) and a long K (N*OH*OW, 50,000 and more): with one block per tile most
# multiprocessors idle while each block walks all of K. When the tiles are fewer than the blocks
# that fill the GPU (two per multiprocessor), K is cut into S splits of at least
# _SPLIT_MIN_STAGES K-stages each (a split's partial tile costs a store and a load, which enough
# of K amortises): S = min(ceil(wanted / tiles), stages // _SPLIT_MIN_STAGES). Split s stores its
# tile in a scratch (S, M, N); _gemm_sum_k then adds each output's S partials in split order.
# Deterministic: every sum has a fixed order, whatever the grid.
_SPLIT_MIN_STAGES = 2 if SIM else 16


@functools.cache
def _gemm_blocks_wanted():
    """Blocks that fill the GPU: two per multiprocessor (an H100's 132 in the simulator)."""
    return 2 * (132 if SIM else cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _gemm_splits(tiles, kdim):
    """The number of K splits for ``tiles`` output tiles and K = ``kdim`` (1: K is not split).
    Split s covers the K-stages [s * per, (s + 1) * per), per = ceil(stages / S); S is the
    fewest splits of that length, so none is empty."""
    stages = (kdim + TILE - 1) // TILE
    wanted = _gemm_blocks_wanted()
    if tiles >= wanted or stages < 2 * _SPLIT_MIN_STAGES:
        return 1
    splits = min((wanted + tiles - 1) // tiles, stages // _SPLIT_MIN_STAGES)
    per = (stages + splits - 1) // splits
    return (stages + per - 1) // per


@functools.cache
def make_gemm(dtype, split=False, batched=False):
    """Tiled shared-memory GEMM for one dtype (shared arrays need the dtype at compile time;
    one kernel per dtype and kind, made at its first use).

    A block of TILE x TILE threads computes a _BM x _BM output tile (_BM = TILE * MICRO):
    each thread accumulates MICRO x MICRO outputs in registers, rows ty + p*TILE and columns
    tx + q*TILE, so one value read from shared memory feeds MICRO multiply-adds. K advances in
    stages of TILE: every thread loads MICRO elements of op(a) and of op(b), with consecutive
    threads on the operand's contiguous axis (coalesced for either transpose).

    With ``split``, ``out`` is the scratch (S, M, N): the blocks walk (split, tile) pairs, and
    split s stores the product over its K-stages (``_gemm_splits``) in out[s]. With
    ``batched``, a, b and out have a leading group axis (G, ...) on the grid's y axis
    (transformer.py's batched_gemm; no K split: attention's products have many tiles). Every
    kind runs ``tile``, so that kernel is made here too: under the simulator a device function
    must be in its kernel's module (arrays.py).
    """
    nbt = from_dtype(np.dtype(dtype))
    tt, micro, bm = TILE, MICRO, TILE * MICRO       # compile-time constants (closure)
    bk = TILE
    bk_pad, bm_pad = bk + 1, bm + 1                     # +1: no shared-memory bank conflicts

    @cuda.jit(device=True)
    def tile(a, b, out, row0, col0, k_begin, k_end, trans_a, trans_b, accumulate):
        # out[row0:row0 + bm, col0:col0 + bm] (=|+=) the tile of op(a) (M, K) @ op(b) (K, N)
        # over the K range [k_begin, k_end); a, b, out 2-D (every thread of the block calls)
        sa = cuda.shared.array((bm, bk_pad), nbt)       # sa[i, k] = op(a)[row0 + i, k0 + k]
        sb = cuda.shared.array((bk, bm_pad), nbt)       # sb[k, j] = op(b)[k0 + k, col0 + j]
        acc = cuda.local.array((micro, micro), nbt)
        m, n = out.shape
        tx = cuda.threadIdx.x
        ty = cuda.threadIdx.y
        tid = ty * tt + tx
        for p in range(micro):
            for q in range(micro):
                acc[p, q] = 0
        for k0 in range(k_begin, k_end, bk):
            for e in range(micro):                      # bm * bk = micro * tt**2 elements
                idx = e * tt * tt + tid
                if trans_a:                             # a (K, M): i is contiguous
                    i = idx % bm
                    kk = idx // bm
                    r = row0 + i
                    kg = k0 + kk
                    sa[i, kk] = a[kg, r] if (r < m and kg < k_end) else nbt(0)
                else:                                   # a (M, K): k is contiguous
                    kk = idx % bk
                    i = idx // bk
                    r = row0 + i
                    kg = k0 + kk
                    sa[i, kk] = a[r, kg] if (r < m and kg < k_end) else nbt(0)
                if trans_b:                             # b (N, K): k is contiguous
                    kk = idx % bk
                    j = idx // bk
                    c = col0 + j
                    kg = k0 + kk
                    sb[kk, j] = b[c, kg] if (c < n and kg < k_end) else nbt(0)
                else:                                   # b (K, N): j is contiguous
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
                    if accumulate:
                        out[r, c] += acc[p, q]
                    else:
                        out[r, c] = acc[p, q]

    if batched:
        @cuda.jit
        def batched_gemm_k(a, b, out, trans_a, trans_b, accumulate):
            # out[g] (M, N) (=|+=) op(a[g]) (M, K) @ op(b[g]) (K, N); block (x, y) computes the
            # tiles x, x + gridDim.x, ... of the groups y, y + gridDim.y, ...
            groups, m, n = out.shape
            kdim = a.shape[1] if trans_a else a.shape[2]
            tiles_n = (n + bm - 1) // bm
            tiles = ((m + bm - 1) // bm) * tiles_n
            for g in range(cuda.blockIdx.y, groups, cuda.gridDim.y):
                for t in range(cuda.blockIdx.x, tiles, cuda.gridDim.x):
                    tile(a[g], b[g], out[g], (t // tiles_n) * bm, (t % tiles_n) * bm, 0, kdim,
                         trans_a, trans_b, accumulate)

        return batched_gemm_k

    @cuda.jit
    def gemm_k(a, b, out, trans_a, trans_b, accumulate):
        # out (M, N) (=|+=) op(a) (M, K) @ op(b) (K, N); block b computes the (split, tile)
        # pairs b, b + gridDim.x, ... (one per block on a GPU; few blocks under the simulator)
        m, n = out.shape[-2], out.shape[-1]
        splits = out.shape[0] if split else 1
        kdim = a.shape[0] if trans_a else a.shape[1]
        kchunk = (((kdim + bk - 1) // bk + splits - 1) // splits) * bk
        tiles_n = (n + bm - 1) // bm
        tiles = ((m + bm - 1) // bm) * tiles_n
        for st in range(cuda.blockIdx.x, tiles * splits, cuda.gridDim.x):
            s = st // tiles
            t = st - s * tiles
            k_begin = s * kchunk
            k_end = k_begin + kchunk
            if k_end > kdim:            # not min(): see _bn_stats_k
                k_end = kdim
            row0 = (t // tiles_n) * bm
            col0 = (t % tiles_n) * bm
            if split:                   # a constant: Numba types the branch taken only
                tile(a, b, out[s], row0, col0, k_begin, k_end, trans_a, trans_b, False)
            else:
                tile(a, b, out, row0, col0, k_begin, k_end, trans_a, trans_b, accumulate)

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
    a, b, out = dev(a), dev(b), dev(out)
    if a.ndim != 2 or b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm needs 2-D arrays, got {a.shape}, {b.shape}, {out.shape}")
    m, ka = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if ka != kb or out.shape != (m, n):
        raise ValueError(f"gemm shapes do not match: op(a) {(m, ka)} @ op(b) {(kb, n)} "
                         f"-> out {out.shape}")
    if m == 0 or n == 0:
        return
    bm = TILE * MICRO
    tiles = ((m + bm - 1) // bm) * ((n + bm - 1) // bm)
    splits = _gemm_splits(tiles, ka)
    if splits == 1:
        make_gemm(out.dtype, False)[min(tiles, MAX_GEMM_BLOCKS), (TILE, TILE)](
            a, b, out, bool(trans_a), bool(trans_b), bool(accumulate))
        return
    part = scratch((splits, m, n), out.dtype)
    make_gemm(out.dtype, True)[min(tiles * splits, MAX_GEMM_BLOCKS), (TILE, TILE)](
        a, b, part, bool(trans_a), bool(trans_b), False)
    _gemm_sum_k[grid(m * n)](part, out, bool(accumulate))


# Dense layers ------------------------------------------------------------------------------------

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
    y2, bias = dev(y), flat(bias)
    checks.bias("bias_act", y2, bias, ("y", "bias"))
    launch(_bias_act_k, y2.size, flat(y2), bias, bool(relu))


@cuda.jit(cache=True)
def _relu_k(x, out):
    zero = x.dtype.type(0)
    for i in range(cuda.grid(1), x.size, cuda.gridsize(1)):
        v = x[i]
        out[i] = v if v > zero else zero


def relu(x, out):
    x, out = checks.same_size("relu", flat(x), flat(out))
    launch(_relu_k, x.size, x, out)


@cuda.jit(cache=True)
def _relu_backward_k(y, grad_out, grad_in):
    zero = grad_out.dtype.type(0)
    for i in range(cuda.grid(1), y.size, cuda.gridsize(1)):
        grad_in[i] = grad_out[i] if y[i] > zero else zero


def relu_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("relu_backward", flat(y), flat(grad_out), flat(grad_in))
    launch(_relu_backward_k, y.size, y, grad_out, grad_in)


# bias_grad sums a tall (rows, F) matrix by column: a conv layer's gradient has N*OH*OW rows
# (200k for LeNet at batch 256) and only C columns, so one thread per column would leave the GPU
# idle. Two passes instead: every (chunk of _BIAS_ROWS rows, column) pair is one thread writing a
# partial sum, then one thread per column adds its partials in chunk order (deterministic).
_BIAS_ROWS = 8 if SIM else 256


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
    grad_out, grad_bias = dev(grad_out), flat(grad_bias)
    checks.bias("bias_grad", grad_out, grad_bias, ("grad_out", "grad_bias"))
    rows, feats = grad_out.shape
    if feats == 0 or rows == 0:
        return
    chunks = (rows + _BIAS_ROWS - 1) // _BIAS_ROWS
    partials = scratch((chunks, feats), grad_bias.dtype)
    _bias_partials_k[grid(chunks * feats)](grad_out, partials, _BIAS_ROWS)
    _bias_sum_k[grid(feats)](partials, grad_bias)


# Activations and softmax -------------------------------------------------------------------------
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
    x, out = checks.same_size("tanh", flat(x), flat(out))
    launch(_tanh_k, x.size, x, out)


def tanh_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("tanh_backward", flat(y), flat(grad_out), flat(grad_in))
    launch(_tanh_backward_k, y.size, y, grad_out, grad_in, scalar(y, 1))


def sigmoid(x, out):
    x, out = checks.same_size("sigmoid", flat(x), flat(out))
    launch(_sigmoid_k, x.size, x, out, scalar(out, 1))


def sigmoid_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = checks.same_size("sigmoid_backward", *map(flat, (y, grad_out, grad_in)))
    launch(_sigmoid_backward_k, y.size, y, grad_out, grad_in, scalar(y, 1))


def leaky_relu(x, out, negative_slope):
    x, out = checks.same_size("leaky_relu", flat(x), flat(out))
    launch(_leaky_relu_k, x.size, x, out, scalar(x, negative_slope))


def leaky_relu_backward(x, grad_out, grad_in, negative_slope):
    x, grad_out, grad_in = flat(x), flat(grad_out), flat(grad_in)
    checks.same_size("leaky_relu_backward", x, grad_out, grad_in)
    launch(_leaky_relu_backward_k, x.size, x, grad_out, grad_in, scalar(grad_out, negative_slope))


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
    return flat(a).reshape(r, k)


def softmax(x, y):
    x, y = dev(x), dev(y)
    r, k = checks.rows("softmax", x.shape, y)
    if r and k:
        launch(_softmax_k, r, _rows(x, r, k), _rows(y, r, k), scalar(y, 1))


def softmax_backward(y, grad_out, grad_in):
    y, grad_out, grad_in = dev(y), dev(grad_out), dev(grad_in)
    r, k = checks.rows("softmax_backward", y.shape, grad_out, grad_in)
    if r and k:
        launch(_softmax_backward_k, r, _rows(y, r, k), _rows(grad_out, r, k), _rows(grad_in, r, k))
