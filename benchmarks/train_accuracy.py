"""Single-process accuracy run: train a zoo model on a real dataset, report test accuracy.

    python benchmarks/train_accuracy.py --model mlp --epochs 2      # target >= 85% (Fashion-MNIST)
    python benchmarks/train_accuracy.py --model lenet --epochs 2    # target >= 88%

No MPI: this checks the engine alone (kernels, layers, loss, optimizer) against the reference
accuracy targets, with the same recipe for every model: SGD lr 0.05, momentum 0.9, batch 64, a
seeded shuffle per epoch, the last partial batch included. Exits 1 when the final test accuracy
misses ``--target`` (default: the model's figure in TARGETS), so a broken engine cannot pass
silently; exits 2 with one line when the dataset or the backend is missing.
"""
import argparse
import sys
import time

import benchutil

TARGETS = {"mlp": 0.85, "lenet": 0.88}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="mlp", choices=("mlp", "lenet", "cifar_cnn"))
    ap.add_argument("--dataset", default="fashion-mnist")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="BLAS and Numba threads")
    ap.add_argument("--limit", type=int, default=None, help="use only the first N train samples")
    ap.add_argument("--target", type=float, default=None, help="minimum test accuracy (0-1)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kernels", default=None, help="kernel flavour (registry): numba | cupy")
    ap.add_argument("--json", default=None, help="write the result to this JSON file")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("epochs", "batch", "threads"))
    return args


def main(argv=None):
    args = parse_args(argv)
    benchutil.set_threads(args.threads)
    import numpy as np

    import mpitrain as mt
    from mpitrain import kernels as registry

    try:
        k = registry.get(args.device, args.kernels)
        train = mt.data.load(args.dataset, split="train", data_dir=args.data_dir)
        test = mt.data.load(args.dataset, split="test", data_dir=args.data_dir)
    except (ValueError, ImportError, RuntimeError) as e:     # DataError is a ValueError
        print(f"train_accuracy: {e}", file=sys.stderr)
        return 2
    x_train, y_train = train.images, train.labels
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    model = mt.models.get(args.model, classes=train.classes, seed=args.seed, kernels=k)
    shape = model.input_shape
    loss = mt.nn.SoftmaxCrossEntropy(kernels=k)
    opt = mt.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    rng = np.random.default_rng(args.seed)
    n = len(y_train)
    print(f"{args.model} on {train.name}: {n} train / {len(test.labels)} test samples, batch "
          f"{args.batch}, SGD lr {args.lr} momentum {args.momentum}, {args.epochs} epochs, "
          f"{args.threads} thread(s), kernels {k.name}", flush=True)

    def evaluate():
        model.eval()
        hits = 0
        for s in range(0, len(test.labels), 1000):
            xb = k.to_device(test.images[s:s + 1000].reshape((-1,) + shape))
            yb = k.to_device(test.labels[s:s + 1000])
            loss.forward(model.forward(xb), yb)
            hits += loss.correct
        model.train()
        return hits / len(test.labels)

    history, t_start = [], time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        t0 = time.perf_counter()
        order = rng.permutation(n)
        loss_sum, hits = 0.0, 0
        for s in range(0, n, args.batch):
            idx = order[s:s + args.batch]
            xb = k.to_device(x_train[idx].reshape((-1,) + shape))      # (B, *input_shape)
            yb = k.to_device(y_train[idx])
            opt.zero_grad()
            loss_sum += loss.forward(model.forward(xb), yb) * len(idx)
            hits += loss.correct
            model.backward(loss.backward())
            opt.step()
        k.synchronize()
        train_s = time.perf_counter() - t0
        if not np.isfinite(loss_sum):
            raise SystemExit(f"epoch {epoch}: training loss is {loss_sum}; diverged")
        acc = evaluate()
        history.append(dict(epoch=epoch, train_loss=loss_sum / n, train_acc=hits / n,
                            test_acc=acc, epoch_s=train_s))
        print(f"epoch {epoch}: train loss {loss_sum / n:.4f}, train acc {hits / n:.4f}, "
              f"test acc {acc:.4f}, {train_s:.1f} s ({train_s / -(-n // args.batch) * 1e3:.1f} "
              f"ms/step)", flush=True)
    target = args.target if args.target is not None else TARGETS.get(args.model, 0.0)
    result = dict(argv=sys.argv[1:], model=args.model, dataset=train.name, epochs=args.epochs,
                  batch=args.batch, lr=args.lr, momentum=args.momentum, seed=args.seed,
                  threads=args.threads, test_acc=history[-1]["test_acc"], target=target,
                  total_s=time.perf_counter() - t_start, history=history)
    if args.json:
        benchutil.write_json(args.json, result)
    ok = result["test_acc"] >= target
    print(f"final test accuracy {result['test_acc']:.4f} (target {target:.2f}): "
          f"{'OK' if ok else 'BELOW TARGET'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
