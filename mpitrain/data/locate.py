"""Finding a dataset's files on disk, in a fixed priority order.

    1. the explicit data_dir (--data-dir)          D/<name>, then D itself
    2. the MPITRAIN_DATA_DIR environment variable   E/<name>, then E itself
       (MPITRAIN_DATA, its older name, when it is unset)
    3. the per-user cache                           ~/.cache/mpitrain/<name>
                                                    ($XDG_CACHE_HOME/mpitrain/<name> if set)
    4. the system-wide datasets folder              /usr/share/datasets/<name>
                                                    (Debian's dataset-fashion-mnist installs there)

A data dir the user named (1 or 2) is authoritative: it is the only place searched, and if it does
not exist or lacks the files the error names it -- a typo must not silently train on whatever
copy 3 or 4 happens to hold. The search path (3, 4) applies only when no data dir is given.
The first directory holding *every* file of the dataset wins; a folder with only some of them is
skipped and reported in the error, because half a dataset is a broken download, not a choice.
IDX files may be gzipped (name.gz) or raw (name); CIFAR-10 batches may sit in the folder or in
its cifar-10-batches-bin/ subfolder (the tarball's layout). "Found" is about file names only; the
readers check the contents. The search is pure and cheap, so every rank runs it itself.
"""
import os
import shlex
from pathlib import Path

from mpitrain.data.catalog import spec as _spec
from mpitrain.runtime.errors import DataError
from mpitrain.runtime import env

__all__ = ["locate", "search_dirs", "dataset_files", "cache_root", "home_dir", "given_root",
           "where_to_put", "env_data_dir", "SYSTEM_ROOT", "ENV_VARS"]

SYSTEM_ROOT = Path("/usr/share/datasets")
# --data-dir's variable (config.py maps every flag to MPITRAIN_<FLAG>), then its older name.
ENV_VARS = ("MPITRAIN_DATA_DIR", "MPITRAIN_DATA")
env.declare(*ENV_VARS)
_ALONE = "a given data dir replaces the search path"


def cache_root():
    """~/.cache/mpitrain (or $XDG_CACHE_HOME/mpitrain)."""
    base = os.environ.get("XDG_CACHE_HOME")
    return (Path(base) if base else Path.home() / ".cache") / "mpitrain"


def _passed(data_dir):
    return data_dir is not None and str(data_dir) != ""


def given_root(data_dir=None):
    """(root, how it was given) for the data dir the user named -- data_dir, else
    $MPITRAIN_DATA_DIR, else $MPITRAIN_DATA -- or (None, None) when none was (empty = unset)."""
    if _passed(data_dir):
        root = Path(data_dir).expanduser()
        return root, f"data dir {root}"
    var, text = env_data_dir()
    if var is None:
        return None, None
    root = Path(text).expanduser()
    return root, f"${var}={root}"


def env_data_dir(environ=None):
    """(variable, its text) for the data dir the environment names -- $MPITRAIN_DATA_DIR, else
    $MPITRAIN_DATA -- or (None, None) (empty = unset); the CLI's --data-dir reads it too."""
    for var in ENV_VARS:
        text = env.text(var, None, environ)
        if text is not None:
            return var, text
    return None, None


def home_dir(name, data_dir=None):
    """Where files for `name` belong (and fetch writes): the given data dir, else the cache."""
    root, _ = given_root(data_dir)
    return (root if root is not None else cache_root()) / name


def search_dirs(name, data_dir=None):
    """The directories searched for dataset `name`, highest priority first: only the given
    data dir's when there is one, else the cache's and the system's."""
    root, _ = given_root(data_dir)
    if root is not None:
        return [root / name, root]
    return [cache_root() / name, SYSTEM_ROOT / name]


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
    root, _ = given_root(data_dir)
    target = home_dir(spec.name, data_dir)
    if spec.format == "idx":
        names = ", ".join(s.filename for s in spec.sources)
    else:
        names = (", ".join(spec.files)
                 + f" (or the {spec.archive_dir}/ folder of {spec.sources[0].filename})")
    if root is None:
        how = f"put {names} in {target} (or pass --data-dir / set {ENV_VARS[0]})"
    else:
        how = f"put {names} in {target} (or {root} itself)"
    if fetch:
        # An env var reaches `fetch` by itself; an argument must be passed on.
        into = f" --data-dir {shlex.quote(str(root))}" if _passed(data_dir) else ""
        how += f", or run `python -m mpitrain.data fetch {spec.name}{into}`"
    if spec.debian_package:
        how += f", or install the Debian package {spec.debian_package} (apt-get install -y " \
               f"{spec.debian_package})"
        if root is not None:        # it installs into the search path only
            how += " and give no data dir"
    return how


def locate(name, data_dir=None):
    """The directory holding all of `name`'s files, or DataError saying where to put them."""
    spec = _spec(name)
    root, given = given_root(data_dir)
    if root is not None and not root.is_dir():
        problem = "is not a directory" if root.exists() else "does not exist"
        raise DataError(f"{name}: {given} {problem} ({_ALONE}); {where_to_put(spec, data_dir)}")
    partial = []
    for directory in search_dirs(name, data_dir):
        found, missing = dataset_files(spec, directory)
        if not missing:
            return directory
        if found:
            gz = "[.gz]" if spec.format == "idx" else ""
            partial.append(f"{directory} lacks {', '.join(m + gz for m in missing)}")
    searched = ", ".join(str(d) for d in search_dirs(name, data_dir))
    how = where_to_put(spec, data_dir)
    if root is not None:
        looked = "; ".join([searched] + partial)
        raise DataError(f"{name}: data not found in {given} (looked in {looked}; {_ALONE}); {how}")
    note = f" ({'; '.join(partial)})" if partial else ""
    raise DataError(f"{name}: data not found in {searched}{note}; {how}")
