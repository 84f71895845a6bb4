"""float16 on the CPU (kernels/cpu/half.py, the float16 paths of kernels/cpu/arrays.py) vs NumPy.

Everything is compared bit for bit (``.view(np.uint16)``), NaN payloads included: NumPy's choice
of NaN is deterministic (the second operand's, quieted; min/max keep the first, unquieted) and the
kernels pin the same rule. Random arrays are drawn as random bit patterns, so about 3% of their
elements are NaN, 3% inf or subnormal, and both signs of zero appear.
"""
import warnings

import numpy as np
import pytest

from mpitrain.kernels import cpu

LENGTHS = (0, 1, 7, 1000003)
OPS = {"sum": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}


@pytest.fixture(autouse=True)
def _quiet_numpy():
    # NumPy warns on overflow/invalid in float16 casts and ufuncs; the kernels do not.
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def random_half(rng, n):
    return rng.integers(0, 1 << 16, n, dtype=np.uint16).view(np.float16)  # (n,)


def assert_bits_equal(got, want):
    g, w = got.view(np.uint16), want.view(np.uint16)
    bad = np.flatnonzero(g != w)
    assert g.shape == w.shape and bad.size == 0, \
        f"{bad.size} elements differ, first at {bad[:3]}: got {[hex(g[i]) for i in bad[:3]]}, " \
        f"want {[hex(w[i]) for i in bad[:3]]}"


def f32_from_bits(bits):
    return np.asarray(bits, dtype=np.uint64).astype(np.uint32).view(np.float32)


# --- the conversions --------------------------------------------------------------------------

def test_every_half_to_float32_is_numpys():
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16)    # all 65536 patterns
    out = np.empty(h.size, np.float32)
    cpu.cast(out, h)
    assert np.array_equal(out.view(np.uint32), h.astype(np.float32).view(np.uint32))


def _rounding_cases():
    """float32 values on and around every half rounding decision."""
    h = np.arange(0x7C00, dtype=np.uint16).view(np.float16)     # every finite half >= +0
    lo = h.astype(np.float64)
    mid = (lo[:-1] + lo[1:]) / 2                                 # the ties, exact in float32
    top = np.array([65504.0, 65519.0, 65520.0, 65536.0, 2.0 ** 17, 3.4e38])  # 65520 is a tie
    small = np.array([2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -26, 2.0 ** -14,
                      2.0 ** -14 - 2.0 ** -25, 1e-40, 1e-45])   # subnormal and underflow
    vals = np.concatenate([lo, mid, top, small]).astype(np.float32)
    bits = vals.view(np.uint32).astype(np.int64)
    near = np.concatenate([bits, bits + 1, bits - 1, bits + 0x800])
    near = near[(near >= 0) & (near < 0x7F800000)]
    specials = [0x7F800000, 0x7F800001, 0x7F801FFF, 0x7F802000, 0x7FA00000, 0x7FC00000,
                0x7FFFFFFF, 0x7FBFFFFF, 0x00000000, 0x00000001, 0x007FFFFF, 0x00800000]
    pos = np.concatenate([near, specials])
    return f32_from_bits(np.concatenate([pos, pos | 0x80000000]))    # both signs


@pytest.mark.parametrize("cases", ["rounding", "random"])
def test_float32_to_half_is_numpys(cases):
    if cases == "rounding":
        x = _rounding_cases()
    else:
        x = f32_from_bits(np.random.default_rng(1).integers(0, 1 << 32, 1 << 20))
    got = np.empty(x.size, np.float16)
    cpu.cast(got, x)
    assert_bits_equal(got, x.astype(np.float16))


def test_conversion_examples():
    # Hand-checked anchors, independent of NumPy.
    x = np.array([1.0, 65504.0, 65519.996, 65520.0, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -25,
                  1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, -0.0], np.float32)
    got = np.empty(x.size, np.float16)
    cpu.cast(got, x)
    assert got.view(np.uint16).tolist() == [0x3C00, 0x7BFF, 0x7BFF, 0x7C00, 0x0001, 0x0000,
                                             0x0002, 0x3C00, 0x3C02, 0x8000]
    nan = f32_from_bits([0x7F800001, 0xFFC00000, 0x7FA00000])   # payload below the top 10 bits
    cpu.cast(got[:3], nan)
    assert got[:3].view(np.uint16).tolist() == [0x7C01, 0xFE00, 0x7D00]


# --- the cpu.py float16 kernels ---------------------------------------------------------------

@pytest.mark.parametrize("op", sorted(OPS))
def test_reduce_into_half_is_numpys(op):
    rng = np.random.default_rng(2)
    for n in LENGTHS:
        dst, src = random_half(rng, n), random_half(rng, n)
        want = OPS[op](dst, src)
        cpu.reduce_into(dst, src, op)
        assert_bits_equal(dst, want)


