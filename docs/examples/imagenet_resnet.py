"""Horovod's PyTorch ImageNet example (examples/pytorch/pytorch_imagenet_resnet50.py), ported.

Same structure, same flags and defaults where they make sense (those of Goyal et al., "Accurate,
Large Minibatch SGD", arXiv:1706.02677): the learning rate warms up per batch from --base-lr to
--base-lr x ranks over --warmup-epochs (both times --batches-per-allreduce) and drops tenfold at
epochs 30, 60 and 80; losses and accuracies are averaged across ranks with mt.Metric; rank 0
finds the epoch to resume from; a checkpoint is written every epoch. Each step that differs
from Horovod's says why in a comment tagged "mpitrain:". Run it with

    mpiexec -n 2 python docs/examples/imagenet_resnet.py                          # CIFAR-10
    mpiexec -n 2 python docs/examples/imagenet_resnet.py --dataset synthetic --epochs 2

and run the same command again with more --epochs: it resumes after the last saved epoch.

The model is ResNet-20 (He et al.'s CIFAR ResNet, mt.models.resnet20), not ResNet-50: the model
zoo has no ImageNet-sized ResNet and mpitrain reads no ImageNet folders, so the data is CIFAR-10,
Fashion-MNIST or synthetic (--dataset) and the augmentation is the CIFAR recipe (pad-and-crop,
flip) in place of RandomResizedCrop(224). Not ported: --use-adasum (no Adasum op), --log-dir
(no TensorBoard), --no-cuda, tqdm progress bars (rank 0 prints one line per epoch), and
--checkpoint-format: checkpoints are ckpt-<step>.npz files in --checkpoint-dir, written and read
by mt.checkpoint.save / load_latest (collective: rank 0 alone touches the folder).
tests/e2e/test_imagenet_example.py runs this file on two ranks.
"""
import argparse
import hashlib
import math
import sys

import numpy as np

import mpitrain as mt

# Training settings
parser = argparse.ArgumentParser(description="mpitrain port of Horovod's PyTorch ImageNet example",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
# mpitrain: --train-dir/--val-dir (ImageFolder trees) -> a dataset name and its folder.
parser.add_argument("--dataset", default="cifar10",
                    choices=["cifar10", "fashion-mnist", "synthetic"],
                    help="dataset (synthetic needs no files)")
parser.add_argument("--data-dir",
                    help="location of the dataset (default: mpitrain's search path)")
parser.add_argument("--synthetic-samples", type=int, default=2560,
                    help="training samples of --dataset synthetic (validation: a quarter more)")
parser.add_argument("--checkpoint-dir", default="./checkpoints",
                    help="checkpoint folder: rank 0 writes ckpt-<step>.npz there every epoch "
                         "and training resumes from the newest one")
parser.add_argument("--checkpoint-format",
                    help="Horovod's per-epoch file name; mpitrain uses --checkpoint-dir instead")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--batches-per-allreduce", type=int, default=1,
                    help="number of batches processed locally before "
                         "executing allreduce across workers; it multiplies "
                         "total batch size.")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")

# Default settings from https://arxiv.org/abs/1706.02677.
parser.add_argument("--batch-size", type=int, default=32,
                    help="input batch size for training")
parser.add_argument("--val-batch-size", type=int, default=32,
                    help="input batch size for validation")
parser.add_argument("--epochs", type=int, default=90,
                    help="number of epochs to train")
parser.add_argument("--base-lr", type=float, default=0.0125,
                    help="learning rate for a single worker")
parser.add_argument("--warmup-epochs", type=float, default=5,
                    help="number of warmup epochs")
parser.add_argument("--momentum", type=float, default=0.9,
                    help="SGD momentum")
parser.add_argument("--wd", type=float, default=0.00005,
                    help="weight decay")
parser.add_argument("--seed", type=int, default=42,
                    help="random seed")


