"""Checkpoints: one ``.npz`` per save, atomic, checksummed, with no per-rank state and no pickle.

What a checkpoint holds is exactly what every rank agrees on after a synchronised step: the
parameters and buffers (keyed by name), the optimizer state, and a JSON ``meta`` record (step,
epoch, position in the epoch's permutation, seed, model, ...). Nothing in it depends on the number
of ranks, so a job resumes on any N.

    ckpt-00000120.npz
        __meta__       0-d unicode array: JSON (step, epoch, ..., the optimizer state's layout)
        __checksum__   0-d unicode array: sha256 over every other entry (name, dtype, shape, bytes)
        param/<name>   the model's state_dict(): parameters, then buffers (BatchNorm running
                       statistics), in the model's declared order; a model whose keys differ
                       (a checkpoint without running statistics into a model with BatchNorm,
                       or the reverse) refuses it naming the missing and unexpected keys
        optim/<i>      the optimizer state's arrays; its numbers and nesting live in __meta__

A sharded optimizer's state is not gathered into this file: every rank writes its own piece
beside it and this file, written last, is the manifest that names them with their checksums
(checkpoint_shards.py); loading gives a ``ShardedState`` that reads only the slices a rank
needs. Either kind resumes at any N, sharded or not.

Writes are atomic: a temporary file in the same folder, flushed and fsynced, then ``os.replace``d
over the final name (and the folder fsynced), so a crash leaves either the old set of files or the
new one, never a torn file under a final name. Loading trusts nothing in the file (the checksum
is a plain SHA-256 anyone can recompute): only regular files are read; every member must be
stored and exactly the size its .npy header gives (data/npyfile.py), so nothing larger than the
file is allocated and nothing is inflated or unpickled; ``__meta__`` must be a JSON object whose
format keys have their types (``Key``), and a reader's own keys (``schema``: the CLI's
loop.META) theirs. ``read_latest`` skips a file that fails any check and takes the newest valid
one.

Two levels, one format:
- ``write`` / ``read_latest`` / ``load``: one process, plain data (host arrays, dicts). The CLI's
  trainer (loop.py, setup.py) calls them on rank 0 and broadcasts what it read.
- ``save(directory, model, optimizer, step=..., extra=...)`` / ``load_latest(directory, model,
  optimizer)``: collective, for your own loop. Every rank calls them; rank 0 alone touches the
  folder; a failure on rank 0 (a full disk, a checkpoint that does not fit the model) is the same
  CheckpointError on every rank, never one rank raising while the others wait. ``extra`` (your
  epoch, ...) sits at the top level of ``__meta__`` beside ``step``, as the CLI's epoch and model
  do, so both kinds of checkpoint are the same file. ``restart_count()``: how many times
  mpitrainrun has relaunched the job (MPITRAIN_RESTART_COUNT), for a loop that logs it.
  ``load_latest`` (and the CLI's resume) also tell mpitrainrun that the job reads its
  checkpoints (``note_resumable``: a file it names in MPITRAIN_CHECKPOINT_PROBE), so that the
  launcher can say at a restart when a job has no way to resume.
"""
import contextlib
import hashlib
import json
import os
import re
import stat
import sys

import numpy as np

from mpitrain.runtime import atomic, env
from mpitrain import comm
from mpitrain.data import npyfile
from mpitrain.runtime.errors import CheckpointError, DataError, one_line
from mpitrain.parallel.optimizer import DistributedOptimizer
from mpitrain.train.checkpoint_shards import SHARDED, ShardedState, shard_step, write_shard

FORMAT = 1
KEEP = 3
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")
_ZIP = b"PK\x03\x04"    # np.savez writes a zip archive; its first local header starts the file
# __meta__ keys of the format itself; save(extra=...) may not use them
_RESERVED = ("format", "step", "param_names", "optimizer_layout", "shards")
env.declare("MPITRAIN_RESTART_COUNT")     # set by mpitrainrun on every launch (mpitrain/run/)
env.declare("MPITRAIN_CHECKPOINT_PROBE")  # set by mpitrainrun: touched by a job that resumes


