"""Time one training step (forward, backward, update) of the zoo models, next to BLAS.

    python benchmarks/step.py --model mlp lenet cifar_cnn resnet20 --batch 64 [--threads 1]
        [--torch] [--clock cpu] [--rss] [--json PATH]
    python benchmarks/step.py --model lenet --device cuda --kernels cupy [--torch]

The machine is shared and noisy, so every round times the model step *and* the same step's GEMMs
alone (the exact shapes and transposes the layers issue, through the same backend ``gemm``), back to
back; the reported ratio step / GEMMs is taken within a round, and the best round is reported next
to the median. "sgemm GFLOP/s" is a square 1024^3 product measured in the same run. A ratio near 1
means everything that is not a GEMM (im2col, pooling, bias, loss, optimizer) costs little.
``--torch`` times the same network in PyTorch inside every round, right after ours, so the two
are compared under the same load. ``--rss`` runs each model's training steps once more in a fresh
process (ours, then PyTorch's with --torch) and reports its peak resident set size.

Threads (default 1, the one-thread-per-rank setting) are fixed before NumPy loads, through the
OpenBLAS/OpenMP/MKL environment variables, then given out as the trainer gives them
(``mpitrain.runtime.threads.configure``: BLAS and the convolution's gathered path n, Numba one).
"""
import argparse
import functools
import json
import os
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # benchdeps, also when loaded by path
import benchdeps  # noqa: E402
import benchutil  # noqa: E402

MODELS = ("mlp", "lenet", "cifar_cnn", "resnet20")
# The ResNet runs on Fashion-MNIST-sized input here (the size its speed target is set for); the
# zoo's default is (3, 32, 32).
MODEL_KW = {"resnet20": dict(input_shape=(1, 28, 28))}


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
    ap.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="wall: elapsed time (default); cpu: this process's CPU time, for a "
                         "shared, overloaded machine where a step also waits for a core "
                         "(--device cpu only)")
    ap.add_argument("--profile", action="store_true",
                    help="also print the time per kernel call site (synchronizing after each)")
    ap.add_argument("--rss", action="store_true",
                    help="also measure the peak RSS of a process that only trains the model "
                         "(a subprocess per model, and per framework with --torch)")
    ap.add_argument("--rss-child", default=None, choices=("mpitrain", "torch"),
                    help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None, help="write results to this JSON file")
    ap.add_argument("--out", default=None, help="directory: writes OUT/step.json")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("batch", "threads", "steps", "rounds"))
    if args.clock == "cpu" and args.device != "cpu":
        ap.error("--clock cpu measures host CPU time: use it with --device cpu")
    return args


def _set_kernel(k, name, fn):
    """Kernel ``name`` of backend ``k`` becomes ``fn``, in the package and in each of its modules
    that holds the current one, so the backend's own calls (the CuPy convolution's) see it too."""
    old = getattr(k, name)
    for holder in [k] + [m for m in vars(k).values() if isinstance(m, types.ModuleType)]:
        if vars(holder).get(name) is old:
            setattr(holder, name, fn)


def gemm_plan(k, step):
    """The GEMMs one training step issues, recorded while ``step()`` runs once:
    [(a_shape, b_shape, trans_a, trans_b, out_shape, times)].

    Through the backend's ``gemm`` (the CuPy flavour's own convolution calls it too), and for the
    CPU's own convolution (kernels/cpu/conv.py, whose per-image GEMMs run inside it) the shapes
    it reports for each call.
    """
    from mpitrain.kernels.cpu import conv as cpu_conv
    plan, saved = [], {name: getattr(k, name) for name in ("gemm", "conv2d_backward")
                       if hasattr(k, name) and (name == "gemm" or k.name == "cpu")}

    def gemm(a, b, out, trans_a=False, trans_b=False, accumulate=False):
        plan.append((tuple(a.shape), tuple(b.shape), trans_a, trans_b, tuple(out.shape), 1))
        return saved["gemm"](a, b, out, trans_a=trans_a, trans_b=trans_b, accumulate=accumulate)

    def conv2d_backward(x, weight, y, grad_y, stride, pad, relu, grad_weight, accumulate_weight,
                        grad_bias, grad_x):
        plan.extend(cpu_conv.gemm_shapes(x.shape, weight.shape, stride, pad, grad_x is not None,
                                         x.dtype.itemsize))
        return saved["conv2d_backward"](x, weight, y, grad_y, stride, pad, relu, grad_weight,
                                        accumulate_weight, grad_bias, grad_x)

    _set_kernel(k, "gemm", gemm)
    if "conv2d_backward" in saved:
        _set_kernel(k, "conv2d_backward", conv2d_backward)
    try:
        step()
    finally:
        for name, fn in saved.items():
            _set_kernel(k, name, fn)
    return plan


