"""Checkpoints: one ``.npz`` per save, atomic, checksummed, with no per-rank state and no pickle.

What a checkpoint holds is exactly what every rank agrees on after a synchronised step: the
parameters and buffers (keyed by name), the optimizer state, and a JSON ``meta`` record (step, epoch, position
in the epoch's permutation, seed, model, ...). Nothing in it depends on the number of ranks, so a
job resumes on any N.

    ckpt-00000120.npz
        __meta__       0-d unicode array: JSON (step, epoch, ..., the optimizer state's layout)
        __checksum__   0-d unicode array: sha256 over every other entry (name, dtype, shape, bytes)
        param/<name>   the model's state_dict(): parameters, then buffers (BatchNorm running
                       statistics), in the model's declared order; a model whose keys differ
                       (a checkpoint without running statistics into a model with BatchNorm,
                       or the reverse) refuses it naming the missing and unexpected keys
        optim/<i>      the optimizer state's arrays; its numbers and nesting live in __meta__

Writes are atomic: a temporary file in the same folder, flushed and fsynced, then ``os.replace``d
over the final name (and the folder fsynced), so a crash leaves either the old set of files or the
new one, never a torn file under a final name. Loading uses ``allow_pickle=False`` and verifies the
checksum; ``load_latest`` skips damaged files and takes the newest valid one. Only rank 0 calls
``save`` (train.py); ``keep`` bounds how many are kept.
"""
import hashlib
import json
import os
import re
import zipfile

import numpy as np

from mpitrain import atomic
from mpitrain.config import UsageError

FORMAT = 1
KEEP = 3
_NAME = re.compile(r"^ckpt-(\d+)\.npz$")


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: unreadable, corrupt, or written by another model."""


def checkpoint_path(directory, step):
    return os.path.join(os.fspath(directory), f"ckpt-{int(step):08d}.npz")


def list_checkpoints(directory):
    """[(step, path)] of the checkpoint files in ``directory``, oldest first ([] if none)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), os.path.join(directory, n)) for n in names
             for m in [_NAME.match(n)] if m]
    return sorted(found)


def atomic_savez(path, arrays):
    """np.savez ``arrays`` (dict name -> ndarray) to ``path`` atomically (see atomic.py)."""
    return atomic.write(path, lambda f: np.savez(f, **arrays), suffix=".npz")


def save(directory, step, params, optimizer_state, meta, keep=KEEP):
    """Write ``ckpt-<step>.npz`` atomically, then delete all but the newest ``keep``; its path.

    params: dict name -> ndarray (host); optimizer_state: nested dicts/lists/tuples of numbers,
    strings, None and host arrays (an optimizer's ``state_dict()``); meta: JSON-able dict.
    """
    arrays = {f"param/{name}": np.ascontiguousarray(a) for name, a in params.items()}
    optim_arrays = {}
    layout = _flatten(optimizer_state, optim_arrays)
    arrays.update(optim_arrays)
    record = dict(meta, format=FORMAT, step=int(step), param_names=list(params),
                  optimizer_layout=layout)
    arrays["__meta__"] = np.array(json.dumps(record, sort_keys=True))
    arrays["__checksum__"] = np.array(_checksum(arrays))
    path = atomic_savez(checkpoint_path(directory, step), arrays)
    for _, old in list_checkpoints(directory)[:-keep] if keep else []:
        os.unlink(old)
    return path


class Checkpoint:
    """A loaded checkpoint: ``params`` (dict, declared order), ``optimizer_state``, ``meta``."""

    def __init__(self, path, params, optimizer_state, meta):
        self.path, self.params, self.meta = path, params, meta
        self.optimizer_state = optimizer_state

    @property
    def step(self):
        return self.meta["step"]


def load(path):
    """Read and verify one checkpoint; CheckpointError (one line) if it cannot be used."""
    path = os.fspath(path)
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {key: z[key] for key in z.files}
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint ({_one_line(exc)})") from None
    if "__meta__" not in arrays or "__checksum__" not in arrays:
        raise CheckpointError(f"{path}: not an mpitrain checkpoint (no __meta__/__checksum__)")
    stored = str(arrays.pop("__checksum__"))
    if _checksum(arrays) != stored:
        raise CheckpointError(f"{path}: checksum mismatch, the file is corrupt")
    meta = json.loads(str(arrays["__meta__"]))
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, "
                              f"expected {FORMAT}")
    params = {name: arrays[f"param/{name}"] for name in meta["param_names"]}
    optimizer_state = _unflatten(meta.pop("optimizer_layout"), arrays)
    return Checkpoint(path, params, optimizer_state, meta)


def load_latest(directory):
    """(newest valid Checkpoint or None, [one-line reasons for newer files that were skipped]).

    None when the folder has no checkpoint files; CheckpointError when it has some and none is
    valid (the reason names the newest).
    """
    skipped = []
    for _, path in reversed(list_checkpoints(directory)):
        try:
            return load(path), skipped
        except CheckpointError as exc:
            skipped.append(str(exc))
    if skipped:
        raise CheckpointError(f"no valid checkpoint in {directory}: {skipped[0]}")
    return None, skipped


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
    if isinstance(layout, dict):
        if "array" in layout:
            return arrays[layout["array"]]
        if "dict" in layout:
            return {k: _unflatten(v, arrays) for k, v in layout["dict"]}
        if "tuple" in layout:
            return tuple(_unflatten(v, arrays) for v in layout["tuple"])
        return [_unflatten(v, arrays) for v in layout["list"]]
    return layout


def _one_line(exc):
    return " ".join(str(exc).split()) or type(exc).__name__
