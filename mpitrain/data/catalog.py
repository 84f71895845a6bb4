"""What we know about each named dataset: its files, format, shape, normalisation and sources.

One table, so the reader (loader.py), the search (locate.py) and the download (fetch.py) agree on
file names and checksums without repeating them.

Checksums are SHA-256 of the files exactly as the official sources serve them.
- Fashion-MNIST: derived from the real files. Debian's `dataset-fashion-mnist` re-wraps the
  official gzips (same deflate stream; header without the original file name, so 23-24 bytes
  shorter, and a 2020 mtime); restoring the original header rebuilds the official files byte for
  byte, and their SHA-256s are the ones below (tests/unit/test_data_catalog.py redoes this
  wherever the package is installed). They also match what TensorFlow Datasets pins.
- MNIST: the values TensorFlow Datasets and many projects pin (not checkable offline here).
- CIFAR-10: the archive hash TensorFlow Datasets pins, with the size 170,052,171 bytes; its MD5,
  c32a1d4ab5d03f1284b67883e8d87530, is the one the CIFAR page publishes (not checkable here).
Installed copies are never hash-checked (Debian's differ in their gzip header); the readers check
their structure instead.

Texts (TEXTS: corpora for TextDataset, fetched but never "loaded" as image datasets):
- tiny-shakespeare: Karpathy's char-rnn input.txt, 1,115,394 bytes; its SHA-256 is the one that
  TensorFlow Datasets and many projects pin for that URL.

Normalisation constants are the mean/std of the training split's pixels scaled to [0, 1]
(Fashion-MNIST's were measured on the real files: 0.2860, 0.3530).
"""
from dataclasses import dataclass, field

from mpitrain.runtime.errors import DataError

__all__ = ["Source", "Spec", "SPECS", "spec", "check_split", "TextSpec", "TEXTS", "text_spec"]


@dataclass(frozen=True)
class Source:
    """One file to download: saved as `filename`, tried from each URL in turn."""
    filename: str
    urls: tuple
    sha256: str
    size: int


@dataclass(frozen=True)
class Spec:
    name: str
    format: str                 # "idx" or "cifar"
    splits: dict                # split -> file names (idx: (images, labels); cifar: batches)
    sample_shape: tuple         # (C, H, W)
    classes: int
    mean: tuple                 # per channel, pixels in [0, 1]
    std: tuple
    sources: tuple              # Source, ...
    debian_package: str = None
    archive_dir: str = None     # folder inside the downloaded archive holding the files
    labels: tuple = field(default=())

    @property
    def files(self):
        """Every file the dataset needs, train then test."""
        return tuple(f for split in ("train", "test") for f in self.splits[split])


_IDX_SPLITS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def _idx_sources(bases, hashes_sizes):
    return tuple(Source(f + ".gz", tuple(b + f + ".gz" for b in bases), sha, size)
                 for f, (sha, size) in hashes_sizes.items())


_FASHION = _idx_sources(("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/",), {
    "train-images-idx3-ubyte":
        ("3aede38d61863908ad78613f6a32ed271626dd12800ba2636569512369268a84", 26421880),
    "train-labels-idx1-ubyte":
        ("a04f17134ac03560a47e3764e11b92fc97de4d1bfaf8ba1a3aa29af54cc90845", 29515),
    "t10k-images-idx3-ubyte":
        ("346e55b948d973a97e58d2351dde16a484bd415d4595297633bb08f03db6a073", 4422102),
    "t10k-labels-idx1-ubyte":
        ("67da17c76eaffca5446c3361aaab5c3cd6d1c2608764d35dfb1850b086bf8dd5", 5148),
})

# The original MNIST host often refuses scripted downloads; the second URL is the mirror that
# torchvision uses. The SHA-256 check makes the two interchangeable.
_MNIST = _idx_sources(("https://yann.lecun.com/exdb/mnist/",
                       "https://ossci-datasets.s3.amazonaws.com/mnist/"), {
    "train-images-idx3-ubyte":
        ("440fcabf73cc546fa21475e81ea370265605f56be210a4024d2ca8f203523609", 9912422),
    "train-labels-idx1-ubyte":
        ("3552534a0a558bbed6aed32b30c495cca23d567ec52cac8be1a0730e8010255c", 28881),
    "t10k-images-idx3-ubyte":
        ("8d422c7b0a1c1c79245a5bcf07fe86e33eeafee792b84584aec276f5a2dbc4e6", 1648877),
    "t10k-labels-idx1-ubyte":
        ("f7ae60f92e00ec6debd23a6088c31dbd2371eca3ffa0defaefb259924204aec6", 4542),
})

_CIFAR10 = (Source(
    "cifar-10-binary.tar.gz", ("https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz",),
    "c4a38c50a1bc5f3a1c5537f2155ab9d68f9f25eb1ed8d9ddda3db29a59bca1dd", 170052171),)

SPECS = {
    "fashion-mnist": Spec(
        "fashion-mnist", "idx", _IDX_SPLITS, (1, 28, 28), 10, (0.2860,), (0.3530,), _FASHION,
        debian_package="dataset-fashion-mnist",
        labels=("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                "Sneaker", "Bag", "Ankle boot")),
    "mnist": Spec(
        "mnist", "idx", _IDX_SPLITS, (1, 28, 28), 10, (0.1307,), (0.3081,), _MNIST,
        labels=tuple(str(d) for d in range(10))),
    "cifar10": Spec(
        "cifar10", "cifar",
        {"train": tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test": ("test_batch.bin",)},
        (3, 32, 32), 10, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), _CIFAR10,
        archive_dir="cifar-10-batches-bin",
        labels=("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship",
                "truck")),
}


@dataclass(frozen=True)
class TextSpec:
    """A text corpus: one file, downloaded as ``source.filename`` into the dataset folder."""
    name: str
    source: Source
    about: str


TEXTS = {
    "tiny-shakespeare": TextSpec(
        "tiny-shakespeare", Source(
            "input.txt",
            ("https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/"
             "input.txt",),
            "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed", 1115394),
        "40,000 lines of Shakespeare (char-rnn), 65 characters"),
}


def text_spec(name):
    """The TextSpec for `name`, or DataError listing the known texts."""
    try:
        return TEXTS[name]
    except (KeyError, TypeError):
        raise DataError(f"unknown text {name!r}; known: {', '.join(TEXTS)}") from None


def spec(name):
    """The Spec for `name`, or DataError listing the known names."""
    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise DataError(f"unknown dataset {name!r}; known: {', '.join(SPECS)}") from None


def check_split(split):
    if split not in ("train", "test"):
        raise DataError(f"unknown split {split!r}; use 'train' or 'test'")
    return split
