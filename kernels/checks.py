"""The kernels' shape and argument checks, with their one-line messages, for every backend.

The GPU backends launch their kernels over sizes or flat indices taken from one array and must
refuse the others before launching when they do not match (a kernel would read or write out of
bounds, or silently skip elements). The arithmetic and the messages live here once, and the CPU
wrappers use the same ones where they check, so the backends word an error alike.
"""
import numpy as np


def flat(a, name="array"):
    """The flat view of a C-contiguous array (CPU and CuPy); ValueError naming it otherwise."""
    if not a.flags.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous, got strides {a.strides}")
    return a.reshape(-1)


def sizes_match(src, *dsts):
    """The CPU's size check of outputs (and further operands) against an input."""
    for dst in dsts:
        if dst.size != src.size:
            raise ValueError(f"size mismatch: dst has {dst.size} elements, src has {src.size}")


def same_size(kind, ref, *others):
    """Every array of ``others`` has as many elements as ``ref``; (ref, *others)."""
    for a in others:
        if a.size != ref.size:
            raise ValueError(f"{kind}: sizes differ ({a.size} vs {ref.size})")
    return (ref,) + others


def gemm(op_a, op_b, out):
    """op(a) @ op(b) -> out: three 2-D arrays whose shapes agree (the CPU and CuPy GEMM)."""
    if op_a.ndim != 2 or op_b.ndim != 2 or out.ndim != 2:
        raise ValueError(f"gemm needs 2-D arrays, got {op_a.shape}, {op_b.shape} -> {out.shape}")
    if op_a.shape[1] != op_b.shape[0] or out.shape != (op_a.shape[0], op_b.shape[1]):
        raise ValueError(f"gemm shapes do not agree: {op_a.shape} @ {op_b.shape} -> {out.shape}")


def bias(kind, matrix, vector, names):
    """``matrix`` is (B, F) and ``vector`` (F,); ``names`` are the caller's names for the two."""
    if matrix.ndim != 2 or vector.shape != (matrix.shape[1],):
        raise ValueError(f"{kind}: {names[0]} {matrix.shape} does not match {names[1]} "
                         f"{vector.shape}")


def layout(kind, nchw_shape, rows, name):
    """(C, H, W) of the NCHW side of a layout transpose; ``rows`` (called ``name``), the other
    side, must be (N*H*W, C)."""
    n, c, h, w = nchw_shape
    if rows.shape != (n * h * w, c):
        raise ValueError(f"{kind}: {name} {rows.shape} != {(n * h * w, c)}")
    return c, h, w


def out_size(size, k, stride, pad):
    """Output length of a convolution along one axis of length ``size``."""
    return (size + 2 * pad - k) // stride + 1


def dims(kind, image_shape, cols_shape, kh, kw, stride, pad):
    """(C, H, W, OH, OW) of an (N, C, H, W) image; ValueError naming ``kind`` unless
    ``cols_shape`` is (N*OH*OW, C*KH*KW)."""
    n, c, h, w = image_shape
    oh, ow = out_size(h, kh, stride, pad), out_size(w, kw, stride, pad)
    want = (n * oh * ow, c * kh * kw)
    if tuple(cols_shape) != want:
        raise ValueError(f"{kind}: cols {tuple(cols_shape)} != {want}")
    return c, h, w, oh, ow


def rows(kind, shape, *others):
    """(R, K) of a row kernel's (..., K) array (softmax over the last axis: R rows of K), with
    every array of ``others`` of the same shape."""
    for a in others:
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{kind}: shapes differ ({tuple(a.shape)} vs {tuple(shape)})")
    shape = tuple(shape)            # a plain tuple: the simulator's shape refuses index -1
    if len(shape) == 0:
        raise ValueError(f"{kind}: expected an array with a last axis, got a 0-d array")
    k = shape[-1]
    r = 1
    for n in shape[:-1]:
        r *= n
    return r, k


