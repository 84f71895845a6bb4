"""PyTorch DDP reference (gloo, CPU) for our ResNet-20 / Fashion-MNIST recipe, same launcher.

    PYTHONPATH=/tmp/torchpkgs OMP_NUM_THREADS=1 mpiexec -n 2 python benchmarks/torch_resnet_ddp.py \
        --json /tmp/acc/torch.json

mirrors, step for step, our

    mpiexec -n 2 python -m mpitrain --model resnet20 --dataset fashion-mnist --epochs 5 \
        --batch-size 64 --lr 0.1 --momentum 0.9 --weight-decay 5e-4 --lr-schedule cosine \
        --augment crop,flip

- model: ResNet-20, CIFAR variant (He et al. 2016) on 1x28x28, as mpitrain/nn/resnet.py and
  residual.py build it: conv3x3 16 (no bias) + BN + ReLU; three stages of three BasicBlocks at
  16/32/64 channels (conv3x3-BN-ReLU-conv3x3-BN, residual add, ReLU), stride 2 in the first
  block of stages 2 and 3 with the parameter-free option-A shortcut (x[:, :, ::2, ::2], (C2-C)/2
  zero channels each side); global average pool; Linear(64, 10). 269,434 parameters, as ours.
  He-normal conv and linear weights (std sqrt(2/fan_in)), linear bias 0, BN weight 1 / bias 0;
  BatchNorm eps 1e-5, momentum 0.1, statistics per rank (no SyncBatchNorm, like ours by default).
- data: Fashion-MNIST from the idx gzips (/usr/share/datasets/fashion-mnist, or --data-dir),
  standardised as ``mt.data.load`` does (normalize 'fixed': pixels/255, mean 0.2860, std 0.3530,
  mpitrain/data/catalog.py). Train-time random crop with 2 pixels of padding (a black pixel,
  before standardisation, as ours and torchvision pad) and a random horizontal flip, per sample.
- sharding: DistributedSampler-style, as mpitrain/data/sampler.py: a permutation per epoch from
  ``np.random.default_rng([seed, epoch])``, cut into global batches of ranks x 64 (drop_last),
  rank r taking elements r, r+N, ... of each.
- optimiser: SGD lr 0.1, momentum 0.9, weight decay 5e-4 on conv/linear weights only (ndim > 1;
  not BN parameters, not biases), lr = 0.1 * (1 + cos(pi * t / T)) / 2 at step t of T in all;
  DDP averages the gradients of the per-rank mean cross-entropy.
- each epoch ends with the test accuracy on all 10,000 test images (sharded over the ranks, after
  the ranks average their BatchNorm running statistics, as ours does before it evaluates).
- one thread per rank (torch.set_num_threads(1)); wall time as ours counts it: the training
  loop and its evaluations (also printed: the whole process, imports and data loading included).

Rank and size come from PMI_RANK / PMI_SIZE (MPICH Hydra) or RANK / WORLD_SIZE; the rendezvous is
MASTER_ADDR 127.0.0.1 and MASTER_PORT (default 29517). Exits 2 with one line when torch or the
dataset is missing. ``--limit N`` trains on the first N samples only (a quick check).
"""
import argparse
import gzip
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))    # step.py, also when loaded by path
import benchutil  # noqa: E402

T_PROCESS = time.perf_counter()
DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
MEAN, STD = 0.2860, 0.3530          # mpitrain/data/catalog.py, Fashion-MNIST's training split
PAD = 2                             # default_crop_padding for 28x28 (mpitrain/data/augment.py)
EVAL_BATCH = 1000


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--weight-decay", type=float, default=5e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N train samples")
    ap.add_argument("--data-dir", default=DEFAULT_DATA_DIR)
    ap.add_argument("--port", type=int, default=int(os.environ.get("MASTER_PORT", 29517)))
    ap.add_argument("--json", default=None, help="write the result to this JSON file (rank 0)")
    args = ap.parse_args(argv)
    benchutil.check_positive(ap, args, ("epochs", "batch_size"))
    return args


