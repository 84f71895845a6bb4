"""mpitrain: data-parallel training over MPI with our own ring-allreduce.

    import mpitrain as mt
    mt.init()
    avg = mt.allreduce(x)                       # mean across ranks (mt.Average)

Each section below re-exports one layer of the package; ``__all__`` is the public contract
(see docs/architecture.md).
"""
# Collectives (mpitrain/comm): init, rank/size, allreduce, ..., CollectiveError.
from mpitrain.comm import *  # noqa: F401,F403
from mpitrain.comm import __all__ as _comm_all
from mpitrain.distributed import broadcast_parameters  # noqa: F401

# Training (distributed.py): the optimizer wrapper, optimizer-state broadcast, compression.
from mpitrain.distributed import (Compression, DistributedOptimizer,  # noqa: F401
                                  broadcast_optimizer_state)

# Model side (no MPI inside): layers, models, optimizers, datasets.
from mpitrain import data, nn, optim  # noqa: F401
from mpitrain.nn import models  # noqa: F401

__version__ = "0.1.0"
__all__ = list(_comm_all) + ["broadcast_parameters", "nn", "optim", "data", "models"]
__all__ += ["DistributedOptimizer", "Compression", "broadcast_optimizer_state"]