def fail(message):
    """mpitrain: bad input is one line on rank 0 and exit code 2 on every rank (every rank
    checks the same input, so every rank takes this exit)."""
    if mt.rank() == 0:
        print(f"imagenet_resnet: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def check_args(args):
    if args.checkpoint_format is not None:
        fail(f"--checkpoint-format {args.checkpoint_format!r}: checkpoints are ckpt-<step>.npz "
             f"files in --checkpoint-dir (default ./checkpoints); give that instead")
    for flag in ("batch_size", "val_batch_size", "epochs", "batches_per_allreduce",
                 "synthetic_samples"):
        if getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 1")
    for flag in ("warmup_epochs", "wd", "momentum"):
        if not getattr(args, flag) >= 0:                    # also refuses nan
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be >= 0")
    for flag in ("base_lr", "gradient_predivide_factor"):
        if not 0 < getattr(args, flag) < math.inf:
            fail(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be > 0 and finite")


def datasets(args):
    if args.dataset == "synthetic":
        # mpitrain: one draw cut in two, so validation has the training set's class prototypes.
        n_val = max(1, args.synthetic_samples // 4)
        full = mt.data.synthetic(args.synthetic_samples + n_val, shape=(3, 32, 32),
                                 seed=args.seed)
        cut = args.synthetic_samples
        return tuple(mt.data.Dataset(full.images[s], full.labels[s], full.classes, "synthetic")
                     for s in (slice(0, cut), slice(cut, None)))
    # mpitrain: the files are already normalised (mean/std per dataset, as Normalize does).
    return (mt.data.load(args.dataset, "train", data_dir=args.data_dir),
            mt.data.load(args.dataset, "test", data_dir=args.data_dir))


def train(args):
    def train_epoch(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        train_loss = mt.Metric("train_loss")
        train_accuracy = mt.Metric("train_accuracy")

        for batch_idx, idx in enumerate(train_sampler.batches()):
            adjust_learning_rate(epoch, batch_idx)

            # mpitrain: the sampler yields indices; crop and flip are keyed by sample and epoch.
            data = train_dataset.images[idx]                  # (b * k, C, H, W)
            if augment is not None:
                data = augment(data, idx, epoch)
            target = train_dataset.labels[idx]
            optimizer.zero_grad()
            # Split data into sub-batches of size batch_size
            passes = math.ceil(float(len(data)) / args.batch_size)
            for i in range(0, len(data), args.batch_size):
                data_batch = data[i:i + args.batch_size]
                target_batch = target[i:i + args.batch_size]
                output = model(data_batch)
                loss = loss_fn(output, target_batch)
                train_accuracy.update(loss_fn.correct / len(target_batch))
                train_loss.update(loss)
                # Average gradients among sub-batches
                grad = loss_fn.backward()
                grad *= np.float32(1.0 / passes)
                # mpitrain: backward is the model's; the hook counts the passes and starts the
                # allreduce during the last one.
                model.backward(grad, on_layer_done=optimizer.backward_hook)
            # Gradient is applied across all ranks
            optimizer.step()

        # mpitrain: plain BatchNorm keeps running statistics of each rank's own samples; their
        # mean makes the replicas one model again before validation and the checkpoint.
        mt.grouped_allreduce_(model.buffers(), op=mt.Average, name="batchnorm_statistics")
        # mpitrain: one line per epoch on rank 0 instead of a tqdm bar.
        if mt.rank() == 0:
            print("Train Epoch     #{}: loss {:.4f}, accuracy {:.2f}%, lr {:.6f}".format(
                epoch + 1, train_loss.avg, 100. * train_accuracy.avg, optimizer.lr), flush=True)

    def validate(epoch):
        model.eval()
        val_loss = mt.Metric("val_loss")
        val_accuracy = mt.Metric("val_accuracy")

        # mpitrain: rank r scores samples r, r+N, ... (mt.data.shard: nothing padded, nothing
        # dropped) and each update is weighted by its batch's size, so the averages are the
        # whole validation set's. Shards differ by at most one sample, so a rank can run out of
        # batches early: it adds n=0 while the others finish (every rank updates equally often).
        mine = mt.data.shard(len(val_dataset))
        longest = math.ceil(len(val_dataset) / mt.size())
        for start in range(0, longest, args.val_batch_size):
            idx = mine[start:start + args.val_batch_size]
            loss, accuracy = 0.0, 0.0
            if len(idx):
                output = model(val_dataset.images[idx])
                loss = loss_fn(output, val_dataset.labels[idx])
                accuracy = loss_fn.correct / len(idx)
            val_loss.update(loss, n=len(idx))
            val_accuracy.update(accuracy, n=len(idx))

        if mt.rank() == 0:
            print("Validate Epoch  #{}: loss {:.4f}, accuracy {:.2f}%".format(
                epoch + 1, val_loss.avg, 100. * val_accuracy.avg), flush=True)
        return val_accuracy.avg

    # Horovod: using `lr = base_lr * hvd.size()` from the very beginning leads to worse final
    # accuracy. Scale the learning rate `lr = base_lr` ---> `lr = base_lr * hvd.size()` during
    # the first five epochs. See https://arxiv.org/abs/1706.02677 for details.
    # After the warmup reduce learning rate by 10 on the 30th, 60th and 80th epochs.
    def adjust_learning_rate(epoch, batch_idx):
        if epoch < args.warmup_epochs:
            epoch += float(batch_idx + 1) / steps_per_epoch
            lr_adj = 1. / mt.size() * (epoch * (mt.size() - 1) / args.warmup_epochs + 1)
        elif epoch < 30:
            lr_adj = 1.
        elif epoch < 60:
            lr_adj = 1e-1
        elif epoch < 80:
            lr_adj = 1e-2
        else:
            lr_adj = 1e-3
        optimizer.lr = args.base_lr * mt.size() * args.batches_per_allreduce * lr_adj

    def save_checkpoint(epoch):
        # mpitrain: collective: every rank calls it and rank 0 alone writes (Horovod: an `if
        # hvd.rank() == 0`). The file is ckpt-<step>.npz (step: the optimizer's update count)
        # and holds the parameters, the running statistics, the optimizer state and the epoch.
        mt.checkpoint.save(args.checkpoint_dir, model, optimizer, extra={"epoch": epoch})

    # Horovod: initialize library.
    # mpitrain: init also limits each rank's BLAS threads to cores / ranks on the node (the
    # example's torch.set_num_threads(4)).
    mt.init()
    check_args(args)

    try:
        train_dataset, val_dataset = datasets(args)
    except mt.data.DataError as exc:
        # mpitrain: every rank fails the same way (same files); one line, exit code 2.
        fail(exc)

    allreduce_batch_size = args.batch_size * args.batches_per_allreduce
    if allreduce_batch_size * mt.size() > len(train_dataset):
        fail(f"--batch-size {args.batch_size} x --batches-per-allreduce "
             f"{args.batches_per_allreduce} x {mt.size()} ranks exceeds the "
             f"{len(train_dataset)} training samples of {args.dataset}")

    # Horovod: use DistributedSampler to partition data among workers.
    # mpitrain: the sampler also batches (no DataLoader): rank r takes r, r+N, ... of each global
    # batch of a seeded permutation; every rank runs the same number of steps.
    train_sampler = mt.data.DistributedSampler(
        train_dataset, num_replicas=mt.size(), rank=mt.rank(), batch_size=allreduce_batch_size,
        seed=args.seed)
    steps_per_epoch = train_sampler.num_batches()
    augment = None
    if args.dataset != "synthetic":
        augment = mt.data.Augment(mt.data.default_crop_padding(train_dataset.sample_shape),
                                  flip=True, seed=args.seed, fill=train_dataset.fill)

    # Set up standard ResNet-50 model.
    # mpitrain: ResNet-20, the zoo's CIFAR ResNet; the seed draws the initial weights.
    model = mt.models.resnet20(input_shape=train_dataset.sample_shape,
                               classes=train_dataset.classes, seed=args.seed)
    loss_fn = mt.nn.SoftmaxCrossEntropy()

    # For sum/average with gradient Accumulation: scale learning rate by batches_per_allreduce
    lr_scaler = args.batches_per_allreduce * mt.size()

    # Horovod: scale learning rate by the number of workers.
    optimizer = mt.optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler,
                             momentum=args.momentum, weight_decay=args.wd)

    # Horovod: (optional) compression algorithm.
    compression = mt.Compression.fp16 if args.fp16_allreduce else mt.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = mt.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(),
        compression=compression,
        backward_passes_per_step=args.batches_per_allreduce,
        op=mt.Average,
        gradient_predivide_factor=args.gradient_predivide_factor)

    # Horovod: find resume_from_epoch on rank 0 (the newest checkpoint file), broadcast it, and
    # restore on the first worker, which will broadcast weights to other workers.
    # mpitrain: load_latest does all of that: rank 0 reads the newest valid checkpoint of
    # --checkpoint-dir and broadcasts it; every rank loads it and returns the same meta (None:
    # no checkpoint yet), so resume_from_epoch is rank 0's on every rank.
    try:
        meta = mt.checkpoint.load_latest(args.checkpoint_dir, model, optimizer)
    except mt.checkpoint.CheckpointError as exc:
        fail(exc)                                         # the same error on every rank
    resume_from_epoch = 0 if meta is None else meta["epoch"] + 1
    if resume_from_epoch > 0 and mt.rank() == 0:
        print(f"resuming from epoch {resume_from_epoch} (step {meta['step']})", flush=True)

    # Horovod: broadcast parameters & optimizer state.
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    mt.broadcast_optimizer_state(optimizer, root_rank=0)

    accuracy = None
    for epoch in range(resume_from_epoch, args.epochs):
        train_epoch(epoch)
        accuracy = validate(epoch)
        try:
            save_checkpoint(epoch)
        except mt.checkpoint.CheckpointError as exc:
            fail(exc)                                     # e.g. a full disk, on every rank

    # mpitrain: the replicas must have stayed one model; say so (a digest of every parameter
    # and running statistic).
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes()
                                     for a in model.state_dict().values())).hexdigest()
    digests = mt.allgather_object(digest)
    if mt.rank() == 0:
        same = len(set(digests)) == 1
        print(f"replicas bitwise equal: {same} ({len(digests)} ranks, sha256 {digest[:16]})")
        if accuracy is not None:
            print(f"final validation accuracy: {accuracy:.4f}")
    return accuracy


if __name__ == "__main__":
    train(parser.parse_args())
