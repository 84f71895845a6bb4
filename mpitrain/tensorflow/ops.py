"""The collectives on tf.Tensors, with horovod.tensorflow's names and keyword arguments.

Each call turns its tensors into NumPy arrays, runs the comm layer's collective on them and
returns tf.Tensors of the input's dtype. Eagerly that is a direct call; inside a
``tf.function`` the same Python function runs as one ``tf.numpy_function`` node (stateful, so
it runs once per call, in program order), so everything the comm layer does for NumPy arrays
holds in both: the cross-rank agreement (a mismatch is a CollectiveError on every rank, never a
hang), the allreduce paths, process sets, ``join``, the stall watchdog, the timeline.

Inside a ``tf.function`` TensorFlow re-raises an exception of the Python function as one of
its own: a CollectiveError (a RuntimeError) as ``tf.errors.UnknownError``, a ValueError or
TypeError as ``tf.errors.InvalidArgumentError``, the original message kept in its text. Under
``jit_compile=True`` (XLA) the host call cannot be compiled: TensorFlow refuses the function
with one InvalidArgumentError naming the node ``mpitrain_<collective>_needs_jit_compile_False``.

How each dtype travels: float16, float32, float64, int8, int16, int32, int64, uint8 as they
are; bfloat16 reductions on a float32 copy rounded back once, and its bits moved exactly by
the data movers (allgather, broadcast, alltoall). The Average of integer tensors is an integer
tensor, the sum times 1/N truncated toward zero (Horovod's rule). Anything else (bool, complex,
strings) is refused, on every rank. ``tf.IndexedSlices`` are made dense first.
"""
import numpy as np
import tensorflow as tf

from mpitrain import comm
from mpitrain.tensorflow.compression import Compression

Sum, Average, Min, Max, Product = comm.Sum, comm.Average, comm.Min, comm.Max, comm.Product
global_process_set = comm.global_process_set
# Horovod's Adasum op: named, so that scripts that mention it import; refused when used.
Adasum = "adasum"

REDUCED = ("float16", "bfloat16", "float32", "float64", "int8", "int16", "int32", "int64",
           "uint8")
INTEGER = ("int8", "int16", "int32", "int64", "uint8")


# --- the host call, eager or in a graph -------------------------------------------------------

def dense(tensor):
    """``tensor`` as a dense tf.Tensor (tf.Variable read, IndexedSlices scattered)."""
    if isinstance(tensor, tf.IndexedSlices):
        return tf.convert_to_tensor(tensor)
    return tf.convert_to_tensor(tensor)


def host_call(kind, fn, tensors, out_dtypes, out_shapes):
    """``fn(*arrays) -> list of arrays`` on the NumPy values of ``tensors``: the list of
    tf.Tensors it returns, of ``out_dtypes`` and (in a graph) the static ``out_shapes``."""
    if tf.executing_eagerly():
        outs = fn(*[t.numpy() for t in tensors])
        return [tf.convert_to_tensor(np.asarray(o, dtype=d.as_numpy_dtype))
                for o, d in zip(outs, out_dtypes)]
    outs = tf.numpy_function(fn, list(tensors), list(out_dtypes), stateful=True,
                             name=f"mpitrain_{kind}_needs_jit_compile_False")
    if not isinstance(outs, (list, tuple)):
        outs = [outs]
    outs = list(outs)
    for out, shape in zip(outs, out_shapes):
        out.set_shape(shape)
    return outs


class Problem(Exception):
    """One rank's reason to refuse a call: ``exc_type`` and the message."""

    def __init__(self, exc_type, message):
        super().__init__(message)
        self.exc_type = exc_type
        self.message = message


def refuse(kind, problem, process_set):
    """Raise ``problem`` on every rank of ``process_set`` (the other ranks meet this rank in the
    agreement of the collective they are calling): the same error where every rank has it, a
    CollectiveError naming the ranks where only some do. Does not return."""
    try:
        comm.agree(process_set, kind, {"refused": True}, error=problem.message,
                   who=f"mpitrain.tensorflow.{kind}")
    except ValueError as exc:                  # every rank refused: the same error everywhere
        raise problem.exc_type(str(exc)) from None
    raise AssertionError("an agreement with an error always raises")   # pragma: no cover


def dtype_name(array):
    return "bfloat16" if array.dtype.name == "bfloat16" else array.dtype.name


def check_arrays(kind, arrays, op=None, movers=False):
    """Refuse (on every rank) a call any of whose arrays cannot travel."""
    for i, a in enumerate(arrays):
        name = dtype_name(a)
        what = kind if len(arrays) == 1 else f"{kind}: tensor {i}"
        if name not in REDUCED:
            raise Problem(TypeError, f"{what}: dtype {name} is not supported; use one of "
                                     f"{', '.join(REDUCED)}")
    if isinstance(op, str) and op.lower() == Adasum:
        raise Problem(RuntimeError, f"{kind}: Adasum is not supported; use Average or Sum")


