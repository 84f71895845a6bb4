"""float16 on the CPU: the Numba half kernels of kernels/cpu/ vs NumPy's float16, in one run.

    python benchmarks/fp16.py [--elements 1048576 4194304] [--magnitude 0.01] [--rounds 7]
                              [--repeat 5] [--json PATH]

The fp16 gradient compression (``--fp16-allreduce``) spends its CPU time in four operations: the
float32 -> float16 cast before the allreduce, the ring's ``reduce_into(.., "sum")`` on float16, the
average's ``scale`` and the float16 -> float32 cast after it. Each is timed through
``kernels.cpu`` (Numba on uint16 bit patterns, kernels/cpu/half.py) and through the NumPy call it
replaced, on the same arrays in the same run, so the ratio holds on a noisy shared machine even
when the absolute times drift. Each figure is the best of ``--rounds`` rounds of the mean of
``--repeat`` calls. Both results are compared bit for bit before any timing: a mismatch aborts the
run (exit 1) and nothing is written. The data are normal random numbers times ``--magnitude``:
at 1e-6 most of them are subnormal as halves, where NumPy's conversion (which raises the underflow
flag element by element) is about 25x slower than at 1e-2, and the Numba kernels are not.
"""
import argparse
import itertools
import sys

import numpy as np

import benchutil
from mpitrain.kernels import cpu


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--elements", type=int, nargs="+", default=[1 << 20, 1 << 22])
    ap.add_argument("--magnitude", type=float, default=1e-2, help="scale of the random data")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--repeat", type=int, default=5, help="calls per timed round")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("rounds", "repeat"))
    if min(args.elements) < 1:
        ap.error(f"--elements must be >= 1, got {min(args.elements)}")
    return args


def cases(n, magnitude):
    """(name, numba call, numpy call, the array both write) per operation, on n elements."""
    rng = np.random.default_rng(0)
    f32 = (rng.standard_normal(n) * magnitude).astype(np.float32)  # (n,) gradient-like
    f16 = f32.astype(np.float16)                                    # (n,)
    other = (rng.standard_normal(n) * magnitude).astype(np.float16)  # (n,)
    out16, out32 = np.empty(n, np.float16), np.empty(n, np.float32)
    acc = f16.copy()
    # 0.5 (the average of 2 ranks) and back, so that repeated calls keep the values in range
    factors = itertools.cycle([0.5, 2.0])

    def reset_acc():
        nonlocal factors
        acc[...] = f16
        factors = itertools.cycle([0.5, 2.0])
    return [
        ("cast f32->f16", lambda: cpu.cast(out16, f32),
         lambda: np.copyto(out16, f32, casting="unsafe"), out16, None),
        ("cast f16->f32", lambda: cpu.cast(out32, f16),
         lambda: np.copyto(out32, f16, casting="unsafe"), out32, None),
        ("reduce_into f16 sum", lambda: cpu.reduce_into(acc, other, "sum"),
         lambda: np.add(acc, other, out=acc), acc, reset_acc),
        ("scale f16", lambda: cpu.scale(acc, next(factors)),
         lambda: np.multiply(acc, next(factors), out=acc, casting="unsafe"), acc, reset_acc),
    ]


def check(name, numba_fn, numpy_fn, out, reset):
    """Fail loudly: one call of each from the same input must give the same bits."""
    if reset:
        reset()
    numpy_fn()
    want = out.copy()
    if reset:
        reset()
    numba_fn()
    if not np.array_equal(out.view(np.uint8), want.view(np.uint8)):
        raise SystemExit(f"fp16: {name} differs from NumPy")


def bench(n, magnitude, rounds, repeat):
    rows = []
    for name, numba_fn, numpy_fn, out, reset in cases(n, magnitude):
        check(name, numba_fn, numpy_fn, out, reset)
        times = []
        for fn in (numba_fn, numpy_fn):
            if reset:   # both start from the same values
                reset()
            times.append(benchutil.best_time(fn, rounds, repeat))
        numba_s, numpy_s = times
        rows.append({"op": name, "elements": n, "magnitude": magnitude, "numba_ms": numba_s * 1e3,
                     "numpy_ms": numpy_s * 1e3, "speedup": numpy_s / numba_s,
                     "numba_ns_per_element": numba_s / n * 1e9})
    return rows


def main(argv=None):
    args = parse_args(argv)
    np.seterr(all="ignore")     # NumPy's float16 warns on underflow; the kernels do not
    rows = []
    print(f"  {'op':<22}{'elements':>10}{'numba ms':>10}{'numpy ms':>10}{'speedup':>9}")
    for n in args.elements:
        for r in bench(n, args.magnitude, args.rounds, args.repeat):
            rows.append(r)
            print(f"  {r['op']:<22}{r['elements']:>10}{r['numba_ms']:>10.3f}"
                  f"{r['numpy_ms']:>10.3f}{r['speedup']:>8.1f}x")
    if args.json:
        benchutil.write_json(args.json, {"numpy": np.__version__, "rounds": args.rounds,
                                         "repeat": args.repeat, "results": rows})
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