def gemm_flops(plan):
    return sum(2 * out[0] * out[1] * (a[0] if ta else a[1]) * times
               for a, _, ta, _, out, times in plan)


PROFILED = ("gemm", "bias_act", "relu", "relu_backward", "bias_grad", "softmax_xent",
            "count_correct", "im2col", "col2im", "nhwc_to_nchw", "nchw_to_nhwc",
            "maxpool_forward", "maxpool_backward", "dropout_forward", "dropout_backward",
            "sgd_update", "copy", "fill", "add", "conv2d_forward", "conv2d_backward", "bn_stats",
            "bn_moments", "bn_forward", "bn_backward_stats", "bn_param_grads",
            "bn_backward_input", "global_avgpool_forward", "global_avgpool_backward",
            "shortcut_forward", "shortcut_backward")


def profile_kernels(k, step, steps, clock=time.perf_counter):
    """ms per step spent in each kernel, keyed by kernel name and first-argument shape."""
    from collections import defaultdict
    spent, saved = defaultdict(float), {}

    def wrap(name, fn):
        def timed_call(*args, **kw):
            t = clock()
            out = fn(*args, **kw)
            k.synchronize()
            key = f"{name} {tuple(args[0].shape)}" if hasattr(args[0], "shape") else name
            if name == "gemm":
                key += (" x " + str(tuple(args[1].shape)) + (" tA" if kw.get("trans_a") else "")
                        + (" tB" if kw.get("trans_b") else ""))
            spent[key] += clock() - t
            return out
        return timed_call

    for name in PROFILED:
        if hasattr(k, name):
            saved[name] = getattr(k, name)
            _set_kernel(k, name, wrap(name, saved[name]))
    try:
        for _ in range(steps):
            step()
    finally:
        for name, fn in saved.items():
            _set_kernel(k, name, fn)
    return {key: v / steps * 1e3 for key, v in sorted(spent.items(), key=lambda kv: -kv[1])}


def torch_resnet20(in_channels=1, classes=10):
    """mpitrain's resnet20 in PyTorch (He et al. 2016, CIFAR variant; mpitrain/nn/resnet.py):
    conv3x3 16 + BN + ReLU, 3 stages x 3 BasicBlocks at 16/32/64 channels, option-A zero-padded
    stride-2 shortcuts, global average pooling, linear."""
    from torch import nn
    from torch.nn import functional as F

    class Block(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.stride, self.extra = stride, cout - cin

        def forward(self, x):
            out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
            short = x
            if self.stride != 1 or self.extra:
                short = F.pad(x[:, :, ::self.stride, ::self.stride],
                              (0, 0, 0, 0, self.extra // 2, self.extra - self.extra // 2))
            return F.relu(out + short)

    layers, cin = [nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16),
                   nn.ReLU()], 16
    for s, width in enumerate((16, 32, 64)):
        for b in range(3):
            layers.append(Block(cin, width, 2 if s > 0 and b == 0 else 1))
            cin = width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes)]
    return nn.Sequential(*layers)


