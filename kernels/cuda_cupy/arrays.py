"""The CuPy flavour's array plumbing (dev, flat, scalar and the RawKernel launches of every
module), its memory kernels and reduce_into. Without CuPy or a usable CUDA device, importing it
raises ImportError with one line saying what to install or which flag to use (the CLI: exit 2).
"""
import numpy as np

from mpitrain.kernels import checks

try:
    import cupy as cp
except ImportError as _exc:
    raise ImportError(f"--kernels cupy needs CuPy ({_exc}); install it with "
                      "pip install -e '.[cuda]' or use --kernels numba") from None
try:
    _DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception as _exc:  # noqa: BLE001 - CUDARuntimeError and friends: no driver/device
    raise ImportError(f"--kernels cupy: no usable CUDA device ({_exc})") from None
if _DEVICES < 1:
    raise ImportError("--kernels cupy: no CUDA device is visible")

_OPS = {"sum": cp.add, "prod": cp.multiply, "min": cp.minimum, "max": cp.maximum}


def dev(a):
    """A CuPy array for ``a`` (zero-copy for other CUDA arrays); refuse host arrays."""
    if isinstance(a, cp.ndarray):
        return a
    if hasattr(a, "__cuda_array_interface__"):
        return cp.asarray(a)
    raise TypeError(f"cuda-cupy kernels need device arrays, got {type(a).__name__}; "
                    "copy host data with kernels.to_device")


def flat(a):
    return checks.flat(dev(a))


def scalar(a, value):
    """``value`` as a scalar of ``a``'s dtype (the kernels' T)."""
    return a.dtype.type(value)


# One RawKernel per source and dtype, compiled at first use.
_raw_kernels = {}


def raw_kernel(source, kernel_name, dtype):
    """The RawKernel of ``source`` with T = ``dtype`` (float32 or float64), compiled once."""
    key = (kernel_name, dtype.name)
    if key not in _raw_kernels:
        ctype = {"float32": "float", "float64": "double"}[dtype.name]
        _raw_kernels[key] = cp.RawKernel(f"typedef {ctype} T;\n" + source, kernel_name)
    return _raw_kernels[key]


def launch_rows(source, kernel_name, dtype, rows, args):
    """``rows`` threads in blocks of 128 (none when ``rows`` is 0)."""
    if rows:
        threads = 128
        raw_kernel(source, kernel_name, dtype)(((rows + threads - 1) // threads,), (threads,), args)


_GRID_MAX = 65535                        # gridDim.y and .z; the kernels loop over the rest


def launch_planes(source, kernel_name, dtype, pixels, rows, images, args):
    """A grid of ``pixels`` threads in blocks of 128, by ``rows``, by ``images`` (the kernel
    loops over what exceeds _GRID_MAX)."""
    threads = 128
    grid = ((pixels + threads - 1) // threads, min(rows, _GRID_MAX), min(images, _GRID_MAX))
    raw_kernel(source, kernel_name, dtype)(grid, (threads,), args)


def empty(shape, dtype=np.float32):
    return cp.empty(shape, dtype=dtype)


def zeros(shape, dtype=np.float32):
    return cp.zeros(shape, dtype=dtype)


def to_device(host):
    return cp.array(host, copy=True, order="C")


def to_host(a):
    return cp.asnumpy(dev(a))


def synchronize():
    cp.cuda.get_current_stream().synchronize()


def fill(a, value):
    dev(a).fill(value)


def copy(dst, src):
    dst, src = flat(dst), flat(src)
    checks.same_size("copy", src, dst)
    cp.copyto(dst, src, casting="unsafe")


cast = copy                                              # copyto converts to dst's dtype


# integers scale in float64 and truncate toward zero, as on the CPU
_scale_int = cp.ElementwiseKernel("float64 f", "T a", "a = (T)(a * f)", "mpitrain_scale_int")


def scale(a, factor):
    a = flat(a)
    if a.dtype.kind == "f":
        a *= scalar(a, factor)
    else:
        _scale_int(float(factor), a)


def add(dst, src):
    dst, src = flat(dst), flat(src)
    checks.same_size("add", src, dst)
    dst += src


def total(a):
    return float(dev(a).sum(dtype=cp.float64))


def reduce_into(dst, src, op):
    if op not in _OPS:
        raise ValueError(f"unknown reduction op {op!r}; expected one of {sorted(_OPS)}")
    dst, src = flat(dst), flat(src)
    checks.same_size("reduce_into", src, dst)
    _OPS[op](dst, src, out=dst)
