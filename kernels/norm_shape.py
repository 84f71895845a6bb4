"""Host side of the normalisation, pooling and shortcut kernels, shared by the device backends.

Both GPU backends launch these kernels over flat indices computed from the shapes, so a wrong
shape would read or write out of bounds instead of raising. The checks, their one-line messages
and the (N, C, L) view of a BatchNorm input (L = H*W, 1 for BatchNorm1d) live here once; the CPU
wrappers (kernels/cpu_norm.py) use the same ones, so all three backends word an error alike.
"""
import numpy as np


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


def pool(kind, image_shape, pooled_shape):
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
