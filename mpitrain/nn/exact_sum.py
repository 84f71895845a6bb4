"""The exact sum of squares of float32 arrays, in pieces that combine in any order.

A global gradient norm summed in floating point depends on the order of the additions, so it
changes with how the gradients are cut: into parameters, into buckets, into the slices the ranks
of a sharded optimizer own. ``mt.nn.clip_grad_norm_`` needs the same bits whatever the cut (a
sharded run must clip as the unsharded one does), so on the CPU it sums the squares exactly.

A float32 ``x`` is ``M * 2**e`` with an integer ``M < 2**24``, so ``x * x = M*M * 2**(2e)``
with ``M*M < 2**48``: an integer at a power of two. ``SquareSum`` adds each into a long
accumulator, one int64 per power of two (``bins[j]`` counts units of ``2**(j - BIAS)``),
carrying the high bits of a bin 32 places up before it can overflow -- integers, so no
rounding, so the total is the same for any order and any cut. Pieces made apart (each rank's
slices) are added bin by bin (``add``, or an MPI sum of the bins: each bin stays below 2**32
after ``normalise``). ``value()`` rounds the exact total to the nearest double once.
"""
import math
from fractions import Fraction

import numba
import numpy as np

BIAS = 298              # bin j: units of 2**(j - BIAS); the smallest square is 2**-298
BINS = 640              # the largest square is 2**(506 - BIAS) * M*M (< 2**48), carries above
_CARRY_EVERY = 1 << 14  # adds of < 2**48 into one bin below 2**32: stays below 2**63


@numba.njit(cache=True, nogil=True)
def _add_squares(bits, bins):
    """Add the squares of float32 values (``bits``: their uint32 view) into ``bins``; returns
    1 if one was infinite, 2 if one was NaN (0 otherwise)."""
    flag = 0
    count = 0
    for i in range(bits.shape[0]):
        b = bits[i]
        exponent = (b >> 23) & 0xFF
        mantissa = np.int64(b & 0x7FFFFF)
        if exponent == 0xFF:
            flag = max(flag, 2 if mantissa != 0 else 1)
            continue
        if exponent == 0:               # subnormal: m * 2**(0 - 149)
            if mantissa == 0:
                continue
            shift = 0
        else:                           # normal: (2**23 + m) * 2**((E - 1) - 149)
            mantissa |= np.int64(0x800000)
            shift = exponent - 1        # x * x = M*M * 2**(2 * shift - BIAS)
        bins[2 * shift] += mantissa * mantissa
        count += 1
        if count == _CARRY_EVERY:
            _normalise(bins)
            count = 0
    return flag


@numba.njit(cache=True, nogil=True)
def _normalise(bins):
    """Carry every bin's bits above 32 into the bin 32 places up (the value is unchanged)."""
    for j in range(bins.shape[0] - 32):
        carry = bins[j] >> 32
        if carry:
            bins[j] &= 0xFFFFFFFF
            bins[j + 32] += carry


class SquareSum:
    """An exact sum of squares: ``add_array`` float32 arrays, ``add`` another SquareSum (or
    its ``bins`` summed elsewhere), ``value()`` the nearest double. ``flag``: 1 when an
    infinity was added, 2 when a NaN was."""

    def __init__(self):
        self.bins = np.zeros(BINS, np.int64)
        self.flag = 0

    def add_array(self, a):
        a = np.ascontiguousarray(a)
        if a.dtype != np.float32:
            raise TypeError(f"SquareSum sums float32 squares exactly, got {a.dtype}")
        self.flag = max(self.flag, int(_add_squares(a.reshape(-1).view(np.uint32), self.bins)))
        _normalise(self.bins)
        return self

    def add(self, bins, flag=0):
        self.bins += bins
        self.flag = max(self.flag, int(flag))
        _normalise(self.bins)
        return self

    def value(self):
        """The total, rounded once to the nearest double (inf or NaN as the inputs were)."""
        if self.flag:
            return math.nan if self.flag == 2 else math.inf
        total = sum(int(v) << j for j, v in enumerate(self.bins) if v)
        return float(Fraction(total, 1 << BIAS))


def exact_square_sum(arrays):
    """The sum of the squares of every element of float32 ``arrays``, exactly, then rounded."""
    s = SquareSum()
    for a in arrays:
        s.add_array(a)
    return s.value()
