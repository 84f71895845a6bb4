"""GPU kernel throughput: elementwise kernels vs a device-to-device copy, and GEMM GFLOP/s.

    python benchmarks/gpu_kernels.py [--kernels cupy numba] [--elements 67108864] [--gemm 4096]
                                     [--rounds 5] [--json PATH | --out DIR]

For each CUDA flavour that loads (kernels/cuda_cupy/, kernels/cuda_numba/), every memory-bound
kernel of the training step is timed on ``--elements`` float32 elements (ResNet's BatchNorm,
pooling and shortcut kernels on an (N, 16, 28, 28) batch of that size) and its effective
bandwidth (bytes it must read + write, divided by time) is compared with a plain device-to-device
memcpy of the same buffer timed in the same run: the target is >= 70 % of that copy. GEMM
is a square ``--gemm``^3 float32 product (2 n^3 flops; cuBLAS for CuPy, the tiled shared-memory
kernel for Numba). Each figure is the best of ``--rounds`` rounds (shared machines are noisy); a
kernel whose result is wrong aborts the run (exit 1), before anything is written.

Without a usable CUDA device (or under NUMBA_ENABLE_CUDASIM=1, where timings mean nothing) it
prints one line and exits 2.
"""
import argparse
import os
import sys

import numpy as np

import benchutil

FLAVOURS = ("cupy", "numba")
TARGET = 0.70


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="+", default=list(FLAVOURS), choices=FLAVOURS)
    ap.add_argument("--elements", type=int, default=1 << 26, help="float32 elements per array")
    ap.add_argument("--gemm", type=int, default=4096, help="square GEMM size n (n x n x n)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10, help="launches per timed round")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--out", default=None, help="directory: writes OUT/gpu_kernels.json")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("elements", "gemm", "rounds", "repeat"))
    return args


def load(flavours):
    """{flavour: kernel module} of the flavours usable here, and {flavour: why not}."""
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        return {}, {"all": "NUMBA_ENABLE_CUDASIM=1 (simulated GPU: timings are meaningless)"}
    backends, missing = {}, {}
    for flavour in flavours:
        try:
            from mpitrain.comm import device
            device.select_device(0)
            from mpitrain import kernels
            backends[flavour] = kernels.get("cuda", flavour)
        except (ImportError, RuntimeError) as exc:
            missing[flavour] = " ".join(str(exc).split())
    return backends, missing


def memcpy_d2d(dst, src):
    """cudaMemcpy device -> device: the bandwidth yardstick (not a kernel of ours)."""
    if hasattr(dst, "copy_to_device"):
        dst.copy_to_device(src)                            # Numba device array
    else:
        dst.data.copy_from_device(src.data, src.nbytes)    # CuPy


def elementwise_cases(k, n):
    """(name, callable, bytes moved per call) for the step's memory-bound kernels."""
    rng = np.random.default_rng(0)
    host = rng.standard_normal(n).astype(np.float32)
    a, b, c = k.to_device(host), k.to_device(host[::-1].copy()), k.zeros((n,), np.float32)
    m, v = k.zeros((n,), np.float32), k.zeros((n,), np.float32)
    half = k.empty((n,), np.float16)
    f = 4 * n
    return [
        ("copy", lambda: k.copy(c, a), 2 * f),
        ("scale", lambda: k.scale(c, 0.999), 2 * f),
        ("add", lambda: k.add(c, a), 3 * f),
        ("reduce_into sum", lambda: k.reduce_into(c, a, "sum"), 3 * f),
        ("relu", lambda: k.relu(a, c), 2 * f),
        ("relu_backward", lambda: k.relu_backward(a, b, c), 3 * f),
        ("dropout_forward", lambda: k.dropout_forward(a, c, m, 0.5, 1), 3 * f),
        ("cast f32->f16", lambda: k.cast(half, a), f + 2 * n),
        ("sgd_update momentum", lambda: k.sgd_update(c, a, m, 1e-3, 0.9, False, 0.0), 5 * f),
        ("adam_update", lambda: k.adam_update(c, a, m, v, 1e-3, 0.9, 0.999, 1e-8, 0.0, 1), 7 * f),
    ], (a, b, c)


