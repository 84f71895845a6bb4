"""mt.join(): ranks that run out of data serve the others' collectives until all have joined.

Each test gives the ranks different amounts of work, so some join while others still call
collectives; the results are compared with what the active ranks alone contribute (the
joined ranks' neutral values), Average dividing by the whole world's size. The training test
compares DistributedOptimizer (overlapped buckets and the fusion path) with a single-process
reference that applies, at each step, the sum of the active ranks' gradients divided by N.
"""
import numpy as np
import pytest

import mpitrain as mt

mt.init()
N, R = mt.size(), mt.rank()
multi_rank = pytest.mark.skipif(N < 2, reason="needs at least 2 ranks")
three_ranks = pytest.mark.skipif(N < 3, reason="needs two active ranks beside a joined one")


def _x(r, t, n, dtype):
    """Rank r's input at round t: small values, so sums and products are exact."""
    return ((np.arange(n) * 7 + 3 * r + t) % 5 + 1).astype(dtype)               # (n,)


def _expected(op, arrays):
    stacked = np.stack(arrays)                                                   # (k, n)
    if op is mt.Sum:
        return stacked.sum(0)
    if op is mt.Average:
        return stacked.sum(0, dtype=np.float64) / N    # joined ranks' zeros count: / N
    if op is mt.Min:
        return stacked.min(0)
    if op is mt.Max:
        return stacked.max(0)
    return stacked.prod(0)


@pytest.mark.parametrize("op", [mt.Sum, mt.Average, mt.Min, mt.Max, mt.Product])
@pytest.mark.parametrize("dtype", ["int32", "float32"])
@pytest.mark.parametrize("n", [5, 3000])             # inside the agreement's message, and not
def test_ranks_with_fewer_rounds_join_and_contribute_the_identity(op, dtype, n):
    for t in range(R + 1):                           # rank r runs r + 1 rounds, then joins
        got = mt.allreduce(_x(R, t, n, dtype), op=op, name=f"round.{t}")
        active = [_x(r, t, n, dtype) for r in range(t, N)]   # ranks r >= t are still active
        want = _expected(op, active)
        if got.dtype.kind == "f":
            np.testing.assert_allclose(got, want, rtol=1e-6)
        else:
            np.testing.assert_array_equal(got, want)
    assert mt.join() == N - 1                        # rank N-1 had the most rounds


@multi_rank
def test_every_reduction_and_the_barrier_run_while_rank_0_has_joined():
    active = list(range(1, N))
    if R == 0:
        assert mt.join(-1) == N - 1                  # Horovod's device argument is accepted
        return
    a, b = np.full(3, R, np.float64), np.full((2, 2), R, np.int64)
    ga, gb = mt.grouped_allreduce([a, b], op=mt.Sum)
    np.testing.assert_array_equal(ga, np.full(3, sum(active), np.float64))
    np.testing.assert_array_equal(gb, np.full((2, 2), sum(active), np.int64))
    h = mt.allreduce_async(a, op=mt.Average)
    np.testing.assert_allclose(mt.synchronize(h), np.full(3, sum(active) / N))
    scattered = mt.reducescatter(np.ones((2 * N, 3), np.float32), op=mt.Sum)
    np.testing.assert_array_equal(scattered, np.full((2, 3), len(active), np.float32))
    mt.barrier()
    assert mt.join() == N - 1                # the active ranks join in one exchange: the highest


@multi_rank
def test_what_has_no_neutral_contribution_raises_on_every_active_rank():
    """Horovod's rule: allgather, alltoall and broadcast are not supported while a rank has
    joined; nor are the object collectives. A RuntimeError (CollectiveError) on every active
    rank, and the world stays usable."""
    if R == 0:
        assert mt.join() == N - 1
        return
    calls = [lambda: mt.allgather(np.zeros((1, 2))),
             lambda: mt.broadcast(np.zeros(2), root_rank=1),
             lambda: mt.broadcast_(np.zeros(2), root_rank=1),
             lambda: mt.alltoall(np.zeros((N, 1))),
             lambda: mt.broadcast_object(R, root_rank=1),
             lambda: mt.allgather_object(R)]
    for call in calls:
        with pytest.raises(RuntimeError, match="not supported while rank"):
            call()
    np.testing.assert_array_equal(mt.allreduce(np.ones(2), op=mt.Sum), np.full(2, N - 1.0))
    assert mt.join() == N - 1