def note_resumable(environ=None):
    """Rank 0: tell mpitrainrun that this job reads its checkpoints (it creates the file named
    by MPITRAIN_CHECKPOINT_PROBE, when set); a failure to write it is not the job's."""
    path = env.text("MPITRAIN_CHECKPOINT_PROBE", environ=environ)
    if path and comm.rank() == 0:
        try:
            with open(path, "a"):
                pass
        except OSError:
            pass


def checkpoint_path(directory, step):
    return os.path.join(os.fspath(directory), f"ckpt-{int(step):08d}.npz")


def list_checkpoints(directory):
    """[(step, path)] of the checkpoint files in ``directory``, oldest first ([] if none):
    regular files only (a FIFO under such a name would block whoever opens it)."""
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), entry.path) for entry in entries
             for m in [_NAME.match(entry.name)] if m and _regular(entry)]
    return sorted(found)


def _regular(entry):
    try:
        return entry.is_file()
    except OSError:
        return False


def atomic_savez(path, arrays):
    """np.savez ``arrays`` (dict name -> ndarray) to ``path`` atomically (see atomic.py)."""
    return atomic.write(path, lambda f: np.savez(f, **arrays), suffix=".npz")


def write(directory, step, params, optimizer_state, meta, keep=KEEP, shards=None):
    """Write ``ckpt-<step>.npz`` atomically, then delete all but the newest ``keep`` (with
    their pieces, and pieces no checkpoint names); its path.

    params: dict name -> ndarray (host); optimizer_state: nested dicts/lists/tuples of numbers,
    strings, None and host arrays (an optimizer's ``state_dict()``); meta: JSON-able dict.
    shards: the records of the pieces every rank wrote (``write_pieces``), or None.
    """
    arrays = {f"param/{name}": np.ascontiguousarray(a) for name, a in params.items()}
    optim_arrays = {}
    layout = _flatten(optimizer_state, optim_arrays)
    arrays.update(optim_arrays)
    record = dict(meta, format=FORMAT, step=int(step), param_names=list(params),
                  optimizer_layout=layout)
    if shards is not None:
        record["shards"] = list(shards)
    arrays["__meta__"] = np.array(json.dumps(record, sort_keys=True))
    arrays["__checksum__"] = np.array(_checksum(arrays))
    path = atomic_savez(checkpoint_path(directory, step), arrays)
    for _, old in list_checkpoints(directory)[:-keep] if keep else []:
        os.unlink(old)
    _prune_pieces(directory, step)
    return path


def _prune_pieces(directory, step):
    """Delete the pieces of checkpoints older than ``step`` that are gone (pruned, or never
    completed: a job killed between its pieces and its manifest)."""
    kept = {s for s, _ in list_checkpoints(directory)}
    for entry in os.scandir(directory):
        written = shard_step(entry.name)
        if written is not None and written < step and written not in kept:
            try:
                os.unlink(entry.path)
            except FileNotFoundError:
                pass


def write_pieces(directory, step, pieces):
    """Collective: every rank writes its piece of step ``step``'s sharded optimizer state
    (``pieces``: a sharded optimizer's ``checkpoint_pieces()``); returns (the optimizer state
    the manifest holds, the pieces' records) on every rank. A rank that cannot write is the
    same CheckpointError on every rank, naming it."""
    scalars, owned, buffers, shapes = pieces
    try:
        record, error = write_shard(directory, step, comm.rank(), comm.size(), owned, buffers,
                                    atomic_savez), None
    except (OSError, ValueError) as exc:
        record, error = None, f"cannot write a checkpoint piece in {directory}: {one_line(exc)}"
    every = comm.allgather_object((record, error))
    failed = [(r, e) for r, (_, e) in enumerate(every) if e is not None]
    if failed:
        raise CheckpointError(f"{failed[0][1]} (on rank {failed[0][0]})")
    state = dict(scalars)
    state[SHARDED] = {"buffers": list(buffers), "shapes": [list(s) for s in shapes]}
    return state, [r for r, _ in every]


