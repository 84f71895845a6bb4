"""Host side of the contract's elementwise, dense, row (softmax), window-pooling, layout and
im2col kernels, shared by the device backends and, for the rows and windows, the CPU
(kernels/norm_shape.py is the same for the normalisation kernels).

Both GPU backends launch their kernels over sizes taken from one array and must refuse the others
before launching when they do not match (a kernel would read or write out of bounds, or silently
skip elements). The arithmetic and the one-line messages live here once. (kernels/cpu_conv.py
plans with ``out_size``; kernels/cpu.py's ``njit`` im2col computes the sizes inside the kernel.)
"""


def same_size(kind, ref, *others):
    """Every array of ``others`` has as many elements as ``ref``."""
    for a in others:
        if a.size != ref.size:
            raise ValueError(f"{kind}: sizes differ ({a.size} vs {ref.size})")


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


def xent(kind, logits, labels, grad, losses):
    """logits (B, K), labels (B,), grad (B, K), losses (B,): the cross-entropy's arrays."""
    if (logits.ndim != 2 or tuple(labels.shape) != (logits.shape[0],)
            or tuple(grad.shape) != tuple(logits.shape)
            or tuple(losses.shape) != (logits.shape[0],)):
        raise ValueError(f"{kind}: logits {tuple(logits.shape)}, labels {tuple(labels.shape)}, "
                         f"grad {tuple(grad.shape)}, losses {tuple(losses.shape)} do not match")