def checked(kind, process_set, fn, op=None):
    """``fn`` behind the argument check: a Problem becomes the agreed error on every rank."""
    def run(*arrays):
        try:
            check_arrays(kind, arrays, op)
        except Problem as problem:
            refuse(kind, problem, process_set)
        return fn(*arrays)
    return run


def to_reduce(a):
    """The array the comm layer reduces: bfloat16 as a float32 copy."""
    a = np.asarray(a)
    if a.dtype.name == "bfloat16":
        return a.astype(np.float32)
    return np.ascontiguousarray(a)


def to_move(a):
    """The array the comm layer moves: bfloat16's bits as int16."""
    a = np.ascontiguousarray(a)
    return a.view(np.int16) if a.dtype.name == "bfloat16" else a


def back(result, like):
    """The comm layer's result as ``like``'s dtype (bfloat16 rounded once, an integer
    Average's float64 mean truncated toward zero)."""
    result = np.asarray(result)
    if like.ndim == 0 and result.shape != () and result.size == 1:
        result = result.reshape(())             # a scalar comes back as a scalar
    if like.dtype.name == "bfloat16" and result.dtype == np.int16:
        return result.view(like.dtype)
    return result.astype(like.dtype, copy=False)


# --- arguments ------------------------------------------------------------------------------

def resolve_op(average, op, kind, process_set):
    """Horovod's rule: ``op`` supersedes the deprecated ``average``; neither means Average."""
    if average is not None and op is not None:
        refuse(kind, Problem(ValueError, f"{kind}: the op parameter supersedes average; give "
                                         f"only one of them"), process_set)
    if op is None:
        return Average if average is None or average else Sum
    return op


def _name(name, kind):
    return None if name is None else str(name)


# --- allreduce ------------------------------------------------------------------------------

def _reduce_fn(op, name, prescale_factor, postscale_factor, process_set, grouped):
    def run(*arrays):
        wire = [to_reduce(a) for a in arrays]
        if grouped:
            outs = comm.grouped_allreduce(wire, op, name, prescale_factor, postscale_factor,
                                          process_set=process_set)
        else:
            outs = [comm.allreduce(wire[0], op, name, prescale_factor, postscale_factor,
                                   process_set=process_set)]
        return [back(o, a) for o, a in zip(outs, arrays)]
    return run


def allreduce(tensor, average=None, device_dense='', device_sparse='',
              compression=Compression.none, op=None, prescale_factor=1.0, postscale_factor=1.0,
              name=None, process_set=global_process_set, ignore_name_scope=False):
    """A new tensor of the input's dtype and shape: ``op`` of every rank's ``tensor``.

    op: Average (default), Sum, Min, Max, Product; ``average`` is Horovod's deprecated spelling
    (True: Average, False: Sum). prescale/postscale_factor multiply before / after the
    reduction. compression: sent compressed (``Compression.fp16``), returned decompressed.
    A tf.IndexedSlices is made dense and reduced as a dense tensor. ``device_*`` and
    ``ignore_name_scope`` are accepted for Horovod's scripts."""
    op = resolve_op(average, op, "allreduce", process_set)
    sent, ctx = compression.compress(dense(tensor))
    sent = tf.convert_to_tensor(sent)
    fn = checked("allreduce", process_set,
                 _reduce_fn(op, _name(name, "allreduce"), prescale_factor, postscale_factor,
                            process_set, False), op)
    [out] = host_call("allreduce", fn, [sent], [sent.dtype], [sent.shape])
    return compression.decompress(out, ctx)


def grouped_allreduce(tensors, average=None, device_dense='', device_sparse='',
                      compression=Compression.none, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set, name=None):
    """``allreduce`` of each tensor of a list in one fused collective (one host call, one
    fusion buffer per dtype); the list of results."""
    if not isinstance(tensors, (list, tuple)):
        refuse("grouped_allreduce", Problem(TypeError, f"grouped_allreduce: expected a list of "
                                                       f"tensors, got {type(tensors).__name__}"),
               process_set)
    op = resolve_op(average, op, "grouped_allreduce", process_set)
    if not tensors:
        return []
    pairs = [compression.compress(dense(t)) for t in tensors]
    sent = [tf.convert_to_tensor(t) for t, _ in pairs]
    fn = checked("grouped_allreduce", process_set,
                 _reduce_fn(op, _name(name, "grouped_allreduce"), prescale_factor,
                            postscale_factor, process_set, True), op)
    outs = host_call("grouped_allreduce", fn, sent, [t.dtype for t in sent],
                     [t.shape for t in sent])
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, pairs)]


# --- the data movers ------------------------------------------------------------------------

