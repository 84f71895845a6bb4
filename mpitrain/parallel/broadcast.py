"""The broadcasts that make every replica start from one model: root_rank's parameters
(broadcast_parameters) and optimizer state (broadcast_optimizer_state), so ranks that initialised
differently (other seeds, a checkpoint loaded only on rank 0) agree before the first step.
"""
import numpy as np

from mpitrain import comm


def broadcast_parameters(params, root_rank=0, process_set=comm.global_process_set):
    """Overwrite every parameter in place with root_rank's values (Horovod's spellings).

    params, any of:
    - ``model.state_dict()`` or any dict name -> array (host or device) or Parameter: the arrays
      are written in place, so the model they belong to changes (broadcast in sorted name order);
    - ``model.named_parameters()``: an iterable of (name, Parameter or array) pairs;
    - ``model.parameters()``: an iterable of Parameters (or arrays), named by position -- every
      rank must list them in the same order, as a model's own ``parameters()`` does.
    Anything that cannot be written back (a list, a scalar, a read-only array, a pair that is not
    (name, array)) is a ValueError, and a difference in names across ranks a comm.CollectiveError:
    raised on every rank, before any data moves, never ignored. process_set: the ranks that
    take part (root_rank is a global rank among them).
    """
    items, error = _writable_arrays(params)
    names = [name for name, _ in items]
    # One agreement first: a rank whose input is bad must not leave the others in a broadcast.
    reports = comm.allgather_object((error, names), process_set=process_set)
    errors = [f"rank {r}: {e}" for r, (e, _) in enumerate(reports) if e is not None]
    if errors:
        raise ValueError("broadcast_parameters: " + "; ".join(errors))
    if any(other != names for _, other in reports):
        differ = [r for r, (_, other) in enumerate(reports) if other != reports[0][1]]
        raise comm.CollectiveError(
            f"broadcast_parameters: the parameter names of ranks {differ} differ from rank 0's "
            f"({len(reports[0][1])} names starting {reports[0][1][:3]})")
    for name, array in items:
        comm.broadcast_(array, root_rank, name=f"broadcast_parameters.{name}",
                               process_set=process_set)


def _writable_arrays(params):
    """``([(name, array)], error)``: the arrays broadcast_parameters writes into, or why not."""
    if isinstance(params, dict):
        pairs = sorted(params.items())
    else:
        try:
            pairs = list(params)
        except TypeError:
            return [], (f"expected a dict of arrays, (name, parameter) pairs or parameters, got "
                        f"{type(params).__name__}")
        if pairs and not isinstance(pairs[0], tuple):      # model.parameters(): no names
            pairs = [(f"param.{i}", p) for i, p in enumerate(pairs)]
    items = []
    for pair in pairs:
        if not (isinstance(pair, tuple) and len(pair) == 2):
            return [], (f"expected (name, parameter) pairs; got {type(pair).__name__} "
                        f"among them")
        name, value = pair
        # an array as is (NumPy's, CuPy's and Numba's .data are buffers), else a Parameter's .data
        array = (value if isinstance(value, np.ndarray) or comm.on_device(value)
                 else getattr(value, "data", value))
        if not comm.on_device(array):
            if not isinstance(array, np.ndarray):
                return [], (f"{name!r} is a {type(value).__name__}, which cannot be written "
                            f"back in place; pass the model's arrays (model.state_dict()) or "
                            f"Parameters")
            if not array.flags.writeable:
                return [], f"{name!r} is a read-only array; it cannot be written back in place"
        items.append((str(name), array))
    return items, None


def broadcast_optimizer_state(optimizer, root_rank=0, process_set=comm.global_process_set):
    """Give every rank root_rank's optimizer state (hyper-parameters, step, buffers), in place.

    The root's state layout travels first (as an object), so ranks whose state differs in shape
    or keys (a fresh optimizer vs a loaded one) still end up identical instead of mismatching.
    A sharded DistributedOptimizer (``sharding="optimizer"``) holds a slice of the state: the
    root's whole state (``checkpoint_state``, collective) travels, and each rank keeps its
    slice of it (``load_checkpoint_state``).
    """
    sharded = getattr(optimizer, "sharding", "none") != "none"
    state = optimizer.checkpoint_state() if sharded else optimizer.state_dict()
    arrays = {k: (v.shape, v.dtype.str) for k, v in state.items() if isinstance(v, np.ndarray)}
    values = {k: v for k, v in state.items() if k not in arrays}
    arrays, values = comm.broadcast_object((arrays, values), root_rank=root_rank,
                                                  process_set=process_set)
    new = dict(values)
    for k in sorted(arrays):
        shape, dtype = arrays[k]
        mine = state.get(k)
        ok = isinstance(mine, np.ndarray) and mine.shape == shape and mine.dtype.str == dtype
        new[k] = np.ascontiguousarray(mine) if ok else np.zeros(shape, dtype)
        comm.broadcast_(new[k], root_rank, name=f"broadcast_optimizer_state.{k}",
                               process_set=process_set)
    if sharded:
        optimizer.load_checkpoint_state(new)
    else:
        optimizer.load_state_dict(new)
