"""Where a GPU training step spends its time, kernel by kernel.

    python benchmarks/gpu_profile.py --model lenet resnet20 --batch 256 [--kernels cupy]
                                     [--steps 5] [--top 15] [--torch] [--json FILE]

Runs the zoo model's training step (benchmarks/step.py's: forward, loss, backward, SGD) a few
times to warm up, then ``--steps`` more under PyTorch's profiler, which records every kernel the
process launches on the GPU (CuPy's and Numba's too, through CUPTI). Prints per model: the wall
time of a step, the GPU's busy time in it (the sum of kernel and copy times), the launches per
step, and the ``--top`` kernels by time with their share. ``--torch`` profiles PyTorch's own step
of the same network beside it. Needs a GPU and PyTorch (for the profiler only).
"""
import argparse
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import benchdeps  # noqa: E402
import benchutil  # noqa: E402
import step as step_bench  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", nargs="+", default=["lenet", "resnet20"], choices=step_bench.MODELS)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--kernels", default="cupy", choices=("cupy", "numba"))
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--torch", action="store_true", help="profile PyTorch's step beside ours")
    ap.add_argument("--json", default=None, help="write the tables here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be >= 1")
    return args


def profile(step, steps, warmup, sync):
    """(wall seconds per step, {kernel name: [launches, device seconds]}) of ``steps`` steps."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    def run(count):
        for _ in range(count):
            step()

    run(warmup)
    sync()
    with torch_profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        wall = benchutil.timed(lambda: run(steps), after=sync) / steps
    kernels = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA":
            k = kernels[ev.name]
            k[0] += 1
            k[1] += ev.device_time_total * 1e-6 if hasattr(ev, "device_time_total") else (
                ev.cuda_time_total * 1e-6)
    return wall, kernels


def table(title, wall, kernels, steps, top):
    busy = sum(t for _, t in kernels.values()) / steps
    launches = sum(n for n, _ in kernels.values()) / steps
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    print(f"\n{title}: step {wall * 1e3:.2f} ms wall, GPU busy {busy * 1e3:.2f} ms "
          f"({busy / wall:.0%}), {launches:.0f} launches per step")
    print(f"  {'ms/step':>8s} {'share':>6s} {'calls':>6s}  kernel")
    for name, (n, t) in rows[:top]:
        print(f"  {t / steps * 1e3:8.3f} {t / steps / busy:6.1%} {n / steps:6.0f}  {name[:90]}")
    return dict(wall_ms=wall * 1e3, busy_ms=busy * 1e3, launches=launches,
                kernels=[dict(name=name, calls=n / steps, ms=t / steps * 1e3)
                         for name, (n, t) in rows])


def main(argv=None):
    args = parse_args(argv)
    benchdeps.require_or_exit("torch", "the profiler", "gpu_profile")
    import numpy as np
    import torch

    from mpitrain import kernels as registry
    k = registry.get("cuda", args.kernels)
    ns = argparse.Namespace(batch=args.batch, dtype="float32")
    out = {}
    for name in args.model:
        parts = step_bench.mpitrain_step(name, ns, k, np.random.default_rng(0))

        def step(parts=parts):
            for part in parts:
                part()
        wall, kernels = profile(step, args.steps, args.warmup, k.synchronize)
        out[name] = dict(ours=table(f"{name} batch {args.batch}, ours ({k.name})", wall,
                                    kernels, args.steps, args.top))
        if args.torch:
            tstep = step_bench.torch_step(name, args.batch, 1, "cuda")[0]
            wall, kernels = profile(tstep, args.steps, args.warmup, torch.cuda.synchronize)
            out[name]["torch"] = table(f"{name} batch {args.batch}, PyTorch {torch.__version__}",
                                       wall, kernels, args.steps, args.top)
    if args.json:
        benchutil.write_json(args.json, out)


if __name__ == "__main__":
    main()