# -- data --------------------------------------------------------------------------------------
def read_idx(path):
    """An idx file (gzip) -> uint8 array of the shape its header gives."""
    import numpy as np
    with gzip.open(path, "rb") as fh:
        raw = fh.read()
    if raw[:2] != b"\0\0" or raw[2] != 8:
        raise ValueError(f"{path}: not an idx file of unsigned bytes")
    ndim = raw[3]
    shape = tuple(int.from_bytes(raw[4 + 4 * i:8 + 4 * i], "big") for i in range(ndim))
    return np.frombuffer(raw, np.uint8, offset=4 + 4 * ndim).reshape(shape)


def load_split(data_dir, prefix):
    """(images float32 (N, 1, 28, 28) standardised like mt.data.load, labels int64 (N,))."""
    import numpy as np
    pixels = read_idx(os.path.join(data_dir, f"{prefix}-images-idx3-ubyte.gz"))    # (N, 28, 28)
    labels = read_idx(os.path.join(data_dir, f"{prefix}-labels-idx1-ubyte.gz"))    # (N,)
    a, b = np.float32(1.0 / (255.0 * STD)), np.float32(MEAN / STD)   # loader.normalise's order
    images = pixels[:, None].astype(np.float32)
    images *= a
    images -= b
    return images, labels.astype(np.int64)


def augment(x, rng, fill):
    """Random crop (PAD pixels of ``fill`` each side) and horizontal flip of each sample of x
    (b, C, H, W) float32 -> a new array."""
    import numpy as np
    b, _, h, w = x.shape
    padded = np.full((b, x.shape[1], h + 2 * PAD, w + 2 * PAD), fill, np.float32)
    padded[:, :, PAD:PAD + h, PAD:PAD + w] = x
    dy, dx = rng.integers(0, 2 * PAD + 1, size=(2, b))
    flip = rng.random(b) < 0.5
    out = np.empty_like(x)
    for i in range(b):
        crop = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[:, :, ::-1] if flip[i] else crop
    return out


# -- model -------------------------------------------------------------------------------------
def build_model(torch, classes=10):
    """step.py's PyTorch twin of our resnet20 (same modules, same parameter order), with our
    zoo's initialisation: He-normal conv and linear weights, zero linear bias."""
    from step import torch_resnet20
    model = torch_resnet20(1, classes)
    for m in model.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight, mode="fan_in", nonlinearity="relu")
            if m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    return model


