"""Cost of --augment crop,flip per training batch, next to the plain gather it follows.

    python benchmarks/augment.py [--batch 64] [--reps 300] [--json PATH]

For Fashion-MNIST-shaped (1, 28, 28, padding 2) and CIFAR-shaped (3, 32, 32, padding 4) float32
batches drawn from a 60000-sample array: the median time of ``images[idx]`` (what every step
does anyway) and of ``Augment(...)(images[idx], idx, epoch)`` (crop + flip), each over --reps
batches of random indices. The augmented batch is checked against a per-sample NumPy reference
once before timing; a mismatch exits 1. One process, one thread: run it with OMP_NUM_THREADS=1.
"""
import argparse
import sys

import numpy as np

import benchutil
import mpitrain as mt

CASES = (("fashion-mnist", (1, 28, 28), 2), ("cifar10", (3, 32, 32), 4))


def reference(images, aug, idx, epoch):
    dy, dx, flipped = aug.choices(idx, epoch)
    p, (h, w) = aug.padding, images.shape[2:]
    out = np.empty_like(images)
    for i, image in enumerate(images):
        padded = np.pad(image, ((0, 0), (p, p), (p, p)), constant_values=float(aug.fill))
        window = padded[:, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = window[:, :, ::-1] if flipped[i] else window
    return out


def median_ms(fn, reps):
    return 1e3 * float(np.median([benchutil.timed(fn) for _ in range(reps)]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for name, shape, padding in CASES:
        images = rng.standard_normal((60000,) + shape, dtype=np.float32)   # (N, C, H, W)
        aug = mt.data.Augment(padding, flip=True, seed=0, fill=-0.81)
        idx = rng.choice(60000, args.batch, replace=False)
        if not np.array_equal(aug(images[idx], idx, 1), reference(images[idx], aug, idx, 1)):
            print(f"{name}: augmented batch differs from the reference", file=sys.stderr)
            return 1
        batches = [rng.choice(60000, args.batch, replace=False) for _ in range(args.reps)]
        it = iter(batches * 2)
        gather = median_ms(lambda: images[next(it)], args.reps)
        it = iter(batches * 2)

        def augmented():
            i = next(it)
            return aug(images[i], i, 1)
        total = median_ms(augmented, args.reps)
        rows.append({"dataset": name, "shape": list(shape), "padding": padding,
                     "batch": args.batch, "gather_ms": gather, "gather_augment_ms": total,
                     "augment_ms": total - gather})
    print(f"{'shape':>12} {'pad':>3} {'gather ms':>10} {'+ crop,flip ms':>15} {'augment ms':>11}")
    for r in rows:
        print(f"{'x'.join(map(str, r['shape'])):>12} {r['padding']:>3} {r['gather_ms']:>10.3f} "
              f"{r['gather_augment_ms']:>15.3f} {r['augment_ms']:>11.3f}")
    if args.json:
        benchutil.write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
