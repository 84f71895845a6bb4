"""comm/buckets.py: the one bucket planner gives exactly the plans of the four planners it
replaced (kept below as oracles, verbatim but for their inputs), on thousands of random spec
lists, and through FusionBuffer and BucketAllreduce themselves."""
import numpy as np
import pytest

from mpitrain.comm import fusion, overlap
from mpitrain.comm.buckets import SOLO_BYTES, Bucket, plan_buckets

F16, F32, F64 = np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)


# --- the replaced planners ---------------------------------------------------------------------

def old_fusion(sizes, dtypes, threshold_bytes, solo_bytes):
    """FusionBuffer._make_plan before comm/buckets.py (without the buffer allocation)."""
    by_dtype = {}
    for i, d in enumerate(dtypes):
        by_dtype.setdefault(np.dtype(d), []).append(i)
    buckets = []
    for dtype, indices in by_dtype.items():
        limit = threshold_bytes // dtype.itemsize
        current = Bucket(dtype)
        for i in indices:
            n = sizes[i]
            if n * dtype.itemsize >= solo_bytes:
                solo = Bucket(dtype)
                solo.add(i, n)
                buckets.append(solo)
                continue
            if current.entries and current.total + n > limit:
                buckets.append(current)
                current = Bucket(dtype)
            current.add(i, n)
        if current.entries:
            buckets.append(current)
    return buckets


def old_overlap(sizes, dtypes, wires, threshold_bytes, solo_bytes):
    """BucketAllreduce._plan before comm/buckets.py (without the flat buffers)."""
    buckets = []
    solo = False
    for i, (n, dtype, wire) in enumerate(zip(sizes, dtypes, wires)):
        alone = wire == dtype and n * wire.itemsize >= solo_bytes
        b = buckets[-1] if buckets else None
        if b is None or b.dtype != wire or alone or solo or \
                (b.entries and (b.total + n) * wire.itemsize > threshold_bytes):
            b = Bucket(wire)
            buckets.append(b)
        solo = alone
        b.add(i, n)
    return buckets


def old_perfmodel_fusion(tensor_bytes, threshold, solo_bytes):
    """benchmarks/perfmodel.py's fusion_plan: [(bucket bytes, tensors in it)]."""
    plan, cur, count = [], 0, 0
    for nb in tensor_bytes:
        if nb >= solo_bytes:
            plan.append((nb, 1))
            continue
        if count and cur + nb > threshold:
            plan.append((cur, count))
            cur, count = 0, 0
        cur, count = cur + nb, count + 1
    if count:
        plan.append((cur, count))
    return plan


def old_perfmodel_consecutive(tensor_bytes, threshold, solo_bytes):
    """benchmarks/perfmodel.py's _consecutive_plan: [(bucket bytes, tensors in it)]."""
    plan, solo = [], False
    for nb in tensor_bytes:
        alone = nb >= solo_bytes
        if not plan or alone or solo or plan[-1][0] + nb > threshold:
            plan.append([0, 0])
        solo = alone
        plan[-1][0] += nb
        plan[-1][1] += 1
    return [tuple(b) for b in plan]


# --- random spec lists -------------------------------------------------------------------------

DTYPES = [F32, F64, F16, np.dtype(np.int32), np.dtype(">f4")]
THRESHOLDS = [0, 1, 3, 4, 7, 64, 100, 1000, 1 << 16, 64 << 20, 1 << 62]
SOLOS = [0, 1, 16, 64, 100, 4096, SOLO_BYTES]


def random_cases(count, seed):
    """(sizes, dtypes, wires, threshold, solo): 0-size arrays, mixed dtypes, float16 wires."""
    rng = np.random.default_rng(seed)
    for _ in range(count):
        k = int(rng.integers(0, 14))
        kinds = rng.integers(0, 5, size=k)
        sizes = [int(s) for s in np.choose(kinds, [
            np.zeros(k, int), np.ones(k, int), rng.integers(2, 40, size=k),
            rng.integers(40, 2000, size=k), rng.integers(100_000, 600_000, size=k)])]
        ndt = int(rng.integers(1, 4))
        dtypes = [DTYPES[j] for j in rng.integers(0, len(DTYPES), size=ndt)]
        dtypes = [dtypes[j] for j in rng.integers(0, ndt, size=k)]
        wires = [F16 if d.kind == "f" and rng.random() < 0.3 else d for d in dtypes]
        yield (sizes, dtypes, wires, int(rng.choice(THRESHOLDS)), int(rng.choice(SOLOS)))


def summary(buckets):
    return [(b.dtype, b.entries, b.total) for b in buckets]


def test_same_plans_as_the_replaced_planners():
    for sizes, dtypes, wires, threshold, solo in random_cases(4000, seed=0):
        case = (sizes, dtypes, wires, threshold, solo)
        assert summary(plan_buckets(sizes, dtypes, threshold, solo)) == \
            summary(old_fusion(sizes, dtypes, threshold, solo)), case
        got = plan_buckets(sizes, wires, threshold, solo, consecutive=True,
                           may_go_solo=[w == d for w, d in zip(wires, dtypes)])
        assert summary(got) == summary(old_overlap(sizes, dtypes, wires, threshold, solo)), case
        # the performance model: float32 gradients, sizes in bytes (a 1-byte dtype)
        nbytes = [4 * n for n in sizes]
        u8 = [np.uint8] * len(sizes)
        for consecutive, old in ((False, old_perfmodel_fusion),
                                 (True, old_perfmodel_consecutive)):
            got = plan_buckets(nbytes, u8, threshold, solo, consecutive=consecutive)
            assert [(b.total, len(b.entries)) for b in got] == old(nbytes, threshold, solo), case


def test_fusion_buffer_and_overlap_plan_as_before(monkeypatch):
    for sizes, dtypes, wires, threshold, solo in random_cases(400, seed=1):
        case = (sizes, dtypes, wires, threshold, solo)
        monkeypatch.setattr(fusion, "SOLO_BYTES", solo)
        monkeypatch.setattr(overlap, "SOLO_BYTES", solo)
        arrays = [np.zeros(n, d) for n, d in zip(sizes, dtypes)]
        got = fusion.FusionBuffer(threshold).plan(arrays)
        assert summary(got) == summary(old_fusion(sizes, dtypes, threshold, solo)), case
        specs = [((n,), d) for n, d in zip(sizes, dtypes)]
        got = overlap.BucketAllreduce(specs, threshold, None, {}, wire_dtypes=wires)._plan()
        want = old_overlap(sizes, dtypes, wires, threshold, solo)
        assert summary(got) == summary(want), case
        assert [b.index for b in got] == list(range(len(want)))
        assert [b.flat is None for b in got] == [
            len(b.entries) == 1 and wires[b.entries[0][0]] == dtypes[b.entries[0][0]]
            for b in want], case


def test_worked_example_of_the_docstring():
    sizes = [8, 30, 4, 8]                                   # a, b, c, d: 32, 120, 16, 32 bytes
    plans = {c: plan_buckets(sizes, [F32] * 4, 64, solo_bytes=100, consecutive=c)
             for c in (False, True)}
    assert [[e[0] for e in b.entries] for b in plans[False]] == [[1], [0, 2], [3]]
    assert [[e[0] for e in b.entries] for b in plans[True]] == [[0], [1], [2, 3]]
    assert plans[False][1].entries == [(0, 0, 8), (2, 8, 4)]      # (index, offset, length)


def test_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="3 sizes but 2 dtypes"):
        plan_buckets([1, 2, 3], [F32, F32], 64)
