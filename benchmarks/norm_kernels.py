"""Time the CPU BatchNorm / pooling / shortcut kernels next to a plain copy of the same array.

    python benchmarks/norm_kernels.py [--shape 64,16,28,28] [--repeat 20] [--json PATH]

Each kernel runs ``--repeat`` times after a warm-up call; the best time is reported (the machine
is shared, the minimum is the least disturbed), with ns per element and the ratio to
``np.copyto`` of the same array (one read + one write: the floor of a memory-bound pass).
One Numba thread and one BLAS thread, the one-thread-per-rank setting.
"""
import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import numpy as np  # noqa: E402

import benchutil  # noqa: E402
from mpitrain.kernels import cpu as k  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="64,16,28,28", help="N,C,H,W of the activation")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args(argv)
    try:
        n, c, h, w = (int(v) for v in args.shape.split(","))
    except ValueError:
        ap.error(f"--shape {args.shape!r}: expected N,C,H,W")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)             # (N, C, H, W)
    g = rng.standard_normal(x.shape).astype(np.float32)
    y, gx = np.empty_like(x), np.empty_like(x)
    stats, bstats = np.empty((2, c)), np.empty((2, c))                    # (2, C) float64
    mean, invstd = np.zeros(c, np.float32), np.ones(c, np.float32)
    weight, bias = np.ones(c, np.float32), np.zeros(c, np.float32)
    rmean, rvar = np.zeros(c, np.float32), np.ones(c, np.float32)
    count = x.size // c
    short = np.empty((n, 2 * c, -(-h // 2), -(-w // 2)), np.float32)   # (N, 2C, H/2, W/2)
    pooled = np.empty((n, c), np.float32)                                 # (N, C)
    cases = [
        ("np.copyto (floor)", np.copyto, (y, x)),
        ("bn_stats", k.bn_stats, (x, stats)),
        ("bn_moments", k.bn_moments, (stats, count, 1e-5, 0.1, mean, invstd, rmean, rvar)),
        ("bn_forward", k.bn_forward, (x, mean, invstd, weight, bias, y)),
        ("bn_backward_stats", k.bn_backward_stats, (g, x, mean, invstd, bstats)),
        ("bn_backward_input", k.bn_backward_input,
         (g, x, mean, invstd, weight, bstats, count, gx)),
        ("global_avgpool_forward", k.global_avgpool_forward, (x, pooled)),
        ("shortcut_forward (s=2)", k.shortcut_forward, (x, short, 2, c // 2)),
        ("shortcut_backward (s=2)", k.shortcut_backward, (short, gx, 2, c // 2)),
    ]
    rows = []
    floor = None
    print(f"shape {x.shape} float32, {x.size} elements, best of {args.repeat}")
    print(f"{'kernel':26s} {'ms':>8s} {'ns/elem':>8s} {'x copy':>7s}")
    for name, fn, fargs in cases:
        ms = 1e3 * benchutil.best_time(lambda: fn(*fargs), args.repeat)
        floor = floor or ms
        rows.append({"kernel": name, "ms": ms, "ns_per_element": 1e6 * ms / x.size,
                     "vs_copy": ms / floor})
        print(f"{name:26s} {ms:8.3f} {1e6 * ms / x.size:8.3f} {ms / floor:7.2f}")
    if args.json:
        benchutil.write_json(args.json, {"shape": list(x.shape), "rows": rows})


if __name__ == "__main__":
    main()
