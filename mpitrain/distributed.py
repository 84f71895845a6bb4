"""Bridge between the model side (nn, optim) and the collectives (comm): no MPI calls of its own.

broadcast_parameters makes every replica start from root_rank's weights, so ranks that initialised
differently (other seeds, a checkpoint loaded only on rank 0) agree before the first step.
"""
import numpy as np

from mpitrain.comm import collectives


def broadcast_parameters(params, root_rank=0):
    """Overwrite every parameter in place with root_rank's values.

    params: a dict name -> array, or an iterable of (name, Parameter) pairs (anything with a
    ``.data`` array, e.g. ``model.named_parameters()``). Names are broadcast in sorted order for
    dicts and in the given order otherwise; the cross-rank check (mt.CollectiveError) catches
    ranks whose parameter lists differ.
    """
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
    for name, p in items:
        is_array = isinstance(p, np.ndarray) or hasattr(p, "__cuda_array_interface__")
        array = p if is_array else p.data
        collectives.broadcast_(array, root_rank, name=f"broadcast_parameters.{name}")