class Checkpoint:
    """A loaded checkpoint: ``params`` (dict, declared order), ``optimizer_state``, ``meta``."""

    def __init__(self, path, params, optimizer_state, meta):
        self.path, self.params, self.meta = path, params, meta
        self.optimizer_state = optimizer_state

    @property
    def step(self):
        return self.meta["step"]


def load(path, schema=None):
    """Read and verify one checkpoint; CheckpointError (one line) if it cannot be used.
    ``schema``: {key: Key} the reader's own ``__meta__`` keys must meet (see Key)."""
    path = os.fspath(path)
    try:
        # O_NONBLOCK: a FIFO under a checkpoint's name must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({one_line(exc)})") from None
    with os.fdopen(fd, "rb") as f:
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            if f.read(len(_ZIP)) != _ZIP:   # np.load would take it for a pickle
                raise CheckpointError(f"{path}: not a .npz checkpoint (no zip header)")
            arrays = _read_arrays(path, f)
        except CheckpointError:
            raise
        except DataError as exc:
            raise CheckpointError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{path}: not a readable checkpoint ({one_line(exc)})") \
                from None
    if "__meta__" not in arrays or "__checksum__" not in arrays:
        raise CheckpointError(f"{path}: not an mpitrain checkpoint (no __meta__/__checksum__)")
    stored = arrays.pop("__checksum__")
    if stored.dtype.kind != "U" or stored.shape != () or _checksum(arrays) != str(stored):
        raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt")
    try:
        meta = _meta(path, arrays, schema or {})
        params = {name: arrays[f"param/{name}"] for name in meta["param_names"]}
        optimizer_state = _unflatten(meta.pop("optimizer_layout"), arrays)
        shards = meta.pop("shards", None)
        if shards is not None:      # a manifest: the pieces beside it hold the buffers
            optimizer_state = ShardedState(os.path.dirname(path), meta["step"], shards,
                                           optimizer_state)
            optimizer_state.verify(path)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: damaged __meta__: {one_line(exc)}") from None
    return Checkpoint(path, params, optimizer_state, meta)


class Key:
    """One ``__meta__`` key a reader relies on: the JSON types it may have (int never means
    bool), the least value of a number, and whether files that predate it lack it (optional).
    A checkpoint whose keys do not meet the reader's schema is damaged, like a bad checksum:
    ``read_latest`` skips it for the one before."""

    def __init__(self, *types, minimum=None, optional=False):
        self.types, self.minimum, self.optional = types, minimum, optional

    def problem(self, value):
        """Why ``value`` does not fit, or None."""
        if not any(isinstance(value, t) and not (t is int and isinstance(value, bool))
                   for t in self.types):
            names = " or ".join("null" if t is type(None) else t.__name__ for t in self.types)
            return f"{value!r:.40} is not {names}"
        if self.minimum is not None and isinstance(value, (int, float)) and not (
                self.minimum <= value < _MAX_INT):
            return f"{value!r} is outside [{self.minimum}, 2^63)"
        return None


_MAX_INT = 1 << 63
_MAX_DEPTH = 64      # JSON nesting: the optimizer layout is a few levels; pickle recurses per level
_FORMAT_KEYS = {"format": Key(int), "step": Key(int, minimum=0), "param_names": Key(list),
                "optimizer_layout": Key(dict, list, str, int, float, bool, type(None)),
                "shards": Key(list, optional=True)}
_ARRAY_KINDS = "biufcU"     # numbers, bool and the unicode of __meta__: what write() stores