# -- run ---------------------------------------------------------------------------------------
def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        print(f"torch_resnet_ddp: PyTorch is missing ({e}); put it on PYTHONPATH", file=sys.stderr)
        return 2
    import numpy as np
    from torch.nn.parallel import DistributedDataParallel as DDP

    try:
        x_train, y_train = load_split(args.data_dir, "train")
        x_test, y_test = load_split(args.data_dir, "t10k")
    except (OSError, ValueError) as e:
        print(f"torch_resnet_ddp: Fashion-MNIST is missing or unreadable: {e}", file=sys.stderr)
        return 2
    if args.limit:
        x_train, y_train = x_train[:args.limit], y_train[:args.limit]
    fill = np.float32(-MEAN / STD)                  # a black pixel, standardised

    rank = int(os.environ.get("PMI_RANK", os.environ.get("RANK", 0)))
    size = int(os.environ.get("PMI_SIZE", os.environ.get("WORLD_SIZE", 1)))
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(args.port)
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=size)

    torch.manual_seed(args.seed)                    # the same init on every rank (DDP checks)
    model = build_model(torch)
    n_params = sum(p.numel() for p in model.parameters())
    # per-rank BatchNorm statistics (no buffer sync in forward), averaged before each evaluation
    try:
        ddp = DDP(model, forward_sync_buffers=False)
    except TypeError:                               # torch before forward_sync_buffers
        ddp = DDP(model, broadcast_buffers=False)
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    opt = torch.optim.SGD([{"params": decay, "weight_decay": args.weight_decay},
                           {"params": no_decay, "weight_decay": 0.0}],
                          lr=args.lr, momentum=args.momentum)
    loss_fn = torch.nn.CrossEntropyLoss()

    n, b = len(y_train), args.batch_size
    g = size * b
    steps_per_epoch = n // g
    total_steps = steps_per_epoch * args.epochs
    if steps_per_epoch == 0:
        raise SystemExit(f"{n} training samples make no global batch of {g}")
    if rank == 0:
        print(f"resnet20 (torch {torch.__version__}, DDP gloo): {n_params:,} parameters; "
              f"{n} train / {len(y_test)} test samples, {size} rank(s) x {b}, {steps_per_epoch} "
              f"steps/epoch, {args.epochs} epochs, SGD lr {args.lr} cosine over {total_steps} "
              f"steps, momentum {args.momentum}, weight decay {args.weight_decay}, augment "
              f"crop {PAD} + flip, {torch.get_num_threads()} thread(s)/rank", flush=True)

    def evaluate():
        for buf in model.buffers():                 # one model: the mean of the ranks' BN stats
            if buf.is_floating_point():
                dist.all_reduce(buf)
                buf /= size
        model.eval()
        mine = np.arange(rank, len(y_test), size)   # mt.data.shard: every sample once
        hits = torch.zeros(1, dtype=torch.int64)
        with torch.no_grad():
            for s in range(0, len(mine), EVAL_BATCH):
                idx = mine[s:s + EVAL_BATCH]
                logits = model(torch.from_numpy(x_test[idx]))
                hits += (logits.argmax(1) == torch.from_numpy(y_test[idx])).sum()
        dist.all_reduce(hits)
        model.train()
        return hits.item() / len(y_test)

    history, step = [], 0
    dist.barrier()
    t_start = time.perf_counter()
    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        order = np.random.default_rng([args.seed, epoch]).permutation(n).astype(np.int64)
        shares = order[:steps_per_epoch * g].reshape(steps_per_epoch, g)[:, rank::size]
        aug_rng = np.random.default_rng([args.seed, epoch, rank, 1])
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for idx in shares:
            lr = args.lr * 0.5 * (1.0 + math.cos(math.pi * step / total_steps))
            for group in opt.param_groups:
                group["lr"] = lr
            xb = torch.from_numpy(augment(x_train[idx], aug_rng, fill))   # (b, 1, 28, 28)
            yb = torch.from_numpy(y_train[idx])
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(xb), yb)
            loss.backward()                         # DDP averages the gradients over ranks
            opt.step()
            loss_sum += loss.detach()
            step += 1
        train_s = time.perf_counter() - t0
        dist.all_reduce(loss_sum)
        train_loss = loss_sum.item() / (size * steps_per_epoch)
        if not math.isfinite(train_loss):
            raise SystemExit(f"epoch {epoch + 1}: training loss is {train_loss}; diverged")
        acc = evaluate()
        history.append(dict(epoch=epoch + 1, train_loss=train_loss, test_acc=acc,
                            epoch_s=train_s, elapsed_s=time.perf_counter() - t_start))
        if rank == 0:
            print(f"epoch {epoch + 1}: train loss {train_loss:.4f}, test acc {acc:.4f}, "
                  f"{train_s:.1f} s ({train_s / steps_per_epoch * 1e3:.1f} ms/step), "
                  f"{time.perf_counter() - t_start:.1f} s so far", flush=True)
    wall = time.perf_counter() - t_start
    if rank == 0:
        result = dict(argv=sys.argv[1:], framework="torch", torch=torch.__version__,
                      backend="gloo", ranks=size, batch_size=b, global_batch=g,
                      epochs=args.epochs, steps=step, lr=args.lr, momentum=args.momentum,
                      weight_decay=args.weight_decay, seed=args.seed, train_samples=n,
                      parameters=n_params, threads=torch.get_num_threads(),
                      test_acc=history[-1]["test_acc"],
                      test_acc_per_epoch=[h["test_acc"] for h in history],
                      wall_time_s=wall, process_s=time.perf_counter() - T_PROCESS,
                      history=history)
        if args.json:
            benchutil.write_json(args.json, result)
        print(f"final test accuracy {result['test_acc']:.4f}; {step} steps; wall time "
              f"{wall:.1f} s (training + evaluations), {result['process_s']:.1f} s whole process",
              flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