def test_reduce_into_half_nan_rule():
    q1, q2, s1, one = 0x7E01, 0x7E02, 0x7C01, 0x3C00             # quiet, quiet, signalling, 1.0
    a = np.array([q1, s1, one, q1, s1], np.uint16)
    b = np.array([q2, one, s1, 0xFE03, q2], np.uint16)
    for op, want in [("sum", [q2, 0x7E01, 0x7E01, 0xFE03, q2]),
                     ("min", [q1, s1, s1, q1, s1]), ("max", [q1, s1, s1, q1, s1])]:
        d = a.copy().view(np.float16)
        cpu.reduce_into(d, b.view(np.float16), op)
        assert d.view(np.uint16).tolist() == want, op
    z = np.array([0.0, -0.0], np.float16)
    cpu.reduce_into(z, np.array([-0.0, 0.0], np.float16), "min")    # equal: dst kept
    assert z.view(np.uint16).tolist() == [0x0000, 0x8000]


def test_reduce_into_half_strided_slices():
    rng = np.random.default_rng(3)
    buf, src = random_half(rng, 101), random_half(rng, 101)
    want = buf.copy()
    np.add(want[10:60:2], src[::2][:25], out=want[10:60:2])
    cpu.reduce_into(buf[10:60:2], src[::2][:25], "sum")
    assert_bits_equal(buf, want)


def test_add_half_is_numpys():
    rng = np.random.default_rng(4)
    for n in LENGTHS:
        dst, src = random_half(rng, n), random_half(rng, n)
        want = dst + src
        cpu.add(dst, src)
        assert_bits_equal(dst, want)
    mixed = np.ones(3, np.float16)                                    # float32 src: NumPy's path
    cpu.add(mixed, np.full(3, 1e-3, np.float32))
    assert_bits_equal(mixed, (np.ones(3, np.float16) + np.full(3, 1e-3, np.float32))
                      .astype(np.float16))


# Python floats and ints are weak (NEP 50): NumPy turns them into float16 first; a float32 factor
# multiplies in float32; a float64 scalar goes to NumPy's float64 loop.
FACTORS = [0.1, 1 / 3, 3, -2.5, 1e-7, 1e5, float("nan"), float("inf"), np.float16(0.7),
           np.float32(0.3), np.float32(1e-9), np.float32(np.nan), f32_from_bits(0x7F800001)[()],
           np.float64(0.1)]


@pytest.mark.parametrize("factor", FACTORS, ids=repr)
def test_scale_half_is_numpys(factor):
    rng = np.random.default_rng(5)
    for n in LENGTHS:
        a = random_half(rng, n)
        want = a.copy()
        np.multiply(want, factor, out=want, casting="unsafe")
        cpu.scale(a, factor)
        assert_bits_equal(a, want)


@pytest.mark.parametrize("value", [0.1, -0.0, 3, 65519.9, 65520.0, 1e-8, float("nan"),
                                   np.float32(2.0 ** -25 * 3), np.float64(1 / 3)], ids=repr)
def test_fill_half_is_numpys(value):
    for n in LENGTHS:
        a = np.empty(n, np.float16)
        want = np.empty(n, np.float16)
        want.fill(value)
        cpu.fill(a, value)
        assert_bits_equal(a, want)


def test_cast_and_copy_half_are_numpys():
    rng = np.random.default_rng(6)
    for n in LENGTHS:
        h = random_half(rng, n).reshape(n, 1)                         # any shape, flat inside
        f = f32_from_bits(rng.integers(0, 1 << 32, n)).reshape(n, 1)
        for fn in (cpu.cast, cpu.copy):
            got16 = np.empty((n, 1), np.float16)
            fn(got16, f)
            assert_bits_equal(got16, f.astype(np.float16))
            got32 = np.empty((n, 1), np.float32)
            fn(got32, h)
            assert np.array_equal(got32.view(np.uint32), h.astype(np.float32).view(np.uint32))
            same = np.empty((n, 1), np.float16)
            fn(same, h)
            assert_bits_equal(same, h)
    d64 = np.empty(3, np.float64)                                     # other pairs: NumPy
    cpu.cast(d64, np.array([1, 2, 3], np.float16))
    assert d64.tolist() == [1.0, 2.0, 3.0]


def test_total_half_is_numpys():
    rng = np.random.default_rng(7)
    for n in LENGTHS:
        h = random_half(rng, n)
        h = h[np.isfinite(h)]
        assert cpu.total(h) == float(h.sum(dtype=np.float64))
    # Large values with tiny ones across NumPy's 8192-element buffers: here the order of the
    # roundings decides the last bits, so only NumPy's own order gives NumPy's result.
    for trial in range(20):
        n = int(rng.integers(3 * 8192, 9 * 8192))
        h = np.full(n, 65504, np.float16)
        h[rng.integers(0, n, 2000)] = (rng.standard_normal(2000) * 1e-3).astype(np.float16)
        h[rng.integers(0, n, 2000)] *= -1
        assert cpu.total(h) == float(h.sum(dtype=np.float64)), trial
    assert np.isnan(cpu.total(np.array([1, np.inf, -np.inf], np.float16)))
    assert cpu.total(np.array([1, np.inf], np.float16)) == np.inf
    assert np.copysign(1, cpu.total(np.array([-0.0], np.float16))) == 1.0   # as NumPy: +0.0


def test_half_kernels_validate_like_the_others():
    h = np.zeros((4, 4), np.float16)
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.fill(h.T, 1.0)
    with pytest.raises(ValueError, match="size mismatch"):
        cpu.cast(h, np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        cpu.cast(np.zeros(16, np.float32), h.T)