def test_join_takes_an_integer_device_only():
    with pytest.raises(ValueError, match="device"):
        mt.join(mt.global_process_set)
    mt.barrier()


@three_ranks
def test_active_ranks_that_disagree_get_a_collective_error_while_a_rank_has_joined():
    if R == 0:
        assert mt.join() == N - 1
        return
    with pytest.raises(mt.CollectiveError, match="shape differs"):
        mt.allreduce(np.ones(2 + (R == 1)), name="mismatch")
    np.testing.assert_array_equal(mt.allreduce(np.ones(1), op=mt.Sum), [N - 1.0])
    assert mt.join() == N - 1


@three_ranks
def test_join_on_a_process_set_serves_that_sets_collectives():
    ps = mt.add_process_set([0, 2])
    if R == 0:
        assert mt.join(process_set=ps) == 2
    elif R == 2:
        got = mt.allreduce(np.full(3, 5.0), op=mt.Sum, process_set=ps)
        np.testing.assert_array_equal(got, np.full(3, 5.0))          # rank 0 gave zeros
        assert mt.join(process_set=ps) == 2
    else:
        with pytest.raises(ValueError, match="not in"):
            mt.join(process_set=ps)
    mt.remove_process_set(ps)


def test_join_after_even_work_returns_the_highest_rank():
    mt.allreduce(np.ones(3))
    assert mt.join() == N - 1
    assert mt.join() == N - 1                        # and again: no state is left behind


# --- training with uneven data against a single-process reference ------------------------------

B, SHAPE = 4, (6,)


def _batches(r):
    """Rank r's batches: 2 + r of them (the others run out first)."""
    rng = np.random.default_rng(100 + r)
    return [(rng.standard_normal((B,) + SHAPE), rng.integers(0, 10, B).astype(np.int64))
            for _ in range(2 + r)]


def _model():
    return mt.models.mlp(in_features=SHAPE[0], hidden=(8,), seed=0, dtype=np.float64)


def _backward(model, loss_fn, x, y, scale, hook=None):
    loss_fn.forward(model.forward(np.ascontiguousarray(x)), y)
    g = loss_fn.backward()
    g *= scale
    model.backward(g, on_layer_done=hook)


def _reference():
    """One process: at step t the sum of the gradients of the ranks that still have a batch,
    divided by N (what Average over N ranks, joined ones giving zeros, makes)."""
    model = _model()
    opt = mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    every = [_batches(r) for r in range(N)]
    for t in range(1 + N):
        opt.zero_grad()
        for batches in every:
            if t < len(batches):
                _backward(model, loss_fn, *batches[t], 1.0 / N)
        opt.step()
    return model.state_dict(copy=True)


@pytest.mark.parametrize("overlap", [True, False])
def test_distributed_optimizer_with_uneven_batches_matches_the_reference(overlap):
    model = _model()
    opt = mt.DistributedOptimizer(mt.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                  model.named_parameters(), overlap=overlap)
    loss_fn = mt.nn.SoftmaxCrossEntropy()
    for x, y in _batches(R):
        opt.zero_grad()
        _backward(model, loss_fn, x, y, 1.0, opt.backward_hook)
        opt.step()
    last = mt.join()
    assert last == N - 1
    mt.broadcast_parameters(model.state_dict(), root_rank=last)    # the replicas agree again
    want = _reference()
    for name, value in model.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-12, atol=1e-14, err_msg=name)
