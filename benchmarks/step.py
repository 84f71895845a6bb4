"""Time one training step (forward, backward, update) of the zoo models, next to BLAS.

    python benchmarks/step.py --model mlp lenet cifar_cnn --batch 64 [--threads 1] [--json PATH]
    python benchmarks/step.py --model lenet --device cuda --kernels cupy [--torch]

The machine is shared and noisy, so every round times the model step *and* the same step's GEMMs
alone (the exact shapes and transposes the layers issue, through the same backend ``gemm``), back to
back; the reported ratio step / GEMMs is taken within a round, and the best round is reported next
to the median. "sgemm GFLOP/s" is a square 1024^3 product measured in the same run. A ratio near 1
means everything that is not a GEMM (im2col, pooling, bias, loss, optimizer) costs little.

Threads (default 1, the one-thread-per-rank setting) are fixed before NumPy loads, through the
OpenBLAS/OpenMP/MKL environment variables, and for Numba through ``numba.set_num_threads``.
"""
import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402

MODELS = ("mlp", "lenet", "cifar_cnn")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", nargs="+", default=list(MODELS), choices=MODELS)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="BLAS and Numba threads (default 1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default=None, help="kernel flavour: numba | cupy (registry)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--steps", type=int, default=10, help="timed steps per round")
    ap.add_argument("--rounds", type=int, default=5, help="rounds (step timing + GEMM timing)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps (JIT, workspaces)")
    ap.add_argument("--torch", action="store_true",
                    help="also time the same model in PyTorch, on the same --device "
                         "(comparison; without torch: one line, exit 2, before any timing)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the time per kernel call site (synchronizing after each)")
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--out", default=None, help="directory: writes OUT/step.json")
    args = ap.parse_args(argv)
    for name in ("batch", "threads", "steps", "rounds"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def set_threads(n):
    """Must run before NumPy is imported: BLAS reads these once, at load time."""
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = str(n)


def gemm_plan(model, batch):
    """The GEMMs one training step issues: list of (a_shape, b_shape, trans_a, trans_b, out_shape).

    Walks the layers with the per-sample shape; the first layer forms no input gradient, exactly as
    Sequential.backward does.
    """
    from mpitrain.nn import Conv2D, Flatten, Linear, MaxPool2D
    plan, shape = [], (batch,) + tuple(model.input_shape)
    for i, layer in enumerate(model.layers):
        if isinstance(layer, Linear):
            b, f_in, f_out = shape[0], layer.in_features, layer.out_features
            plan.append(((b, f_in), (f_out, f_in), False, True, (b, f_out)))      # y = x W^T
            plan.append(((b, f_out), (b, f_in), True, False, (f_out, f_in)))     # dW = g^T x
            if i > 0:
                plan.append(((b, f_out), (f_out, f_in), False, False, (b, f_in)))  # dx = g W
            shape = (b, f_out)
        elif isinstance(layer, Conv2D):
            n, c, h, w = shape
            oh, ow = layer.output_hw(h, w)
            rows, kk, oc = n * oh * ow, c * layer.kernel_size ** 2, layer.out_channels
            plan.append(((rows, kk), (oc, kk), False, True, (rows, oc)))
            plan.append(((rows, oc), (rows, kk), True, False, (oc, kk)))
            if i > 0:
                plan.append(((rows, oc), (oc, kk), False, False, (rows, kk)))
            shape = (n, oc, oh, ow)
        elif isinstance(layer, MaxPool2D):
            n, c, h, w = shape
            ks, s = layer.kernel_size, layer.stride
            shape = (n, c, (h - ks) // s + 1, (w - ks) // s + 1)
        elif isinstance(layer, Flatten):
            size = 1
            for d in shape[1:]:
                size *= d
            shape = (shape[0], size)
    return plan


def gemm_flops(plan):
    total = 0
    for a, _, ta, _, out in plan:
        inner = a[0] if ta else a[1]
        total += 2 * out[0] * out[1] * inner
    return total


PROFILED = ("gemm", "bias_act", "relu", "relu_backward", "bias_grad", "softmax_xent",
            "count_correct", "im2col", "col2im", "nhwc_to_nchw", "nchw_to_nhwc",
            "maxpool_forward", "maxpool_backward", "dropout_forward", "dropout_backward",
            "sgd_update", "copy", "fill")


def profile_kernels(k, step, steps):
    """ms per step spent in each kernel, keyed by kernel name and first-argument shape."""
    from collections import defaultdict
    spent, saved = defaultdict(float), {}

    def wrap(name, fn):
        def timed_call(*args, **kw):
            t = time.perf_counter()
            out = fn(*args, **kw)
            k.synchronize()
            key = f"{name} {tuple(args[0].shape)}" if hasattr(args[0], "shape") else name
            if name == "gemm":
                key += (" x " + str(tuple(args[1].shape)) + (" tA" if kw.get("trans_a") else "")
                        + (" tB" if kw.get("trans_b") else ""))
            spent[key] += time.perf_counter() - t
            return out
        return timed_call

    for name in PROFILED:
        if hasattr(k, name):
            saved[name] = getattr(k, name)
            setattr(k, name, wrap(name, saved[name]))
    try:
        for _ in range(steps):
            step()
    finally:
        for name, fn in saved.items():
            setattr(k, name, fn)
    return {key: v / steps * 1e3 for key, v in sorted(spent.items(), key=lambda kv: -kv[1])}


def torch_step_ms(name, batch, threads, steps, rounds, warmup, device="cpu"):
    """Median-of-rounds best step time of the same architecture in PyTorch, on ``device``."""
    import torch
    from torch import nn
    torch.set_num_threads(threads)
    # CUDA launches are asynchronous: a step ends when the device has finished it
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if name == "mlp":
        net, shape = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                   nn.ReLU(), nn.Linear(1024, 10)), (784,)
    elif name == "lenet":
        net, shape = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(3136, 1024), nn.ReLU(), nn.Linear(1024, 10)), (1, 28, 28)
    else:
        net, shape = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(4096, 512), nn.ReLU(), nn.Linear(512, 10)), (3, 32, 32)
    net = net.to(device)
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn((batch,) + shape, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    lossf = nn.CrossEntropyLoss()

    def step():
        opt.zero_grad()
        lossf(net(x), y).backward()
        opt.step()

    for _ in range(warmup):
        step()
    sync()
    best = []
    for _ in range(rounds):
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            step()
            sync()
            times.append(time.perf_counter() - t)
        best.append(sorted(times)[len(times) // 2])
    return min(best) * 1e3, torch.__version__


def main(argv=None):
    args = parse_args(argv)
    set_threads(args.threads)
    # --torch asks for the comparison: no PyTorch is bad input, found before the first timing
    # (after set_threads: importing torch loads NumPy, whose BLAS reads the thread variables).
    error = benchdeps.require("torch", "--torch") if args.torch else None
    if error:
        print(f"step: error: {error}", file=sys.stderr)
        sys.exit(2)
    import numpy as np
    import numba

    import mpitrain as mt
    from mpitrain import kernels as registry

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    k = registry.get(args.device, args.kernels)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)

    def timed(fn):
        k.synchronize()
        t = time.perf_counter()
        fn()
        k.synchronize()
        return time.perf_counter() - t

    # Square sgemm: the BLAS reference speed for this run.
    n = 1024
    sa, sb = (k.to_device(rng.standard_normal((n, n)).astype(dtype)) for _ in range(2))
    sc = k.empty((n, n), dtype)
    for _ in range(2):
        k.gemm(sa, sb, sc)
    blas_s = min(timed(lambda: k.gemm(sa, sb, sc)) for _ in range(5))
    blas_gflops = 2 * n ** 3 / blas_s / 1e9
    print(f"backend {k.name}, {args.threads} thread(s), {dtype}: BLAS gemm {n}^3 "
          f"{blas_gflops:.1f} GFLOP/s")

    results = []
    header = (f"{'model':10s} {'batch':>5s} {'fwd ms':>8s} {'bwd ms':>8s} {'upd ms':>8s} "
              f"{'step ms':>8s} {'GEMM ms':>8s} {'step/GEMM':>9s} {'GFLOP/s':>8s} "
              f"{'step/peak':>9s}")
    print(header)
    for name in args.model:
        model = mt.models.get(name, seed=0, dtype=dtype, kernels=k)
        loss = mt.nn.SoftmaxCrossEntropy(kernels=k)
        opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = k.to_device(rng.standard_normal((args.batch,) + model.input_shape).astype(dtype))
        y = k.to_device(rng.integers(0, 10, args.batch).astype(np.int64))
        plan = gemm_plan(model, args.batch)
        flops = gemm_flops(plan)
        operands = [(k.to_device(rng.standard_normal(a).astype(dtype)),
                     k.to_device(rng.standard_normal(b).astype(dtype)), ta, tb,
                     k.empty(out, dtype)) for a, b, ta, tb, out in plan]

        def forward():
            loss.forward(model.forward(x), y)

        def backward():
            model.backward(loss.backward())

        def update():
            opt.step()
            opt.zero_grad()

        def gemms():
            for a, b, ta, tb, out in operands:
                k.gemm(a, b, out, trans_a=ta, trans_b=tb)

        for _ in range(args.warmup):
            forward()
            backward()
            update()
        gemms()
        rounds = []
        for _ in range(args.rounds):
            f, b, u = [], [], []
            for _ in range(args.steps):
                f.append(timed(forward))
                b.append(timed(backward))
                u.append(timed(update))
            g = [timed(gemms) for _ in range(args.steps)]
            lv = loss.forward(model.forward(x), y)
            if not np.isfinite(lv):
                raise SystemExit(f"{name}: loss is {lv} after training steps; the step is broken")
            fwd, bwd, upd = (float(np.median(v)) for v in (f, b, u))
            gem = float(np.median(g))
            rounds.append(dict(fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, update_ms=upd * 1e3,
                               step_ms=(fwd + bwd + upd) * 1e3, gemm_ms=gem * 1e3,
                               ratio_step_gemm=(fwd + bwd + upd) / gem))
        best = min(rounds, key=lambda r: r["step_ms"])
        med = {key: float(np.median([r[key] for r in rounds])) for key in rounds[0]}
        peak_ms = flops / (blas_gflops * 1e9) * 1e3
        res = dict(model=name, batch=args.batch, threads=args.threads, device=args.device,
                   kernels=k.name, dtype=str(dtype), gemm_gflop_per_step=flops / 1e9,
                   blas_gflops=blas_gflops, gemm_time_at_blas_peak_ms=peak_ms,
                   best=dict(best, gflops=flops / best["step_ms"] / 1e6,
                             ratio_step_peak=best["step_ms"] / peak_ms),
                   median=dict(med, gflops=flops / med["step_ms"] / 1e6,
                               ratio_step_peak=med["step_ms"] / peak_ms),
                   best_ratio_step_gemm=min(r["ratio_step_gemm"] for r in rounds),
                   rounds=rounds)
        results.append(res)
        for tag, r in (("best", res["best"]), ("median", res["median"])):
            print(f"{name + ' ' + tag:10s} {args.batch:5d} {r['fwd_ms']:8.2f} {r['bwd_ms']:8.2f} "
                  f"{r['update_ms']:8.2f} {r['step_ms']:8.2f} {r['gemm_ms']:8.2f} "
                  f"{r['ratio_step_gemm']:9.2f} {r['gflops']:8.1f} {r['ratio_step_peak']:9.2f}")
        print(f"{'':10s} GEMM work {flops / 1e9:.3f} GFLOP/step; best within-round step/GEMM "
              f"{res['best_ratio_step_gemm']:.2f}")
        if args.profile:
            def full_step():
                forward()
                backward()
                update()
            prof = profile_kernels(k, full_step, args.steps)
            res["profile_ms"] = prof
            print(f"{'':10s} per-kernel ms/step ({sum(prof.values()):.1f} ms in kernels):")
            for key, ms in prof.items():
                if ms >= 0.05:
                    print(f"{'':12s}{ms:8.2f}  {key}")
        if args.torch:
            got = torch_step_ms(name, args.batch, args.threads, args.steps, args.rounds,
                                args.warmup, device=args.device)
            res["torch_step_ms"], res["torch_version"] = got
            res["torch_device"] = args.device
            print(f"{'':10s} PyTorch {got[1]} ({args.device}) same model: {got[0]:.2f} ms/step "
                  f"(best round median); mpitrain/PyTorch {best['step_ms'] / got[0]:.2f}")
    paths = [args.json] if args.json else []
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths.append(os.path.join(args.out, "step.json"))
    for path in paths:
        with open(path, "w") as fh:
            json.dump(dict(argv=sys.argv[1:], results=results), fh, indent=1)
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