def _rest_shape(tensor):
    """[None] + the shape after dimension 0 (what a collective that changes dimension 0
    returns), or an unknown shape."""
    shape = tensor.shape
    if shape.rank is None or shape.rank == 0:
        return tf.TensorShape(None)
    return tf.TensorShape([None]).concatenate(shape[1:])


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along dimension 0, in rank order (the first
    dimensions may differ, the others must not)."""
    tensor = dense(tensor)

    def run(a):
        return [back(comm.allgather(to_move(a), _name(name, "allgather"),
                                    process_set=process_set), a)]
    [out] = host_call("allgather", checked("allgather", process_set, run), [tensor],
                      [tensor.dtype], [_rest_shape(tensor)])
    return out


def broadcast(tensor, root_rank, name=None, ignore_name_scope=False,
              process_set=global_process_set):
    """A new tensor holding ``root_rank``'s ``tensor`` (root_rank: a global rank)."""
    tensor = dense(tensor)

    def run(a):
        return [back(comm.broadcast(to_move(a), root_rank, _name(name, "broadcast"),
                                    process_set=process_set), a)]
    [out] = host_call("broadcast", checked("broadcast", process_set, run), [tensor],
                      [tensor.dtype], [tensor.shape])
    return out


def reducescatter(tensor, device_dense='', compression=Compression.none, op=Average, name=None,
                  process_set=global_process_set, ignore_name_scope=False, prescale_factor=1.0,
                  postscale_factor=1.0):
    """``op`` of every rank's ``tensor``, of which rank r of the set gets block r of
    dimension 0 (the first len % N ranks get one row more)."""
    sent, ctx = compression.compress(dense(tensor))
    sent = tf.convert_to_tensor(sent)

    def run(a):
        out = comm.reducescatter(to_reduce(a), op, _name(name, "reducescatter"),
                                 prescale_factor, postscale_factor, process_set=process_set)
        return [back(out, a)]
    [out] = host_call("reducescatter", checked("reducescatter", process_set, run, op), [sent],
                      [sent.dtype], [_rest_shape(sent)])
    return compression.decompress(out, ctx)


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False,
             process_set=global_process_set):
    """Send rows ``splits[j]`` of ``tensor`` (in order) to rank j of the set; returns
    ``(received, received_splits)``: the rows received in rank order and the int32 tensor of
    their counts (Horovod's pair). Without ``splits`` dimension 0 must divide evenly by the
    number of ranks."""
    tensor = dense(tensor)
    inputs = [tensor]
    if splits is not None:
        splits = tf.convert_to_tensor(splits)
        if splits.dtype.is_floating or splits.dtype == tf.bool:
            refuse("alltoall", Problem(ValueError, f"alltoall: splits must be integers, got "
                                                   f"a {splits.dtype.name} tensor"), process_set)
        inputs.append(tf.cast(splits, tf.int64))

    def run(a, *s):
        try:
            check_arrays("alltoall", [a])
        except Problem as problem:
            refuse("alltoall", problem, process_set)
        given = [int(v) for v in s[0].reshape(-1)] if s else None
        result = comm.alltoall(to_move(a), given, _name(name, "alltoall"),
                               process_set=process_set)
        if given is None:
            n = comm.group_size(process_set, "mpitrain.tensorflow.alltoall")
            received = np.full(n, a.shape[0] // n if a.ndim else 0, np.int32)
            out = result
        else:
            out, received = result
        return [back(out, a), np.asarray(received, np.int32)]
    out, received = host_call("alltoall", run, inputs, [tensor.dtype, tf.int32],
                              [_rest_shape(tensor), tf.TensorShape([None])])
    return out, received


# --- no tensors -----------------------------------------------------------------------------

def barrier(process_set=global_process_set):
    """Wait until every rank of the set gets here."""
    comm.barrier(process_set=process_set)


def join(device=-1, process_set=global_process_set):
    """This rank is out of data: serve the others' reductions (its contribution: zeros, or the
    op's identity) until every rank has joined; returns the rank that joined last."""
    return comm.join(device, process_set=process_set)


def broadcast_object(obj, root_rank=0, session=None, name=None,
                     process_set=global_process_set):
    """``root_rank``'s picklable ``obj`` on every rank (``session``, ``name`` accepted)."""
    return comm.broadcast_object(obj, root_rank=root_rank, process_set=process_set)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """The list of every rank's picklable ``obj``, in rank order."""
    return comm.allgather_object(obj, process_set=process_set)


# --- variables ------------------------------------------------------------------------------

def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign ``root_rank``'s value to each of ``variables`` (tf.Variables or Keras
    variables), on every rank: one host call for the whole list. Eagerly it returns None;
    inside a tf.function the group of the assignments."""
    variables = list(variables)
    if not variables:
        return None
    values = [tf.convert_to_tensor(v) for v in variables]

    def run(*arrays):
        check = checked("broadcast", process_set, lambda *a: a)
        check(*arrays)
        return [back(comm.broadcast(to_move(a), root_rank, None, process_set=process_set), a)
                for a in arrays]
    outs = host_call("broadcast", run, values, [v.dtype for v in values],
                     [v.shape for v in values])
    assigns = [v.assign(o) for v, o in zip(variables, outs)]
    if tf.executing_eagerly():
        return None
    return tf.group(*[a for a in assigns if a is not None])
