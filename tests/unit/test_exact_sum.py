"""The exact sum of float32 squares (mpitrain/nn/exact_sum.py): equal to the rational sum
rounded once, whatever the cut into pieces and the order they are added in; infinities and NaN
as a float sum gives them; subnormals and the largest floats included."""
from fractions import Fraction

import numpy as np
import pytest

from mpitrain.nn.exact_sum import SquareSum, exact_square_sum


def rational(a):
    return float(sum(Fraction(float(x)) ** 2 for x in a))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_sum_is_the_rational_sum_rounded_once(seed):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(3000) * 10.0 ** rng.integers(-30, 30, 3000)).astype(np.float32)
    assert exact_square_sum([a]) == rational(a)


def test_any_cut_and_any_order_gives_the_same_bits():
    rng = np.random.default_rng(5)
    a = (rng.standard_normal(70000) * 10.0 ** rng.integers(-8, 8, 70000)).astype(np.float32)
    whole = exact_square_sum([a])
    pieces = [a[i:j] for i, j in [(0, 11), (11, 40000), (40000, 70000)]]
    apart = [SquareSum().add_array(p) for p in pieces]
    total = SquareSum()
    for s in reversed(apart):
        total.add(s.bins, s.flag)
    assert total.value() == whole == exact_square_sum(pieces[::-1])


def test_extremes_and_non_finite_values():
    edge = np.array([1e-45, 3e-42, 1e-39, 3.4e38, 3.4e38, 0.0, -2.0], np.float32)
    assert exact_square_sum([edge]) == rational(edge)
    assert exact_square_sum([np.array([1.0, np.inf], np.float32)]) == np.inf
    assert np.isnan(exact_square_sum([np.array([np.inf, np.nan], np.float32)]))
    with pytest.raises(TypeError, match="float32"):
        SquareSum().add_array(np.ones(3))