def torch_step(name, batch, threads, device="cpu"):
    """One training step of the same architecture in PyTorch on ``device``: (step, version).

    ``step()`` returns when the step has finished (CUDA launches are asynchronous: it
    synchronizes)."""
    import torch
    from torch import nn
    torch.set_num_threads(threads)
    # our kernels compute in float32; PyTorch's CUDA default may use TF32 for convolutions
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    if name == "mlp":
        net, shape = nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024),
                                   nn.ReLU(), nn.Linear(1024, 10)), (784,)
    elif name == "lenet":
        net, shape = nn.Sequential(
            nn.Conv2d(1, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
            nn.Linear(3136, 1024), nn.ReLU(), nn.Linear(1024, 10)), (1, 28, 28)
    elif name == "resnet20":
        net, shape = torch_resnet20(), (1, 28, 28)
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
        sync()

    return step, torch.__version__


def mpitrain_step(name, args, k, rng):
    """The zoo model ``name``'s training step on one random batch of ``rng``, in three parts:
    (forward -> loss, backward, update: SGD and zeroed gradients)."""
    import numpy as np

    import mpitrain as mt
    dtype = np.dtype(args.dtype)
    model = mt.models.get(name, seed=0, dtype=dtype, kernels=k, **MODEL_KW.get(name, {}))
    loss = mt.nn.SoftmaxCrossEntropy(kernels=k)
    opt = mt.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = k.to_device(rng.standard_normal((args.batch,) + model.input_shape).astype(dtype))
    y = k.to_device(rng.integers(0, 10, args.batch).astype(np.int64))

    def forward():
        return loss.forward(model.forward(x), y)

    def backward():
        model.backward(loss.backward())

    def update():
        opt.step()
        opt.zero_grad()
    return forward, backward, update


def rss_child(args):
    """--rss-child: train the one model warmup + steps steps, print the peak RSS (JSON; Linux)."""
    name = args.model[0]
    if args.rss_child == "torch":
        step = torch_step(name, args.batch, args.threads, args.device)[0]
    else:
        import numpy as np

        from mpitrain import kernels as registry
        from mpitrain.runtime import threads
        threads.configure(args.threads)
        k = registry.get(args.device, args.kernels)
        parts = mpitrain_step(name, args, k, np.random.default_rng(0))

        def step():
            for part in parts:
                part()
            k.synchronize()
    for _ in range(args.warmup + args.steps):
        step()
    # VmHWM: this address space's peak since exec. (ru_maxrss would not do: Linux carries the
    # parent's peak over fork and exec, so every child reported at least the benchmark's own.)
    with open("/proc/self/status") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    print(json.dumps(dict(peak_rss_mib=kib / 1024)))


def peak_rss_mib(args, name, who):
    """Peak RSS (MiB) of a fresh process training ``name`` with ``who`` (mpitrain | torch)."""
    import subprocess
    cmd = [sys.executable, os.path.abspath(__file__), "--rss-child", who, "--model", name,
           "--batch", str(args.batch), "--threads", str(args.threads), "--device", args.device,
           "--dtype", args.dtype, "--steps", str(args.steps), "--warmup", str(args.warmup)]
    if args.kernels:
        cmd += ["--kernels", args.kernels]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["peak_rss_mib"]


def main(argv=None):
    args = parse_args(argv)
    benchutil.set_threads(args.threads)
    if args.rss_child:
        return rss_child(args)
    # --torch asks for the comparison: no PyTorch is bad input, found before the first timing
    # (after set_threads: importing torch loads NumPy, whose BLAS reads the thread variables).
    if args.torch:
        benchdeps.require_or_exit("torch", "--torch", "step")
    import numpy as np

    from mpitrain import kernels as registry
    from mpitrain.runtime import threads

    threads.configure(args.threads)
    k = registry.get(args.device, args.kernels)
    dtype = np.dtype(args.dtype)
    rng = np.random.default_rng(0)

    clock = time.process_time if args.clock == "cpu" else time.perf_counter

    timed = functools.partial(benchutil.timed, before=k.synchronize, after=k.synchronize,
                              clock=clock)

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
        forward, backward, update = mpitrain_step(name, args, k, rng)

        def full_step():
            forward()
            backward()
            update()

        for _ in range(args.warmup):
            full_step()
        plan = gemm_plan(k, full_step)
        flops = gemm_flops(plan)
        operands = [(k.to_device(rng.standard_normal(a).astype(dtype)),
                     k.to_device(rng.standard_normal(b).astype(dtype)), ta, tb,
                     k.empty(out, dtype), times) for a, b, ta, tb, out, times in plan]

        def gemms():
            for a, b, ta, tb, out, times in operands:
                for _ in range(times):
                    k.gemm(a, b, out, trans_a=ta, trans_b=tb)

        gemms()
        torch_run = None
        if args.torch:
            # Timed inside every round, right after this model's steps: the ratio of the two is
            # taken under the same load (the machine is shared), not minutes apart.
            torch_run, torch_version = torch_step(name, args.batch, args.threads, args.device)
            for _ in range(args.warmup):
                torch_run()
        rounds = []
        for _ in range(args.rounds):
            parts = [[timed(fn) for fn in (forward, backward, update)] for _ in range(args.steps)]
            g = [timed(gemms) for _ in range(args.steps)]
            lv = forward()
            if not np.isfinite(lv):
                raise SystemExit(f"{name}: loss is {lv} after training steps; the step is broken")
            fwd, bwd, upd = (float(v) for v in np.median(parts, axis=0))
            gem = float(np.median(g))
            rounds.append(dict(fwd_ms=fwd * 1e3, bwd_ms=bwd * 1e3, update_ms=upd * 1e3,
                               step_ms=(fwd + bwd + upd) * 1e3, gemm_ms=gem * 1e3,
                               ratio_step_gemm=(fwd + bwd + upd) / gem))
            if torch_run is not None:
                tt = float(np.median([timed(torch_run) for _ in range(args.steps)]))
                rounds[-1].update(torch_step_ms=tt * 1e3, ratio_torch=(fwd + bwd + upd) / tt)
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
        if torch_run is not None:
            best_torch = min(r["torch_step_ms"] for r in rounds)
            ratios = [r["ratio_torch"] for r in rounds]
            res.update(torch_step_ms=best_torch, torch_version=torch_version,
                       torch_device=args.device, ratio_torch_best=best["step_ms"] / best_torch,
                       ratio_torch_rounds=ratios)
            print(f"{'':10s} PyTorch {torch_version} ({args.device}) same model, same rounds: "
                  f"best {best_torch:.2f} ms/step; mpitrain/PyTorch best/best "
                  f"{res['ratio_torch_best']:.2f}, within rounds min {min(ratios):.2f} "
                  f"median {float(np.median(ratios)):.2f}")
        if args.rss:
            res["peak_rss_mib"] = peak_rss_mib(args, name, "mpitrain")
            line = f"{'':10s} peak RSS of a process training it: {res['peak_rss_mib']:.0f} MiB"
            if args.torch:
                res["torch_peak_rss_mib"] = peak_rss_mib(args, name, "torch")
                line += (f", PyTorch {res['torch_peak_rss_mib']:.0f} MiB (ratio "
                         f"{res['peak_rss_mib'] / res['torch_peak_rss_mib']:.2f})")
            print(line)
        if args.profile:
            prof = profile_kernels(k, full_step, args.steps, clock)
            res["profile_ms"] = prof
            print(f"{'':10s} per-kernel ms/step ({sum(prof.values()):.1f} ms in kernels):")
            for key, ms in prof.items():
                if ms >= 0.05:
                    print(f"{'':12s}{ms:8.2f}  {key}")
    paths = [args.json] if args.json else []
    if args.out:
        paths.append(os.path.join(args.out, "step.json"))
    for path in paths:
        benchutil.write_json(path, dict(argv=sys.argv[1:], results=results))
        print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
