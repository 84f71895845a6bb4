"""python -m mpitrain.data fetch|info NAME [--data-dir D]

    fetch   make NAME available: nothing if it is already found (e.g. installed by Debian's
            dataset-fashion-mnist), else download from the official source with SHA-256 checks
            into D/<name>, $MPITRAIN_DATA_DIR/<name> or ~/.cache/mpitrain/<name> (D is created)
    info    where NAME was found, each file's size and what its header says (no full load)

NAME is an image dataset (fashion-mnist, mnist, cifar10) or a text (tiny-shakespeare: one
file, input.txt, for mt.data.TextDataset; `info` checks its SHA-256 and counts its characters).

A given data dir (--data-dir D, else $MPITRAIN_DATA_DIR, else the older $MPITRAIN_DATA) is the
only place `info` looks in: a D that does not exist or lacks the files is an error naming D, never
a silent fall-back to ~/.cache/mpitrain or /usr/share/datasets.

Exit status: 0 ok; 2 on any data problem (not found, offline, checksum, corrupt file), with one
line on stderr saying what is wrong and what to do.
"""
import argparse
import sys

from mpitrain.data.catalog import SPECS, TEXTS, spec as _spec, text_spec
from mpitrain.data.cifar import RECORD_BYTES
from mpitrain.runtime.errors import DataError
from mpitrain.data.fetch import fetch, sha256_file
from mpitrain.data.idx import read_idx_header
from mpitrain.data.locate import dataset_files, locate
from mpitrain.data.text import locate_text


def _size(n):
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000


def _text_info(name, data_dir, out):
    source = text_spec(name).source
    path = locate_text(name, data_dir)
    size = path.stat().st_size
    verified = "SHA-256 verified" if sha256_file(path) == source.sha256 else \
        f"SHA-256 differs from the pinned {source.sha256[:12]}... (not the catalog's file)"
    try:
        holds = f"{len(set(path.read_text(encoding='utf-8')))} distinct characters"
    except UnicodeDecodeError:
        holds = "not UTF-8 (use --tokens bytes)"
    out(f"{name}: found in {path.parent}")
    out(f"  {path.name:28s} {_size(size):>9s}  {holds}; {verified}")


def info(name, data_dir=None, out=print):
    """Print where dataset `name` is and what each of its files holds."""
    if name in TEXTS:
        return _text_info(name, data_dir, out)
    spec = _spec(name)
    directory = locate(name, data_dir)
    paths, _ = dataset_files(spec, directory)
    out(f"{name}: found in {directory}")
    for split, files in spec.splits.items():
        for filename in files:
            path = paths[filename]
            size = path.stat().st_size
            if spec.format == "idx":
                dtype, dims = read_idx_header(path)
                holds = f"{dtype.name} {'x'.join(map(str, dims))}"
            else:
                holds = f"{size // RECORD_BYTES} records" if size % RECORD_BYTES == 0 else \
                    f"NOT a whole number of {RECORD_BYTES}-byte records"
            out(f"  {split:5s}  {path.name:28s} {_size(size):>9s}  {holds}")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m mpitrain.data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for command, text in (("fetch", "download NAME unless it is already present"),
                          ("info", "show where NAME is found and its files")):
        sub = commands.add_parser(command, help=text)
        sub.add_argument("name", choices=sorted(SPECS) + sorted(TEXTS), metavar="NAME",
                         help=f"one of: {', '.join(list(SPECS) + list(TEXTS))}")
        sub.add_argument("--data-dir", default=None, metavar="D",
                         help="dataset root (files in D/NAME or D), the only place looked in; "
                              "default: $MPITRAIN_DATA_DIR, else ~/.cache/mpitrain and "
                              "/usr/share/datasets")
        if command == "fetch":
            sub.add_argument("--force", action="store_true",
                             help="download even if the dataset is found elsewhere")
    args = parser.parse_args(argv)
    try:
        if args.command == "fetch":
            fetch(args.name, args.data_dir, force=args.force)
        else:
            info(args.name, args.data_dir)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
