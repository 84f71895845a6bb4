"""Host side of the contract's elementwise, dense, layout and im2col kernels, shared by the
device backends (kernels/norm_shape.py is the same for the normalisation kernels).

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
