"""Sharded checkpoints: every rank writes its own piece of the optimizer state, rank 0 the
manifest last; a reader at any N reads only the slices it needs.

A sharded optimizer (parallel/sharded.py) holds 1/N of the optimizer state on each rank;
gathering it on rank 0 to write one file would need the memory sharding saves. So each rank
writes its pieces, in parallel, atomically (train/checkpoint.py's ``atomic_savez``)::

    ckpt-00000120.shard-00002-of-00004.npz
        pieces           int64 (k, 3): (parameter index, start, stop), element ranges of the
                         flattened parameters this rank owns
        buffer/<name>    the optimizer buffer <name> (exp_avg, ...) of those pieces, 1-D,
                         concatenated in piece order

then rank 0 writes the usual ``ckpt-00000120.npz`` (checkpoint.py: parameters, meta, the
optimizer's scalar state) whose ``__meta__`` names every piece file with its SHA-256 and size
(``shards``) and whose optimizer state says which buffers are sharded and the parameters'
shapes (``SHARDED``). The manifest is written last, so a checkpoint is there when it is
complete: a piece missing, of another size or with another checksum makes the whole checkpoint
invalid (one line), and the reader takes the previous one.

``ShardedState`` is what loading such a checkpoint gives instead of the optimizer's state
dict: ``scalars`` (lr, step, hyper-parameters, the no-decay mask), ``read(buffer, i, start,
stop)`` (elements [start, stop) of parameter i's buffer, from whichever pieces hold them,
memory-mapped: a sharded optimizer at any N reads its slices only) and ``whole()`` (the
unsharded state dict, for an unsharded optimizer). It is plain data (paths and counts), so rank
0 verifies it and broadcasts it, and each rank reads its slices itself.
"""
import hashlib
import os
import re

import numpy as np

from mpitrain.data import npyfile
from mpitrain.runtime.errors import CheckpointError, DataError, one_line

SHARDED = "__sharded__"     # optimizer-state key: {"buffers": [names], "shapes": [[...]]}
_SHARD = re.compile(r"^ckpt-(\d+)\.shard-(\d+)-of-(\d+)\.npz$")


def shard_name(step, rank, size):
    return f"ckpt-{int(step):08d}.shard-{int(rank):05d}-of-{int(size):05d}.npz"


def shard_step(name):
    """The step of a piece file's ``name``, or None for any other name."""
    m = _SHARD.match(name)
    return None if m is None else int(m.group(1))


def write_shard(directory, step, rank, size, pieces, buffers, savez):
    """Write this rank's piece of step ``step`` (``pieces`` [(i, start, stop)], ``buffers``
    {name: 1-D array}) with ``savez(path, arrays)`` (atomic); its manifest record."""
    arrays = {"pieces": np.asarray(pieces, np.int64).reshape(-1, 3)}
    for name, values in buffers.items():
        arrays[f"buffer/{name}"] = np.ascontiguousarray(values).reshape(-1)
    path = savez(os.path.join(os.fspath(directory), shard_name(step, rank, size)), arrays)
    return {"file": os.path.basename(path), "sha256": file_sha256(path),
            "bytes": os.path.getsize(path)}


