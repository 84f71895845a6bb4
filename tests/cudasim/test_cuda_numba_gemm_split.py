"""The Numba GEMM's split K: when the rule splits, the result is deterministic and within float32
rounding of the unsplit GEMM (kernel_cases.py's gemm-splitk cases compare it with the CPU).

Shapes follow the module's constants, so on a real GPU (without NUMBA_ENABLE_CUDASIM) these tests
split K as they do in the simulator."""
import numpy as np
import pytest


def _long_k(dev):
    """(M, K, N): 2 x 2 output tiles and a K that the rule splits."""
    edge = dev.dense.TILE * dev.dense.MICRO + 1
    return edge, (8 * dev.dense._SPLIT_MIN_STAGES + 3) * dev.dense.TILE, edge


def test_rule_splits_few_tiles_with_a_long_k(dev):
    wanted = dev.dense._gemm_blocks_wanted()
    stages_min = dev.dense._SPLIT_MIN_STAGES
    for tiles in (1, 2, 3, 4, 13, wanted - 1):
        for stages in (2 * stages_min, 8 * stages_min + 3, 103 * stages_min + 2,
                       1000 * stages_min + 1):
            kdim = stages * dev.dense.TILE - 1                   # a partial last K-stage
            splits = dev.dense._gemm_splits(tiles, kdim)
            per = -(-stages // splits)                      # K-stages per split, as the kernel
            assert splits > 1, (tiles, kdim)
            assert (splits - 1) * per < stages <= splits * per, "an empty or missing split"
            assert per >= stages_min, "a split shorter than its minimum"
            assert tiles * splits < wanted + tiles, "more blocks than the GPU needs"


def test_rule_keeps_k_whole(dev):
    """Enough tiles to fill the GPU, or a K too short to share: one split over all of K."""
    wanted = dev.dense._gemm_blocks_wanted()
    short = (2 * dev.dense._SPLIT_MIN_STAGES - 1) * dev.dense.TILE
    long = 1000 * dev.dense._SPLIT_MIN_STAGES * dev.dense.TILE
    for tiles, kdim in ((wanted, long), (10 * wanted, long), (1, short), (4, short), (1, 0)):
        assert dev.dense._gemm_splits(tiles, kdim) == 1, (tiles, kdim)


@pytest.mark.parametrize("trans_a, trans_b, accumulate", [(False, False, False),
                                                          (True, False, True),
                                                          (False, True, True)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_split_gemm_is_deterministic_and_matches_unsplit(dev, monkeypatch, trans_a, trans_b,
                                                         accumulate, dtype):
    m, k, n = _long_k(dev)
    tiles = 4
    assert dev.dense._gemm_splits(tiles, k) > 1, "the shape must split K"
    rng = np.random.default_rng(7)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    out0 = rng.standard_normal((m, n)).astype(dtype)
    da, db = dev.to_device(a), dev.to_device(b)

    def run():
        out = dev.to_device(out0)
        dev.gemm(da, db, out, trans_a, trans_b, accumulate)
        return dev.to_host(out)

    split = run()
    assert split.tobytes() == run().tobytes(), "two runs of the split GEMM differ"
    monkeypatch.setattr(dev.dense, "_SPLIT_MIN_STAGES", 10**9)        # one split: the plain GEMM
    assert dev.dense._gemm_splits(tiles, k) == 1
    whole = run()
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    want = op_a.astype(np.float64) @ op_b.astype(np.float64) + (out0 if accumulate else 0)
    # float32 rounding of a K-term sum: a few ulps of the sum of |products|
    bound = np.abs(op_a).astype(np.float64) @ np.abs(op_b) + np.abs(out0) * accumulate
    ulp = np.finfo(dtype).eps
    assert np.all(np.abs(split - whole) <= 2 * k * ulp * bound)
    assert np.all(np.abs(split - want) <= k * ulp * bound)
    assert np.all(np.abs(whole - want) <= k * ulp * bound)
