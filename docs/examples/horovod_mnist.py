"""Horovod's PyTorch MNIST example (examples/pytorch/pytorch_mnist.py), ported to mpitrain.

Same structure, same defaults, same network; each Horovod call is replaced by its mpitrain name
and each step that differs says why in a comment tagged "mpitrain:". One default differs: the
data is Fashion-MNIST (a drop-in for MNIST: same file format, shapes and classes; `make run`
installs it); --dataset mnist trains on Horovod's MNIST. Run it with

    mpiexec -n 2 python docs/examples/horovod_mnist.py --epochs 1            # Fashion-MNIST
    mpiexec -n 2 python docs/examples/horovod_mnist.py --dataset mnist       # MNIST's files
    mpiexec -n 2 python docs/examples/horovod_mnist.py --dataset synthetic   # no files needed

Not ported: --use-mixed-precision (no autocast here), --use-adasum (no Adasum op), --no-cuda and
the horovod.run launcher (--num-proc, --hosts, --communication): launch with mpiexec instead.
tests/e2e/test_horovod_example.py runs this file on two ranks.
"""
import argparse
import hashlib
import sys

import numpy as np

import mpitrain as mt

# Training settings
parser = argparse.ArgumentParser(description="mpitrain port of Horovod's PyTorch MNIST example")
parser.add_argument("--batch-size", type=int, default=64, metavar="N",
                    help="input batch size for training, per rank (default: 64)")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N",
                    help="input batch size for testing (default: 1000)")
parser.add_argument("--epochs", type=int, default=10, metavar="N",
                    help="number of epochs to train (default: 10)")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR",
                    help="learning rate (default: 0.01)")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M",
                    help="SGD momentum (default: 0.5)")
parser.add_argument("--seed", type=int, default=42, metavar="S",
                    help="random seed (default: 42)")
parser.add_argument("--log-interval", type=int, default=10, metavar="N",
                    help="how many batches to wait before logging training status")
parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                    help="use fp16 compression during allreduce")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer (default: 1.0)")
parser.add_argument("--data-dir",
                    help="location of the dataset (default: mpitrain's search path)")
# mpitrain: the dataset is a choice, so the example also runs where MNIST cannot be downloaded;
# the default is Fashion-MNIST (MNIST's format and shapes), the dataset `make run` installs.
parser.add_argument("--dataset", default="fashion-mnist",
                    choices=["mnist", "fashion-mnist", "synthetic"],
                    help="dataset (default: fashion-mnist; synthetic needs no files)")
parser.add_argument("--synthetic-samples", type=int, default=6000, metavar="N",
                    help="training samples of --dataset synthetic (default: 6000)")


def net(seed):
    """Horovod's Net: conv5-10, pool, relu, conv5-20, dropout, pool, relu, fc50, dropout, fc10.

    mpitrain: a Sequential of layers. ReLU is fused into the convolutions (relu(pool(x)) equals
    pool(relu(x))), Dropout zeroes elements where Dropout2d zeroes whole channels, and the
    log_softmax + nll_loss pair is SoftmaxCrossEntropy (the same loss, fused).
    """
    rng = np.random.default_rng(seed)
    return mt.nn.Sequential(
        mt.nn.Conv2D(1, 10, 5, relu=True, seed=rng, init="glorot"),     # (B, 10, 24, 24)
        mt.nn.MaxPool2D(2),                              # (B, 10, 12, 12)
        mt.nn.Conv2D(10, 20, 5, relu=True, seed=rng, init="glorot"),    # (B, 20, 8, 8)
        mt.nn.Dropout(0.5, seed=seed),
        mt.nn.MaxPool2D(2),                              # (B, 20, 4, 4)
        mt.nn.Flatten(),                                 # (B, 320)
        mt.nn.Linear(320, 50, relu=True, seed=rng, init="glorot"),
        mt.nn.Dropout(0.5, seed=seed + 1),
        mt.nn.Linear(50, 10, seed=rng, init="glorot"),
        input_shape=(1, 28, 28))