def _read_arrays(path, f):
    """{key: ndarray} of the archive open as ``f``: every member stored and exactly the size
    its .npy header says (npyfile.py), so nothing larger than the file is ever allocated."""
    arrays = {}
    for name, (start, size) in npyfile.stored_members(path, f).items():
        where = f"{path}: member {name}"
        if not name.endswith(".npy"):
            raise CheckpointError(f"{where}: not an array (.npy)")
        f.seek(start)
        shape, fortran, dtype, header = npyfile.read_header(f, where)
        nbytes = npyfile.array_bytes(shape, dtype)
        if dtype.kind not in _ARRAY_KINDS:
            raise CheckpointError(f"{where}: dtype {dtype} is not one a checkpoint holds")
        if header + nbytes != size:
            raise CheckpointError(f"{where}: its header says {shape} {dtype} ({nbytes} bytes) "
                                  f"but the member holds {size - header}")
        buffer = bytearray(nbytes)
        if f.readinto(buffer) != nbytes:
            raise CheckpointError(f"{where}: truncated")
        arrays[name[:-len(".npy")]] = np.frombuffer(buffer, dtype).reshape(
            shape, order="F" if fortran else "C")
    return arrays


def _meta(path, arrays, schema):
    """``__meta__`` as a dict, its keys checked against the format's and ``schema``; ValueError
    saying what is wrong."""
    text = arrays["__meta__"]
    if text.dtype.kind != "U" or text.shape != ():
        raise ValueError(f"a {text.dtype} {text.shape} array, not a JSON string")
    try:
        meta = json.loads(str(text))
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({one_line(exc)})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"a JSON {type(meta).__name__}, not an object")
    _check_depth(meta)
    if meta.get("format") != FORMAT or isinstance(meta.get("format"), bool):
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, "
                              f"expected {FORMAT}")
    for key, rule in {**_FORMAT_KEYS, **schema}.items():
        if key not in meta:
            if not rule.optional:
                raise ValueError(f"no {key!r}")
            continue
        problem = rule.problem(meta[key])
        if problem is not None:
            raise ValueError(f"{key!r}: {problem}")
    named = _NAME.match(os.path.basename(path))
    if named and int(named.group(1)) != meta["step"]:
        raise ValueError(f"'step' {meta['step']} in a file named for step {int(named.group(1))}")
    names = meta["param_names"]
    if not all(isinstance(n, str) for n in names) or len(set(names)) != len(names):
        raise ValueError("'param_names' is not a list of distinct names")
    absent = [n for n in names if f"param/{n}" not in arrays]
    if absent:
        raise ValueError(f"'param_names' names {absent[0]!r}, which the file does not hold")
    return meta


def _check_depth(obj):
    """ValueError if ``obj`` (JSON data) nests deeper than _MAX_DEPTH."""
    level = [obj]
    for _ in range(_MAX_DEPTH):
        level = [v for o in level if isinstance(o, (dict, list))
                 for v in (o.values() if isinstance(o, dict) else o)]
        if not level:
            return
    raise ValueError(f"nested deeper than {_MAX_DEPTH} levels")


def read_latest(directory, schema=None):
    """(newest valid Checkpoint or None, [one-line reasons for newer files that were skipped]).

    None when the folder has no checkpoint files; CheckpointError when it has some and none is
    valid (the reason names the newest). ``schema``: as ``load``'s.
    """
    skipped = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return load(path, schema), skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    if skipped:
        raise CheckpointError(f"no valid checkpoint in {directory}: {skipped[0]}")
    return None, skipped


def restart_count(environ=None):
    """How many times mpitrainrun relaunched this job: 0 on the first launch (and without
    mpitrainrun), then 1, 2, ... (MPITRAIN_RESTART_COUNT)."""
    return env.integer("MPITRAIN_RESTART_COUNT", 0, minimum=0, environ=environ)


