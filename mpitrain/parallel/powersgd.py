"""PowerSGD: low-rank gradient compression with error feedback, as PyTorch's DDP hook
(torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook).

``mt.Compression.powersgd(rank=4, start_iter=10, min_compression_rate=2.0)`` makes one of these;
it holds state (give each DistributedOptimizer its own). Each step, over the gradients of the
optimizer (one bucket, in parameter order):

- the first ``start_iter`` steps: a plain average (one fused allreduce), no error feedback;
- then each gradient of 2 or more dimensions is seen as a matrix M (shape[0] rows), compressed
  when the low-rank factors are smaller by ``min_compression_rate``: (n + m) r * rate < n m,
  r = min(rank, n, m); the others (biases, norms, small matrices) are averaged plainly;
- error feedback: M += e (this rank's residual from the last step);
- P = M Q, with Q the previous step's (warm start; at first a random matrix from a seed every
  rank shares); the P's are summed across ranks, together with the plain gradients, in one
  fused allreduce; each P is orthogonalized (Gram-Schmidt in float64: a column that is zero,
  or dependent on the ones before it, stays zero, so rank-deficient gradients are exact);
- Q = M^T P, summed across ranks in a second fused allreduce and divided by N;
- the gradient becomes P Q^T (the projection of the ranks' mean onto span(P)); e = M - P Q^T.

Two allreduces a step, of sum((n + m) r) values instead of sum(n m). Not bitwise deterministic
(the sums follow the ring's order, and the factors amplify rounding), so deterministic=True
refuses it, as it refuses every compression; sharding, average="weights", Adasum and a
gradient_predivide_factor are refused as well (one ValueError at construction). Host arrays.
"""
import numpy as np

from mpitrain import comm


class PowerSGD:
    """PowerSGD's state and its average of a list of gradients (see the module docstring)."""

    def __init__(self, rank=4, start_iter=10, min_compression_rate=2.0, seed=0):
        for name, value, least in (("rank", rank, 1), ("start_iter", start_iter, 0)):
            if (isinstance(value, bool) or not isinstance(value, (int, np.integer))
                    or value < least):
                raise ValueError(f"mt.Compression.powersgd: {name}={value!r}: expected an "
                                 f"integer >= {least}")
        if isinstance(min_compression_rate, bool) or not min_compression_rate >= 1.0:
            raise ValueError(f"mt.Compression.powersgd: min_compression_rate="
                             f"{min_compression_rate!r}: expected a number >= 1")
        self.rank, self.start_iter = int(rank), int(start_iter)
        self.min_compression_rate = float(min_compression_rate)
        self.seed = int(seed)
        self.iter = 0           # steps averaged so far
        self.errors = {}        # gradient index -> this rank's residual (float32 matrix)
        self.qs = {}            # gradient index -> the warm-started Q (m x r)
        self.used = False

    def __repr__(self):
        return (f"mt.Compression.powersgd(rank={self.rank}, start_iter={self.start_iter}, "
                f"min_compression_rate={self.min_compression_rate})")

    # Horovod's protocol would compress one tensor at a time; PowerSGD needs every rank's
    # factors between its two allreduces, so it runs only inside DistributedOptimizer.
    def compress(self, tensor):
        raise TypeError(f"{self!r} runs inside DistributedOptimizer only (two allreduces per "
                        f"step with state); it cannot compress a single tensor")

    decompress = compress

    def compressed_rank(self, shape):
        """r for a gradient of ``shape`` where compressing it pays, else None."""
        if len(shape) < 2:
            return None
        n = int(shape[0])
        m = int(np.prod(shape[1:]))
        r = min(self.rank, n, m)
        return r if (n + m) * r * self.min_compression_rate < n * m else None

    def initial_q(self, index, m, r, dtype):
        rng = np.random.default_rng([self.seed, index])      # the same on every rank
        return rng.standard_normal((m, r)).astype(dtype)

    def average(self, grads, process_set, op, name):
        """Replace every array of ``grads`` (host, C-contiguous) in place by its PowerSGD
        average over ``process_set`` (``op`` Sum: times N)."""
        n_ranks = comm.group_size(process_set)
        factor = float(n_ranks) if op is comm.Sum else 1.0
        if self.iter < self.start_iter:
            self.iter += 1
            comm.grouped_allreduce_(grads, op=op, name=name, process_set=process_set)
            return
        self.iter += 1
        plain, matrices = [], []
        for i, g in enumerate(grads):
            r = self.compressed_rank(g.shape)
            if r is None or g.dtype.kind != "f":
                plain.append(g)
                continue
            m = g.reshape(g.shape[0], -1)
            e = self.errors.get(i)
            if e is not None:
                m += e                                  # error feedback
            q = self.qs.get(i)
            if q is None:
                q = self.qs[i] = self.initial_q(i, m.shape[1], r, m.dtype)
            matrices.append((i, m, q, m @ q))           # P = M Q
        # first allreduce: the plain gradients (averaged) and the P's (summed)
        ps = [p for _, _, _, p in matrices]
        # (the same gradient shapes on every rank: every rank skips the same empty lists)
        if plain:
            comm.grouped_allreduce_(plain, op=op, name=f"{name}.plain", process_set=process_set)
        if not ps:
            return
        comm.grouped_allreduce_(ps, op=comm.Sum, name=f"{name}.P", process_set=process_set)
        qs = []
        for (_, m, _, p) in matrices:
            p[...] = orthogonalize(p)
            qs.append(np.ascontiguousarray(m.T @ p))    # Q = M^T P
        # second allreduce: the Q's, summed then divided by N (the mean's factor)
        comm.grouped_allreduce_(qs, op=comm.Sum, name=f"{name}.Q", process_set=process_set)
        for (i, m, _, p), q in zip(matrices, qs):
            q /= n_ranks
            self.qs[i] = q                              # warm start
            approx = p @ q.T
            self.errors[i] = m - approx                 # this rank's residual
            m[...] = approx * factor if factor != 1.0 else approx


def orthogonalize(p):
    """Orthonormal columns by Gram-Schmidt in float64 (a new array of p's dtype); a column with
    nothing left of it after the projections (zero, or in the span of the ones before) is set
    to zero instead of divided by ~0."""
    a = p.astype(np.float64)
    for j in range(a.shape[1]):
        col = a[:, j]
        before = np.linalg.norm(col)
        for k in range(j):
            col -= (a[:, k] @ col) * a[:, k]
        norm = np.linalg.norm(col)
        if norm == 0.0 or norm <= 1e-5 * before:     # float32 factors: their rounding's size
            col[...] = 0.0
        else:
            col /= norm
    return a.astype(p.dtype)