def pool(kind, x_shape, y_shape, k, stride):
    """(OH, OW) of a k x k window pooling of an (N, C, H, W) input without padding; ValueError
    naming ``kind`` unless k and stride are positive, the window fits, and y is (N, C, OH, OW)."""
    if len(x_shape) != 4:
        raise ValueError(f"{kind}: expected an (N, C, H, W) input, got shape {tuple(x_shape)}")
    if int(k) != k or int(stride) != stride or k < 1 or stride < 1:
        raise ValueError(f"{kind}: window {k!r} and stride {stride!r} must be positive integers")
    n, c, h, w = x_shape
    if h < k or w < k:
        raise ValueError(f"{kind}: window {k} does not fit input {h}x{w}")
    want = (n, c, out_size(h, k, stride, 0), out_size(w, k, stride, 0))
    if tuple(y_shape) != want:
        raise ValueError(f"{kind}: output {tuple(y_shape)} != {want}")
    return want[2], want[3]


def maxpool_backward(grad_y, argmax, grad_x):
    """grad_y and argmax (N, C, OH, OW) of the same shape, grad_x (N, C, H, W) (GPU backends)."""
    if grad_y.shape != argmax.shape or grad_y.shape[:2] != grad_x.shape[:2]:
        raise ValueError(f"maxpool_backward: grad_y {grad_y.shape}, argmax {argmax.shape}, "
                         f"grad_x {grad_x.shape} do not match")


def xent(kind, logits, labels, grad, losses, int64=False):
    """logits (B, K), labels (B,) (int64 if ``int64``), grad (B, K), losses (B,): the
    cross-entropy's arrays."""
    if (logits.ndim != 2 or tuple(labels.shape) != (logits.shape[0],)
            or tuple(grad.shape) != tuple(logits.shape)
            or tuple(losses.shape) != (logits.shape[0],)):
        raise ValueError(f"{kind}: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, "
                         f"grad {tuple(grad.shape)}, losses {tuple(losses.shape)} do not match")
    if int64 and labels.dtype != np.int64:
        raise ValueError(f"{kind}: labels must be int64, got {labels.dtype}")


def adam_step(step):
    """Adam's step count is 1-based (CPU and CuPy)."""
    if step < 1:
        raise ValueError(f"adam_update: step is 1-based, got {step!r}")


def ncl(kind, shape):
    """(N, C, L) of an (N, C) or (N, C, H, W) BatchNorm input; ValueError naming ``kind``."""
    if len(shape) == 2:
        return shape[0], shape[1], 1
    if len(shape) != 4:
        raise ValueError(f"{kind}: expected an (N, C) or (N, C, H, W) array, got shape "
                         f"{tuple(shape)}")
    n, c, h, w = shape
    return n, c, (h * w if n * c else 1)


def same_shape(kind, want, **arrays):
    """Every keyword array has shape ``want``."""
    for name, a in arrays.items():
        if tuple(a.shape) != tuple(want):
            raise ValueError(f"{kind}: {name} {tuple(a.shape)} != {tuple(want)}")


def stats(kind, a, c):
    """``a`` is the (2, C) float64 stats array of the contract."""
    if a.shape != (2, c) or a.dtype != np.float64:
        raise ValueError(f"{kind}: stats must be (2, {c}) float64, got {tuple(a.shape)} "
                         f"{a.dtype}")


def count(kind, value):
    """The number of values per channel the stats were summed over, as a float (>= 1)."""
    if not value > 0:
        raise ValueError(f"{kind}: batch norm needs at least one value per channel, got count "
                         f"{value}")
    return float(value)


def global_pool(kind, image_shape, pooled_shape):
    """(N, C, L) of global average pooling: image (N, C, H, W) -> pooled (N, C)."""
    if len(image_shape) != 4 or tuple(pooled_shape) != tuple(image_shape[:2]):
        raise ValueError(f"{kind}: {tuple(image_shape)} -> {tuple(pooled_shape)}, expected "
                         "(N, C, H, W) -> (N, C)")
    n, c, h, w = image_shape
    return n, c, h * w