def file_sha256(path, block=1 << 20):
    """SHA-256 of a file's bytes, read in blocks (memory does not grow with the file)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(block), b""):
            h.update(chunk)
    return h.hexdigest()


class ShardedState:
    """The optimizer state of a sharded checkpoint (see the module docstring)."""

    def __init__(self, directory, step, shards, state):
        self.directory, self.step = os.fspath(directory), int(step)
        sharded = state[SHARDED]
        self.buffers = [str(b) for b in sharded["buffers"]]
        self.shapes = [tuple(int(d) for d in s) for s in sharded["shapes"]]
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in self.shapes]
        self.scalars = {k: v for k, v in state.items() if k != SHARDED}
        self.shards = list(shards)
        self._index = None

    def __getstate__(self):
        return {k: v for k, v in self.__dict__.items() if k != "_index"}

    def __setstate__(self, state):
        self.__dict__.update(state, _index=None)

    # -- checks (rank 0, before the checkpoint is chosen) ---------------------------------------
    def verify(self, where):
        """CheckpointError (one line) unless every piece is there, the size and the checksum
        the manifest gives, and the pieces cover every parameter's elements exactly once."""
        for record in self.shards:
            path = self._path(record, where)
            try:
                size, digest = os.path.getsize(path), file_sha256(path)
            except OSError as exc:
                raise CheckpointError(f"{where}: its piece {record['file']} cannot be read "
                                      f"({one_line(exc)})") from None
            if size != record["bytes"] or digest != record["sha256"]:
                raise CheckpointError(f"{where}: its piece {record['file']} does not match "
                                      f"the manifest (checksum mismatch, the file is corrupt)")
        self.index(where)

    def _path(self, record, where):
        name = record.get("file") if isinstance(record, dict) else None
        if (not isinstance(name, str) or shard_step(name) != self.step
                or not isinstance(record.get("sha256"), str)
                or not isinstance(record.get("bytes"), int)):
            raise CheckpointError(f"{where}: damaged __meta__: a piece record {record!r:.60}")
        path = os.path.join(self.directory, name)
        if not os.path.isfile(path):
            raise CheckpointError(f"{where}: its piece {name} is missing")
        return path

    def index(self, where="checkpoint"):
        """[(i, start, stop, path, {buffer: (data offset, dtype)}, position in the buffer)]:
        where each piece's values are, from the pieces' headers (read once)."""
        if self._index is not None:
            return self._index
        entries, covered = [], [[] for _ in self.sizes]
        for record in self.shards:
            path = self._path(record, where)
            try:
                buffers, pieces = _members(path)
            except (OSError, ValueError, DataError) as exc:
                raise CheckpointError(f"{where}: its piece {record['file']}: "
                                      f"{one_line(exc)}") from None
            for i, a, b in pieces:
                if not (0 <= i < len(self.sizes) and 0 <= a < b <= self.sizes[i]):
                    raise CheckpointError(f"{where}: its piece {record['file']} holds "
                                          f"elements {a}:{b} of parameter {i}, not one it has")
                covered[i].append((a, b))
            total = sum(b - a for _, a, b in pieces)
            for name in self.buffers:
                if buffers.get(f"buffer/{name}", (None, None, None))[2] != total:
                    raise CheckpointError(f"{where}: its piece {record['file']} holds no "
                                          f"{name!r} of its {total} elements")
            members = {name: buffers[f"buffer/{name}"][:2] for name in self.buffers}
            position = 0
            for i, a, b in pieces:
                entries.append((i, a, b, path, members, position))
                position += b - a
        for i, ranges in enumerate(covered):
            end = 0
            for a, b in sorted(ranges):
                if a != end:
                    break
                end = b
            if end != self.sizes[i] or sum(b - a for a, b in ranges) != self.sizes[i]:
                raise CheckpointError(f"{where}: its pieces do not cover parameter {i} "
                                      f"exactly once")
        self._index = entries
        return entries

    # -- reads (every rank) ---------------------------------------------------------------------
    def read(self, name, i, start, stop):
        """Elements [start, stop) of parameter ``i``'s buffer ``name`` (a new 1-D array)."""
        out, filled = None, 0
        for j, a, b, path, members, position in self.index():
            if j != i or b <= start or a >= stop:
                continue
            offset, dtype = members[name]
            lo, hi = max(a, start), min(b, stop)
            values = np.memmap(path, dtype=dtype, mode="r", shape=(hi - lo,),
                               offset=offset + (position + lo - a) * dtype.itemsize)
            if out is None:
                out = np.empty(stop - start, dtype)
            out[lo - start:hi - start] = values
            filled += hi - lo
            del values
        if filled != stop - start:
            raise ValueError(f"the checkpoint's pieces hold {filled} of elements "
                             f"{start}:{stop} of parameter {i}'s {name}")
        return out

    def whole(self):
        """The unsharded state dict (what a plain optimizer's ``load_state_dict`` takes)."""
        state = dict(self.scalars)
        for name in self.buffers:
            for i, (size, shape) in enumerate(zip(self.sizes, self.shapes)):
                state[f"{name}.{i}"] = self.read(name, i, 0, size).reshape(shape)
        return state


def _members(path):
    """({member name: (data offset, dtype, elements)}, pieces (k, 3)) of a piece file: every
    member stored, 1-D, exactly the size its header says."""
    members = {}
    with open(path, "rb") as f:
        for name, (start, size) in npyfile.stored_members(path, f).items():
            if not name.endswith(".npy"):
                raise ValueError(f"member {name}: not an array")
            f.seek(start)
            shape, fortran, dtype, header = npyfile.read_header(f, f"{path}: member {name}")
            if len(shape) > 2 or header + npyfile.array_bytes(shape, dtype) != size:
                raise ValueError(f"member {name}: not the array its header says")
            members[name[:-4]] = (start + header, dtype, int(np.prod(shape, dtype=np.int64)),
                                  shape)
    offset, dtype, n, shape = members.get("pieces", (None, None, None, None))
    if dtype != np.dtype(np.int64) or len(shape) != 2 or shape[1] != 3:
        raise ValueError("no (k, 3) int64 'pieces'")
    pieces = np.fromfile(path, dtype=np.int64, count=n, offset=offset).reshape(-1, 3)
    buffers = {}
    for key, (off, dt, count, shp) in members.items():
        if key.startswith("buffer/"):
            if len(shp) != 1 or dt.kind != "f":
                raise ValueError(f"member {key}: not a 1-D float array")
            buffers[key] = (off, dt, count)
    return buffers, [tuple(int(v) for v in row) for row in pieces]