def datasets(args):
    if args.dataset == "synthetic":
        train = mt.data.synthetic(args.synthetic_samples, shape=(1, 28, 28), seed=args.seed)
        test = mt.data.synthetic(args.synthetic_samples // 6, shape=(1, 28, 28),
                                 seed=args.seed)
        # same class prototypes (same seed), other noise: a held-out set of the same classes
        rng = np.random.default_rng(args.seed + 1)
        noise = rng.standard_normal(test.images.shape).astype(np.float32)
        test.images = ((test.images * np.sqrt(2.0) + noise) / np.sqrt(3.0)).astype(np.float32)
        return train, test
    # mpitrain: the files are already normalised (mean/std per dataset, as Normalize does).
    return (mt.data.load(args.dataset, "train", data_dir=args.data_dir),
            mt.data.load(args.dataset, "test", data_dir=args.data_dir))


def train(args):
    def train_epoch(epoch):
        model.train()
        # Horovod: set epoch to sampler for shuffling.
        train_sampler.set_epoch(epoch)
        for batch_idx, idx in enumerate(train_sampler.batches()):
            data, target = train_dataset.images[idx], train_dataset.labels[idx]
            optimizer.zero_grad()
            output = model(data)
            loss = loss_fn(output, target)
            # mpitrain: backward is the model's; the hook starts each layer's allreduce at once.
            model.backward(loss_fn.backward(), on_layer_done=optimizer.backward_hook)
            optimizer.step()
            # mpitrain: rank 0 alone prints (Horovod's example prints on every rank).
            if batch_idx % args.log_interval == 0 and mt.rank() == 0:
                print("Train Epoch: {} [{}/{} ({:.0f}%)]\tLoss: {:.6f}".format(
                    epoch, batch_idx * len(data), len(train_sampler),
                    100. * batch_idx / train_sampler.num_batches(), loss), flush=True)

    def test():
        # mpitrain: instead of a DistributedSampler shard per rank (which pads or drops) and an
        # average of the ranks' accuracies (which weighs unequal shards equally), mt.evaluate
        # scores every test sample exactly once and sums the counts across ranks.
        result = mt.evaluate(model, test_dataset, batch_size=args.test_batch_size)
        # Horovod: print output only on first rank.
        if mt.rank() == 0:
            print("\nTest set: Average loss: {:.4f}, Accuracy: {:.2f}%\n".format(
                result["loss"], 100. * result["accuracy"]), flush=True)
        return result

    # Horovod: initialize library.
    # mpitrain: init also limits each rank's BLAS threads to cores / ranks on the node (the
    # example's torch.set_num_threads(1)).
    mt.init()

    try:
        train_dataset, test_dataset = datasets(args)
    except mt.data.DataError as exc:
        # mpitrain: every rank fails the same way (same files); one line, exit code 2.
        if mt.rank() == 0:
            print(f"horovod_mnist: {exc}", file=sys.stderr)
        sys.exit(2)

    # Horovod: use DistributedSampler to partition the training data.
    # mpitrain: the sampler also batches (no DataLoader); rank r takes r, r+N, ... of each
    # global batch of a seeded permutation.
    train_sampler = mt.data.DistributedSampler(
        train_dataset, num_replicas=mt.size(), rank=mt.rank(), batch_size=args.batch_size,
        seed=args.seed)

    # mpitrain: torch.manual_seed(args.seed) + Net() -> the seed draws the initial weights.
    model = net(args.seed)
    loss_fn = mt.nn.SoftmaxCrossEntropy()

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = mt.size()

    # Horovod: scale learning rate by lr_scaler.
    optimizer = mt.optim.SGD(model.parameters(), lr=args.lr * lr_scaler,
                             momentum=args.momentum)

    # Horovod: broadcast parameters & optimizer state.
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    mt.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = mt.Compression.fp16 if args.fp16_allreduce else mt.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    optimizer = mt.DistributedOptimizer(optimizer,
                                        named_parameters=model.named_parameters(),
                                        compression=compression,
                                        op=mt.Average,
                                        gradient_predivide_factor=args.gradient_predivide_factor)

    result = None
    for epoch in range(1, args.epochs + 1):
        train_epoch(epoch)
        result = test()

    # mpitrain: the replicas must have stayed one model; say so (a digest of every parameter).
    digest = hashlib.sha256(b"".join(np.ascontiguousarray(a).tobytes()
                                     for a in model.state_dict().values())).hexdigest()
    digests = mt.allgather_object(digest)
    if mt.rank() == 0:
        same = len(set(digests)) == 1
        print(f"replicas bitwise equal: {same} ({len(digests)} ranks, sha256 {digest[:16]})")
        if result is not None:
            print(f"final test accuracy: {result['accuracy']:.4f}")
    return result


if __name__ == "__main__":
    train(parser.parse_args())