def shortcut(kind, x_shape, y_shape, stride, offset, names=("x", "y")):
    """(stride, offset) as ints after checking the option-A shortcut's shapes: x (N, C, H, W),
    y (N, C2, ceil(H/stride), ceil(W/stride)) with C2 >= C + offset; ``names`` are the caller's
    names for x and y (backward: grad_x, grad_y)."""
    stride, offset = int(stride), int(offset)
    nx, ny = names
    if len(x_shape) != 4 or stride < 1 or offset < 0:
        raise ValueError(f"{kind}: {nx} {tuple(x_shape)}, stride {stride}, offset {offset}: "
                         f"expected a 4-D {nx}, stride >= 1, offset >= 0")
    n, c, h, w = x_shape
    oh, ow = -(-h // stride), -(-w // stride)
    if (len(y_shape) != 4 or y_shape[0] != n or tuple(y_shape[2:]) != (oh, ow)
            or y_shape[1] < c + offset):
        raise ValueError(f"{kind}: {nx} {tuple(x_shape)}, {ny} {tuple(y_shape)}, stride "
                         f"{stride}, offset {offset}: expected {ny} (N, C2 >= {c + offset}, "
                         f"{oh}, {ow})")
    return stride, offset


# Transformer kernels (kernels/<backend>/transformer.py) --------------------------------------
# Every backend makes these checks alike. What stays with a backend: reading contiguity off its
# array type (it calls ``contiguous`` with its answer), and what a bad token id does (the CPU
# refuses it; the GPU, which would have to synchronise to look, gives a row of NaN). ``dtypes``:
# also hold the arrays to the contract's dtypes (float32 or float64 alike, int32 or int64 ids),
# which the GPU kernels are compiled for; the CPU's Numba kernels compile for what they get.

_ID_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))


def contiguous(kind, name, a, c_contiguous):
    """``a`` (called ``name``), which ``c_contiguous`` (the backend's reading of it) says is
    C-contiguous."""
    if not c_contiguous:
        raise ValueError(f"{kind}: {name} must be C-contiguous, got strides {tuple(a.strides)}")
    return a


def floats(kind, ref, **arrays):
    """``ref`` is float32 or float64 and every array of ``arrays`` has its dtype."""
    if ref.dtype.char not in "fd":
        raise ValueError(f"{kind}: expected float32 or float64 arrays, got {ref.dtype}")
    for name, a in arrays.items():
        if a.dtype != ref.dtype:
            raise ValueError(f"{kind}: {name} is {a.dtype}, expected {ref.dtype}")


