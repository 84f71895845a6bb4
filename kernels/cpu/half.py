"""IEEE 754 half precision (float16) for Numba CPU kernels, as bit patterns.

Numba has no float16 type on the CPU: an ``njit`` function cannot load, store or do arithmetic on a
float16 array. The fallback, NumPy's float16 ufuncs and casts, emulates every element in C at
2-6 ns each, which made fp16 gradient compression (``--fp16-allreduce``) a 7x slowdown of a
training step. So the CPU kernels view float16 arrays as uint16 (``a.view(np.uint16)``) and convert
in registers with the helpers below, which LLVM inlines and vectorises.

The helpers reproduce NumPy's conversions bit for bit (numpy/_core/src/npymath/halffloat.cpp,
``npy_halfbits_to_floatbits`` and ``npy_floatbits_to_halfbits``), which the unit tests check on
all 65536 halves and on every rounding boundary:

    half -> float32   exact: normals, subnormals, +-0, +-inf; a NaN keeps its sign and its
                      payload shifted up 13 bits (a signalling NaN stays signalling).
    float32 -> half   round to nearest, ties to even; magnitudes from 65520 up become inf;
                      below 2**-14 they round to a subnormal or a signed zero; a NaN keeps its sign
                      and the top 10 payload bits, and becomes 0x7c01 (still a NaN) if those are
                      all zero. Not via F16C: the hardware would quiet signalling NaNs, NumPy does
                      not. Unlike NumPy, no floating-point warning is raised on overflow.

NumPy's float16 ufuncs compute in float32 and round once, which is what ``round_half(float(a) op
float(b))`` here does. For + and * that single rounding equals the correctly rounded half result
(float32 carries 24 >= 2*11 + 2 bits, so double rounding cannot hurt), so the bits match NumPy's.

Bit patterns travel as int32 (a float32's sign in bit 31). Numba widens every integer operation to
64 bits; the np.int32(...) around each step narrows it back, which lets LLVM vectorise with twice
the lanes (measured 1.7-2.5x faster than int64).
"""
import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

HALF_EXP = 0x7C00        # exponent field of a half; all ones: inf or NaN
HALF_QUIET = 0x0200      # the quiet bit of a half NaN (float32's 0x00400000 shifted down 13)
_F32_INF = 0x7F800000
_F32_HALF_MAX = 0x47800000           # 65536.0: from here on the half is inf (or NaN)
_F32_HALF_MIN_NORMAL = 0x38800000    # 2**-14: below it the half is subnormal or zero
_F32_REBIAS = 0x38000000             # (127 - 15) << 23: float32 exponent bias minus half's
_F32_DENORM_MAGIC = 0x3F000000       # 0.5f: adding it puts 2**-24 (a half subnormal's unit) at
#                                      float32's last mantissa bit, so the FPU rounds for us
_DENORM_MAGIC = np.float32(0.5)
_TWO_M24 = np.float32(2.0 ** -24)    # value of the half subnormal unit


@intrinsic
def float32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is an int32 (a register bitcast)."""
    if bits != types.int32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(bits), codegen


@intrinsic
def float32_bits(typingctx, value):
    """The bit pattern of a float32, as an int32 (a register bitcast)."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.int32(value), codegen


@njit(cache=True, nogil=True)
def half_to_float32(h):
    """The float32 value of the half with bits h (any integer holding 0..0xFFFF)."""
    h = np.int32(h)
    sign = np.int32((h & 0x8000) << 16)
    mag = np.int32(h & 0x7FFF)
    normal = np.int32((mag + 0x1C000) << 13)           # rebias the exponent by 112, shift
    # subnormal (or zero): mantissa * 2**-24 is exact in float32
    sub = np.int32(float32_bits(np.float32(mag) * _TWO_M24))
    special = np.int32((mag << 13) | _F32_INF)         # inf, or NaN with its payload
    bits = normal if mag >= 0x0400 else sub
    bits = special if mag >= HALF_EXP else bits
    return float32_from_bits(np.int32(bits | sign))


@njit(cache=True, nogil=True)
def float32_bits_to_half(f):
    """Half bits (int32) of the float32 with bits f: NumPy's rounding and NaN rule (see top)."""
    f = np.int32(f)                                    # a uint32 wraps: the sign is bit 31
    sign = np.int32((f >> 16) & 0x8000)
    mag = np.int32(f & 0x7FFFFFFF)
    # normal half: rebias, then round to nearest even by adding 0xFFF plus the kept lowest bit;
    # a carry into the exponent is the correct next binade (or inf at 65520 and above)
    normal = np.int32((mag - _F32_REBIAS + 0xFFF + ((mag >> 13) & 1)) >> 13)
    # subnormal half: the float32 addition rounds to the 2**-24 unit; its low bits are the half
    sub = np.int32(float32_bits(float32_from_bits(mag) + _DENORM_MAGIC) - _F32_DENORM_MAGIC)
    nan = np.int32(HALF_EXP | ((mag >> 13) & 0x3FF))
    nan = nan if nan != HALF_EXP else np.int32(HALF_EXP + 1)   # payload only in low bits: NaN
    h = normal if mag >= _F32_HALF_MIN_NORMAL else sub
    h = np.int32(HALF_EXP) if mag >= _F32_HALF_MAX else h
    h = nan if mag > _F32_INF else h
    return np.int32(h | sign)