def norm_cases(k, n):
    """(name, callable, bytes moved per call) for ResNet-20's kernels on an
    (N, 16, 28, 28) float32 batch of about ``n`` elements: BatchNorm's passes over the
    activations, global average pooling and the option-A shortcut (each moves its activations
    once; the per-channel vectors are noise)."""
    c, h, w = 16, 28, 28
    batch = max(1, n // (c * h * w))
    shape = (batch, c, h, w)
    rng = np.random.default_rng(4)
    x = k.to_device(rng.standard_normal(shape).astype(np.float32))
    g = k.to_device(rng.standard_normal(shape).astype(np.float32))
    y, gx = k.empty(shape, np.float32), k.empty(shape, np.float32)
    mean, invstd = k.zeros((c,), np.float32), k.to_device(np.ones(c, np.float32))
    weight, bias = k.to_device(np.ones(c, np.float32)), k.zeros((c,), np.float32)
    stats = k.zeros((2, c), np.float64)
    pooled = k.empty((batch, c), np.float32)
    wide = k.empty((batch, 2 * c, h // 2, w // 2), np.float32)     # stride 2, channels x 2
    f = 4 * batch * c * h * w
    return [
        ("bn_stats", lambda: k.bn_stats(x, stats), f),
        ("bn_forward", lambda: k.bn_forward(x, mean, invstd, weight, bias, y), 2 * f),
        ("bn_backward_stats", lambda: k.bn_backward_stats(g, x, mean, invstd, stats), 2 * f),
        ("bn_backward_input", lambda: k.bn_backward_input(g, x, mean, invstd, weight, stats,
                                                          float(batch * h * w), gx), 3 * f),
        ("global_avgpool_forward", lambda: k.global_avgpool_forward(x, pooled), f),
        ("global_avgpool_backward", lambda: k.global_avgpool_backward(pooled, gx), f),
        ("shortcut_forward", lambda: k.shortcut_forward(x, wide, 2, c // 2), f // 4 + f // 2),
        ("shortcut_backward", lambda: k.shortcut_backward(wide, gx, 2, c // 2), f // 2 + f),
    ]


def check_results(k, a, b, c):
    """Fail loudly: a known elementwise result and a GEMM sample against NumPy."""
    k.copy(c, a)
    k.add(c, b)
    got = k.to_host(c)[:1000]
    want = k.to_host(a)[:1000] + k.to_host(b)[:1000]
    if not np.allclose(got, want, rtol=1e-6, atol=1e-6):
        raise SystemExit(f"gpu_kernels: {k.name} add gave wrong values")
    x = np.random.default_rng(1).standard_normal((130, 70)).astype(np.float32)
    y = np.random.default_rng(2).standard_normal((70, 90)).astype(np.float32)
    out = k.empty((130, 90), np.float32)
    k.gemm(k.to_device(x), k.to_device(y), out)
    if not np.allclose(k.to_host(out), x @ y, rtol=1e-4, atol=1e-4):
        raise SystemExit(f"gpu_kernels: {k.name} gemm gave wrong values")


def bench(k, args):
    n = args.elements
    cases, (a, b, c) = elementwise_cases(k, n)
    check_results(k, a, b, c)
    cases += norm_cases(k, n)
    copy_s = benchutil.best_time(lambda: memcpy_d2d(c, a), args.rounds, args.repeat, k.synchronize)
    copy_gbs = 2 * 4 * n / copy_s / 1e9
    rows = []
    for name, fn, nbytes in cases:
        s = benchutil.best_time(fn, args.rounds, args.repeat, k.synchronize)
        gbs = nbytes / s / 1e9
        rows.append({"kernel": name, "ms": s * 1e3, "GB/s": gbs, "of_copy": gbs / copy_gbs})
    g = args.gemm
    rng = np.random.default_rng(3)
    ga = k.to_device(rng.standard_normal((g, g)).astype(np.float32))
    gb = k.to_device(rng.standard_normal((g, g)).astype(np.float32))
    gc = k.empty((g, g), np.float32)
    gemm_s = benchutil.best_time(lambda: k.gemm(ga, gb, gc), args.rounds,
                                 max(1, args.repeat // 5), k.synchronize)
    return {"backend": k.name, "elements": n, "d2d_copy_GB/s": copy_gbs, "kernels": rows,
            "gemm_n": g, "gemm_ms": gemm_s * 1e3, "gemm_GFLOP/s": 2 * g ** 3 / gemm_s / 1e9}


def device_name():
    try:
        import cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        return props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    except Exception:  # noqa: BLE001 - no CuPy: ask Numba
        from numba import cuda
        name = cuda.get_current_device().name
        return name.decode() if isinstance(name, bytes) else str(name)


def print_table(res):
    print(f"\n{res['backend']}: d2d copy {res['d2d_copy_GB/s']:.1f} GB/s "
          f"({res['elements']} float32), GEMM {res['gemm_n']}^3 {res['gemm_GFLOP/s']:.0f} GFLOP/s")
    print(f"  {'kernel':<22}{'ms':>9}{'GB/s':>9}{'of copy':>9}")
    for r in res["kernels"]:
        flag = "" if r["of_copy"] >= TARGET else f"   < {TARGET:.0%} target"
        print(f"  {r['kernel']:<22}{r['ms']:>9.3f}{r['GB/s']:>9.1f}{r['of_copy']:>9.0%}{flag}")


def main(argv=None):
    args = parse_args(argv)
    backends, missing = load(args.kernels)
    if not backends:
        why = "; ".join(f"{f}: {m}" for f, m in missing.items())
        print(f"gpu_kernels: no usable CUDA backend ({why})", file=sys.stderr)
        return 2
    for flavour, why in missing.items():
        print(f"gpu_kernels: skipping {flavour}: {why}", file=sys.stderr)
    results = {"device": device_name(), "target_of_copy": TARGET, "results": []}
    print(f"device: {results['device']}")
    for flavour, k in backends.items():
        res = bench(k, args)
        results["results"].append(res)
        print_table(res)
    path = args.json or (os.path.join(args.out, "gpu_kernels.json") if args.out else None)
    if path:
        benchutil.write_json(path, results)
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