def channel_rows(kind, name, shape):
    """(n, C): the n rows of C channels of a (..., C) array called ``name``."""
    shape = tuple(shape)            # a plain tuple: the simulator's shape refuses index -1
    if not shape:
        raise ValueError(f"{kind}: {name} must have a last axis of channels, got a 0-d array")
    c = shape[-1]
    n = 1
    for d in shape:
        n *= d
    return (n // c if c else 0), c


def embedding(kind, ids, weight, rows_name, rows, dtypes=False):
    """ids (n tokens, any shape), weight (V, C) and the token rows (n, C), called
    ``rows_name``."""
    if dtypes:
        floats(kind, weight, **{rows_name: rows})
    w = tuple(weight.shape)
    if len(w) != 2:
        raise ValueError(f"{kind}: weight must be (V, C), got shape {w}")
    if tuple(rows.shape) != (ids.size, w[1]):
        raise ValueError(f"{kind}: ids of {ids.size} tokens and weight {w} need rows of shape "
                         f"{(ids.size, w[1])}, got {tuple(rows.shape)}")
    if (ids.dtype not in _ID_DTYPES) if dtypes else (np.dtype(ids.dtype).kind not in "iu"):
        want = "int32 or int64" if dtypes else "integers"
        raise ValueError(f"{kind}: ids must be {want}, got dtype {ids.dtype}")


def layernorm(kind, rows, vectors, mean, rstd, dtypes=False):
    """(n, C) of LayerNorm's arrays: ``rows`` maps names to (n, C) arrays (x first),
    ``vectors`` names to (C,) ones; mean and rstd hold n values each (float32 or float64 alike
    under ``dtypes``)."""
    (_, x), *others = rows.items()
    n, c = tuple(x.shape)
    if dtypes:
        floats(kind, x, **dict(others), **vectors)
    same_shape(kind, (n, c), **dict(others))
    same_shape(kind, (c,), **vectors)
    for name, a in (("mean", mean), ("rstd", rstd)):
        if a.size != n:
            raise ValueError(f"{kind}: {name} must have {n} elements, got {a.size}")
    if dtypes and (mean.dtype.char not in "fd" or rstd.dtype != mean.dtype):
        raise ValueError(f"{kind}: mean and rstd must be float32 or float64 alike, got "
                         f"{mean.dtype} and {rstd.dtype}")
    return n, c


def elementwise(kind, dtypes=False, **arrays):
    """The keyword arrays (the first is the reference) have as many elements each."""
    (ref_name, ref), *others = arrays.items()
    if dtypes:
        floats(kind, ref, **dict(others))
    for name, a in others:
        if a.size != ref.size:
            raise ValueError(f"{kind}: {name} has {a.size} elements, {ref_name} {ref.size}")


def heads(kind, x, out, rows_side, dtypes=False):
    """(B, T, S, H, D) of a head layout change x -> out; ``rows_side`` ("x" or "out") names the
    (B, T, S, H, D) side, the other is (S, B, H, T, D)."""
    if dtypes:
        floats(kind, x, out=out)
    rows, other, other_name = (x, out, "out") if rows_side == "x" else (out, x, "x")
    dims = tuple(rows.shape)
    if len(dims) != 5:
        raise ValueError(f"{kind}: {rows_side} must be (B, T, S, H, D), got {dims}")
    b, t, s, h, d = dims
    same_shape(kind, (s, b, h, t, d), **{other_name: other})
    return dims


def batched_gemm(a, b, out, trans_a, trans_b, dtypes=False):
    """(G, M, N, K) of out[g] (M, N) = op(a[g]) (M, K) @ op(b[g]) (K, N), three 3-D arrays."""
    a_shape, b_shape, out_shape = tuple(a.shape), tuple(b.shape), tuple(out.shape)
    if len(a_shape) != 3 or len(b_shape) != 3 or len(out_shape) != 3:
        raise ValueError(f"batched_gemm needs 3-D arrays, got {a_shape}, {b_shape} -> "
                         f"{out_shape}")
    if dtypes:
        floats("batched_gemm", out, a=a, b=b)
    op_a = (a_shape[0], a_shape[2], a_shape[1]) if trans_a else a_shape
    op_b = (b_shape[0], b_shape[2], b_shape[1]) if trans_b else b_shape
    g, m, k = op_a
    if op_b[:2] != (g, k) or out_shape != (g, m, op_b[2]):
        raise ValueError(f"batched_gemm shapes do not agree: {op_a} @ {op_b} -> {out_shape}")
    return g, m, op_b[2], k


def causal_scores(kind, dtypes=False, **arrays):
    """(G, T) of the causal softmax's (G, T, T) keyword arrays, all of the first one's shape."""
    (ref_name, ref), *others = arrays.items()
    shape = tuple(ref.shape)
    if len(shape) != 3 or shape[1] != shape[2]:
        raise ValueError(f"{kind}: {ref_name} must be (G, T, T), got {shape}")
    if dtypes:
        floats(kind, ref, **dict(others))
    same_shape(kind, shape, **dict(others))
    return shape[0], shape[1]
