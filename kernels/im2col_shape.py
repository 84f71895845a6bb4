"""Host side of the contract's im2col / col2im, shared by the device backends.

Both GPU backends launch their kernels with the output size of the convolution and must refuse a
``cols`` buffer of the wrong shape before launching (a kernel would write out of bounds, or
silently skip elements). The arithmetic and the message live here once. (kernels/cpu_conv.py
plans with ``out_size``; kernels/cpu.py's ``njit`` im2col computes the sizes inside the kernel.)
"""


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