# -- collective: your own loop ---------------------------------------------------------------------
def save(directory, model, optimizer, step=None, extra=None, keep=KEEP):
    """Checkpoint ``model`` and ``optimizer`` as ``<directory>/ckpt-<step>.npz``; its path.

    Collective: every rank calls it with the same arguments; rank 0 alone writes (its model and
    optimizer state: with plain BatchNorm, its own running statistics -- average them first to
    write their mean) and then deletes all but the newest ``keep`` files (None: keeps them all).
    optimizer: an mt.optim optimizer or a DistributedOptimizer (the state its strategy says a
    checkpoint holds, ``checkpoint_state()``, as the CLI saves: in weights mode the mean of the
    ranks' moments, not rank 0's).
    step: default the optimizer's update count; it must not be lower than a checkpoint already
    in the folder (``keep`` deletes the lowest steps first). extra: a JSON-able dict (your
    epoch, ...) that ``load_latest`` returns beside "step". A failure (a full disk, a folder
    that cannot be created) is the same CheckpointError on every rank.
    """
    directory = os.fspath(directory)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    step = inner.steps if step is None else step
    try:
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"checkpoint.save: step {step!r} must be an integer >= 0")
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, (int, np.integer))
                                 or keep < 1):
            raise ValueError(f"checkpoint.save: keep {keep!r} must be an integer >= 1 or None")
        extra, error = _plain_extra(extra), None
    except ValueError as exc:
        error = str(exc)
    _raise_on_every_rank(error, ValueError)     # before rank 0 writes anything
    # collective where the ranks' states differ (weights mode, sharded), so every rank asks
    distributed = isinstance(optimizer, DistributedOptimizer)
    pieces = optimizer.checkpoint_pieces() if distributed else None
    shards = None
    with optimizer.full_parameters() if distributed else contextlib.nullcontext():
        model_state = model.state_dict(copy=True) if comm.rank() == 0 else None
    if pieces is not None:          # sharded: every rank writes its piece, no gather
        optimizer_state, shards = write_pieces(directory, step, pieces)
    else:
        optimizer_state = optimizer.checkpoint_state() if distributed else inner.state_dict()
    path = None
    if comm.rank() == 0:
        try:
            newer = [old for s, old in list_checkpoints(directory) if s > step]
            if newer:
                raise CheckpointError(f"{directory} holds {os.path.basename(newer[-1])}, newer "
                                      f"than step {step}: resume from it (load_latest) or save "
                                      f"into an empty folder")
            path = write(directory, step, model_state, optimizer_state, extra,
                         keep=keep or 0, shards=shards)
        except CheckpointError as exc:
            error = str(exc)
        except (OSError, TypeError, ValueError) as exc:
            error = f"cannot write a checkpoint in {directory}: {one_line(exc)}"
    path, error = comm.broadcast_object((path, error), root_rank=0)
    if error is not None:
        raise CheckpointError(error)
    return path


def load_latest(directory, model, optimizer):
    """Load the newest valid checkpoint in ``directory`` into ``model`` and ``optimizer``; its
    meta ``{"step": ..., **extra}``, or None when the folder holds no checkpoint.

    Collective: rank 0 reads the folder, skipping damaged files with a one-line warning on
    stderr, and broadcasts the checkpoint; every rank loads it and returns the same meta (or
    None). A folder of damaged files only, or a checkpoint that does not fit the model or the
    optimizer (as ``save`` takes them), is the same CheckpointError on every rank.
    """
    directory = os.fspath(directory)
    found, error = None, None
    note_resumable()
    if comm.rank() == 0:
        try:
            checkpoint, skipped = read_latest(directory)
            for reason in skipped:
                print(f"mpitrain: warning: skipping {reason}", file=sys.stderr, flush=True)
            if checkpoint is not None:
                meta = {k: v for k, v in checkpoint.meta.items() if k not in _RESERVED}
                found = (checkpoint.path, checkpoint.params, checkpoint.optimizer_state,
                         dict(step=checkpoint.step, **meta))
        except CheckpointError as exc:
            error = str(exc)
        except OSError as exc:
            error = f"cannot read checkpoints in {directory}: {one_line(exc)}"
    found, error = comm.broadcast_object((found, error), root_rank=0)
    if error is not None:
        raise CheckpointError(error)
    if found is None:
        return None
    path, params, optimizer_state, meta = found
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    try:
        what = "model"
        if isinstance(optimizer, DistributedOptimizer):
            with optimizer.full_parameters():   # every rank: none raises before it
                model.load_state_dict(params)
        else:
            model.load_state_dict(params)
        what = "optimizer"
        if isinstance(optimizer, DistributedOptimizer):
            optimizer.load_checkpoint_state(optimizer_state)     # its strategy's slice
        else:
            inner.load_state_dict(optimizer_state.whole() if isinstance(
                optimizer_state, ShardedState) else optimizer_state)
    except (ValueError, TypeError, KeyError) as exc:
        error = f"{path} does not fit this {what}: {one_line(exc)}"
    # every rank loads the same data, but a rank whose model differs must not raise alone
    _raise_on_every_rank(error, CheckpointError)
    return meta


