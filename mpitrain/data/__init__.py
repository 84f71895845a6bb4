"""Datasets: IDX (MNIST, Fashion-MNIST), CIFAR-10 binary, synthetic; locating and fetching."""
