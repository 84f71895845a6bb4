"""Finding a dataset's files on disk, in a fixed priority order.

    1. the explicit data_dir (--data-dir)          D/<name>, then D itself
    2. the MPITRAIN_DATA environment variable       E/<name>, then E itself
    3. the per-user cache                           ~/.cache/mpitrain/<name>
                                                    ($XDG_CACHE_HOME/mpitrain/<name> if set)
    4. the system-wide datasets folder              /usr/share/datasets/<name>
                                                    (Debian's dataset-fashion-mnist installs there)

The first directory holding *every* file of the dataset wins; a folder with only some of them is
skipped and reported in the error, because half a dataset is a broken download, not a choice.
IDX files may be gzipped (name.gz) or raw (name); CIFAR-10 batches may sit in the folder or in
its cifar-10-batches-bin/ subfolder (the tarball's layout). "Found" is about file names only; the
readers check the contents. The search is pure and cheap, so every rank runs it itself.
"""
import os
from pathlib import Path

from mpitrain.data.catalog import spec as _spec
from mpitrain.data.dataset import DataError

__all__ = ["locate", "search_dirs", "dataset_files", "cache_root", "home_dir", "where_to_put",
           "SYSTEM_ROOT"]

SYSTEM_ROOT = Path("/usr/share/datasets")
ENV_VAR = "MPITRAIN_DATA"


def cache_root():
    """~/.cache/mpitrain (or $XDG_CACHE_HOME/mpitrain)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "mpitrain"


def home_dir(name, data_dir=None):
    """Where files for `name` belong (and fetch writes): data_dir, $MPITRAIN_DATA or cache."""
    root = data_dir or os.environ.get(ENV_VAR) or None
    return (Path(root).expanduser() if root else cache_root()) / name


def search_dirs(name, data_dir=None):
    """The directories searched for dataset `name`, highest priority first."""
    dirs = []
    for root in (data_dir, os.environ.get(ENV_VAR) or None):
        if root is not None:
            root = Path(root).expanduser()
            dirs += [root / name, root]
    return dirs + [cache_root() / name, SYSTEM_ROOT / name]


def _file_candidates(spec, directory, filename):
    if spec.format == "idx":        # raw first: it loads faster than gunzipping
        return [directory / filename, directory / (filename + ".gz")]
    return [directory / filename, directory / spec.archive_dir / filename]


def dataset_files(spec, directory):
    """({file name: path} of the files present in `directory`, [names missing])."""
    found, missing = {}, []
    for filename in spec.files:
        path = next((p for p in _file_candidates(spec, Path(directory), filename)
                     if p.is_file()), None)
        if path is None:
            missing.append(filename)
        else:
            found[filename] = path
    return found, missing


def where_to_put(spec, data_dir=None, fetch=True):
    """The 'how to get it' half of a not-found message (one line, no trailing period)."""
    target = home_dir(spec.name, data_dir)
    if spec.format == "idx":
        names = ", ".join(s.filename for s in spec.sources)
    else:
        names = (", ".join(spec.files)
                 + f" (or the {spec.archive_dir}/ folder of {spec.sources[0].filename})")
    how = f"put {names} in {target} (or pass --data-dir / set {ENV_VAR})"
    if fetch:
        how += f", or run `python -m mpitrain.data fetch {spec.name}`"
    if spec.debian_package:
        how += f", or install the Debian package {spec.debian_package} (apt-get install -y " \
               f"{spec.debian_package})"
    return how


def locate(name, data_dir=None):
    """The directory holding all of `name`'s files, or DataError saying where to put them."""
    spec = _spec(name)
    partial = []
    for directory in search_dirs(name, data_dir):
        found, missing = dataset_files(spec, directory)
        if not missing:
            return directory
        if found:
            gz = "[.gz]" if spec.format == "idx" else ""
            partial.append(f"{directory} lacks {', '.join(m + gz for m in missing)}")
    searched = ", ".join(str(d) for d in search_dirs(name, data_dir))
    note = f" ({'; '.join(partial)})" if partial else ""
    raise DataError(f"{name}: data not found in {searched}{note}; {where_to_put(spec, data_dir)}")