def _raise_on_every_rank(error, kind):
    """Collective: raise ``kind`` on every rank if any rank has an ``error`` (its own first)."""
    errors = [e for e in comm.allgather_object(error) if e is not None]
    if errors:
        raise kind(error if error is not None else errors[0])


def _plain_extra(extra):
    """``extra`` as JSON reads it back (NumPy scalars as Python numbers); ValueError if it is not
    a JSON-able dict or uses a key of the format."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise ValueError(f"checkpoint.save: extra must be a dict, got {type(extra).__name__}")
    clash = [k for k in extra if k in _RESERVED]
    if clash:
        raise ValueError(f"checkpoint.save: extra keys {clash} are the checkpoint's own")

    def scalar(obj):
        if isinstance(obj, np.generic) or (isinstance(obj, np.ndarray) and obj.ndim == 0):
            return obj.item()
        raise TypeError(f"{type(obj).__name__} is not JSON-able")
    try:
        return json.loads(json.dumps(extra, default=scalar))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint.save: extra {one_line(exc)}") from None


def _checksum(arrays):
    h = hashlib.sha256()
    for key in sorted(arrays):
        a = np.ascontiguousarray(arrays[key])
        h.update(f"{key}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _flatten(obj, arrays):
    """JSON-able layout of ``obj``; its arrays go into ``arrays`` as optim/<i>."""
    if isinstance(obj, np.ndarray):
        key = f"optim/{len(arrays)}"
        arrays[key] = np.ascontiguousarray(obj)
        return {"array": key}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {"dict": [[k, _flatten(v, arrays)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {"tuple" if isinstance(obj, tuple) else "list": [_flatten(v, arrays) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"cannot checkpoint optimizer state of type {type(obj).__name__}")


def _unflatten(layout, arrays):
    """The optimizer state ``_flatten`` wrote as ``layout``; ValueError if the layout is not
    one it writes (depth is bounded by _check_depth)."""
    if isinstance(layout, dict):
        if len(layout) != 1:
            raise ValueError(f"optimizer layout node with keys {sorted(layout)[:4]}")
        (kind, value), = layout.items()
        if kind == "array":
            if not (isinstance(value, str) and value.startswith("optim/") and value in arrays):
                raise ValueError(f"optimizer layout names array {value!r:.40}, not in the file")
            return arrays[value]
        if kind not in ("dict", "tuple", "list") or not isinstance(value, list):
            raise ValueError(f"optimizer layout node {kind!r:.40}")
        if kind == "dict":
            if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int))
                       for p in value):
                raise ValueError("optimizer layout dict is not a list of [key, value] pairs")
            return {k: _unflatten(v, arrays) for k, v in value}
        items = [_unflatten(v, arrays) for v in value]
        return tuple(items) if kind == "tuple" else items
    if isinstance(layout, list):
        raise ValueError("optimizer layout holds a bare list")
    return layout