@njit(cache=True, nogil=True)
def float32_to_half(x):
    """Half bits (int32) of the float32 value x, rounded as NumPy's astype(np.float16)."""
    return float32_bits_to_half(float32_bits(np.float32(x)))


@njit(cache=True, nogil=True)
def is_nan(h):
    """True where the half bits h hold a NaN."""
    return (np.int32(h) & 0x7FFF) > HALF_EXP


# The float16 array kernels of kernels/cpu/arrays.py (the fp16 compression's wire dtype), on
# uint16 bit patterns with NumPy's results bit for bit: each element is computed in float32 and
# rounded to half once, as NumPy's float16 ufuncs do. NaN results follow NumPy's too: the second
# operand's NaN, quieted, if it is one, else the first's (the FPU picks any one of two; this pins
# it). The reductions' min/max keep dst when equal or when dst is NaN, else take a NaN src (NumPy's
# minimum/maximum propagate NaN, bits unchanged).

@njit(cache=True, nogil=True)
def from_float32(dst, src):
    """dst (uint16 half bits) = src (float32 bits as uint32), rounded as NumPy's astype."""
    for i in range(dst.size):
        dst[i] = float32_bits_to_half(src[i])


@njit(cache=True, nogil=True)
def to_float32(dst, src):
    """dst (float32) = src (uint16 half bits), exact."""
    for i in range(dst.size):
        dst[i] = half_to_float32(src[i])


@njit(cache=True, nogil=True)
def _nan_rule(a, b, h):
    """h, unless a or b is a NaN: then b quieted if b is one, else a quieted (half bits)."""
    h = a | HALF_QUIET if is_nan(a) else h
    return b | HALF_QUIET if is_nan(b) else h


@njit(cache=True, nogil=True)
def scale(a, factor):
    """a (uint16 half bits) *= factor (float32), in float32, rounded once."""
    nan_factor = factor != factor       # then every result is the factor's NaN, quieted
    quiet_factor = float32_bits_to_half(float32_bits(factor) | 0x400000)
    for i in range(a.size):
        h = a[i]
        r = float32_to_half(half_to_float32(h) * factor)
        r = h | HALF_QUIET if is_nan(h) else r
        a[i] = quiet_factor if nan_factor else r


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _block_sum(a, start, stop):
    """Exact float64 sum of a[start:stop] (half bits) when stop - start <= 2**13 (see below)."""
    block = 0.0
    for i in range(start, stop):
        block += np.float64(half_to_float32(a[i]))
    return block


@njit(cache=True, nogil=True)
def sum_float64(a, chunk):
    """NumPy's a.sum(dtype=float64): exact sums of chunk-element blocks, added in order.

    NumPy converts float16 to float64 in buffers of ``chunk`` elements and adds each buffer's
    pairwise sum to the total. A half is a multiple of 2**-24 below 2**16, so a block of at most
    2**13 of them sums exactly in float64 in any order (hence reassoc in the block sum, which lets
    LLVM vectorise it); only the block-to-total additions round, in NumPy's order.
    """
    total = 0.0
    for start in range(0, a.size, chunk):
        total = total + _block_sum(a, start, min(a.size, start + chunk))
    return total


EXACT_BLOCK = 1 << 13   # the largest block of halves whose float64 sum is always exact


@njit(cache=True, nogil=True)
def _reduce_sum(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        r = float32_to_half(half_to_float32(a) + half_to_float32(b))
        dst[i] = _nan_rule(a, b, r)


@njit(cache=True, nogil=True)
def _reduce_prod(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        r = float32_to_half(half_to_float32(a) * half_to_float32(b))
        dst[i] = _nan_rule(a, b, r)


@njit(cache=True, nogil=True)
def _reduce_min(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        keep = half_to_float32(a) <= half_to_float32(b) or is_nan(a)
        dst[i] = a if keep else b


@njit(cache=True, nogil=True)
def _reduce_max(dst, src):
    for i in range(dst.shape[0]):
        a, b = dst[i], src[i]
        keep = half_to_float32(a) >= half_to_float32(b) or is_nan(a)
        dst[i] = a if keep else b


REDUCE = {"sum": _reduce_sum, "prod": _reduce_prod, "min": _reduce_min, "max": _reduce_max}
