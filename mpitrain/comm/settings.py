"""CommSettings: every MPITRAIN_* setting of the comm layer, read once, validated once.

``mt.init()`` reads the environment into one frozen ``CommSettings`` (or takes the one passed as
``mt.init(settings=...)``), checks that every rank has the same one, and keeps it in the
communicator's state (world.py); nothing in the comm layer reads the environment afterwards.

    MPITRAIN_ALLREDUCE          algorithm            auto (by size) | ring | mpi
    MPITRAIN_RING_THRESHOLD     ring_threshold_bytes from this size on, auto takes the ring
                                                     (None: 1 MiB between two ranks, else 32 MiB)
    MPITRAIN_RING_SUBCHUNK      ring_subchunk_bytes  pipelining piece of the ring (1 MiB)
    MPITRAIN_CHECK              check                off turns the cross-rank agreement off (on)
    MPITRAIN_STALL_WARNING      stall_warning_s      report a stall after this long; 0 = off (60)
    MPITRAIN_STALL_SHUTDOWN     stall_shutdown_s     abort the job after this long; 0 = never (600)
    MPITRAIN_FUSION_THRESHOLD   fusion_threshold_bytes  bucket size limit (None: the caller's
                                                     default, 64 MiB; 4 MiB for overlap)
    MPITRAIN_NODE_SIZE          local_size           emulated nodes of k consecutive ranks (testing;
                                                     alias MPITRAIN_LOCAL_SIZE, the older name)
    MPITRAIN_HIERARCHICAL_ALLREDUCE  hierarchical    on: allreduce inside nodes, then across (off)
    MPITRAIN_AUTOTUNE           autotune             on: try fusion thresholds and ring/MPI on
                                                     the first training steps (autotune.py) (off)
    MPITRAIN_AUTOTUNE_LOG       autotune_log         CSV of the trials, written by rank 0
    MPITRAIN_AUTOTUNE_STEPS     autotune_steps       timed steps per trial (3)
    MPITRAIN_AUTOTUNE_WARMUP_STEPS  autotune_warmup_steps  untimed steps after each switch (1)
    MPITRAIN_DEVICE_COMM        device_comm          device allreduce: auto | nccl | mpi | host
    MPITRAIN_CUDA_AWARE_MPI     cuda_aware_mpi       on | off overrides the MPI library's answer

Each is read with runtime/env.py's grammar (booleans: 1/0, true/false, yes/no, on/off).

Ranks with different values would take different paths and make unmatched MPI calls, so init
compares them first (world.py) and a difference is a CollectiveError on every rank.
"""
import dataclasses
import math
from typing import Optional

from mpitrain.runtime import env

ALGORITHMS = ("ring", "mpi", "auto")
DEVICE_TRANSPORTS = ("nccl", "mpi", "host")
ENV = {"algorithm": "MPITRAIN_ALLREDUCE", "ring_threshold_bytes": "MPITRAIN_RING_THRESHOLD",
       "ring_subchunk_bytes": "MPITRAIN_RING_SUBCHUNK", "check": "MPITRAIN_CHECK",
       "stall_warning_s": "MPITRAIN_STALL_WARNING", "stall_shutdown_s": "MPITRAIN_STALL_SHUTDOWN",
       "fusion_threshold_bytes": "MPITRAIN_FUSION_THRESHOLD",
       "local_size": "MPITRAIN_NODE_SIZE", "device_comm": "MPITRAIN_DEVICE_COMM",
       "cuda_aware_mpi": "MPITRAIN_CUDA_AWARE_MPI",
       "hierarchical": "MPITRAIN_HIERARCHICAL_ALLREDUCE", "autotune": "MPITRAIN_AUTOTUNE",
       "autotune_log": "MPITRAIN_AUTOTUNE_LOG", "autotune_steps": "MPITRAIN_AUTOTUNE_STEPS",
       "autotune_warmup_steps": "MPITRAIN_AUTOTUNE_WARMUP_STEPS"}
NODE_SIZE_ALIAS = "MPITRAIN_LOCAL_SIZE"          # the node size's first name, still read
NODE_SIZE_NAMES = "MPITRAIN_NODE_SIZE (alias MPITRAIN_LOCAL_SIZE)"      # for error messages
VARIABLES = (*ENV.values(), NODE_SIZE_ALIAS)
RING_THRESHOLD_BYTES = 32 << 20         # auto's switch to the ring (ring_threshold) ...
RING_THRESHOLD_TWO_RANKS = 1 << 20      # ... and between two ranks
env.declare(*VARIABLES)


@dataclasses.dataclass(frozen=True)
class CommSettings:
    algorithm: str = "auto"
    ring_threshold_bytes: Optional[int] = None
    ring_subchunk_bytes: int = 1 << 20
    check: bool = True
    stall_warning_s: float = 60.0
    stall_shutdown_s: float = 600.0     # as PyTorch's NCCL timeout: a hung job ends
    fusion_threshold_bytes: Optional[int] = None
    local_size: Optional[int] = None
    device_comm: str = "auto"
    cuda_aware_mpi: Optional[bool] = None
    hierarchical: bool = False
    autotune: bool = False
    autotune_log: Optional[str] = None
    autotune_steps: int = 3
    autotune_warmup_steps: int = 1

    def __post_init__(self):
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"MPITRAIN_ALLREDUCE={self.algorithm!r}: expected ring, mpi or auto")
        if self.ring_threshold_bytes is not None:
            _check_int("MPITRAIN_RING_THRESHOLD", self.ring_threshold_bytes, 0)
        _check_int("MPITRAIN_RING_SUBCHUNK", self.ring_subchunk_bytes, 1)
        for key, value in (("MPITRAIN_STALL_WARNING", self.stall_warning_s),
                           ("MPITRAIN_STALL_SHUTDOWN", self.stall_shutdown_s)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < math.inf:
                raise ValueError(f"{key}={value!r} must be >= 0 seconds (0 turns it off)")
        if self.fusion_threshold_bytes is not None:
            _check_int("MPITRAIN_FUSION_THRESHOLD", self.fusion_threshold_bytes, 0)
        if self.local_size is not None:
            _check_int(NODE_SIZE_NAMES, self.local_size, 1)
        for key, value in (("MPITRAIN_HIERARCHICAL_ALLREDUCE", self.hierarchical),
                           ("MPITRAIN_AUTOTUNE", self.autotune)):
            if value not in (True, False):
                raise ValueError(f"{key}={value!r}: expected True or False")
        if self.autotune_log is not None and (not isinstance(self.autotune_log, str)
                                              or not self.autotune_log.strip()):
            raise ValueError(f"MPITRAIN_AUTOTUNE_LOG={self.autotune_log!r}: expected a file path")
        _check_int("MPITRAIN_AUTOTUNE_STEPS", self.autotune_steps, 1)
        _check_int("MPITRAIN_AUTOTUNE_WARMUP_STEPS", self.autotune_warmup_steps, 0)
        if self.device_comm not in DEVICE_TRANSPORTS + ("auto",):
            raise ValueError(f"MPITRAIN_DEVICE_COMM={self.device_comm!r}: expected one of nccl, "
                             f"mpi, host (or unset)")
        if self.cuda_aware_mpi not in (None, True, False):
            raise ValueError(f"MPITRAIN_CUDA_AWARE_MPI={self.cuda_aware_mpi!r}: expected True, "
                             f"False or None (ask the MPI library)")

    @classmethod
    def from_env(cls, environ=None):
        """The settings the environment asks for (unset or empty variables: the defaults)."""
        d = cls()

        def read(reader, field, *extra):
            return reader(ENV[field], getattr(d, field), *extra, environ=environ)

        return cls(algorithm=read(env.choice, "algorithm", ALGORITHMS),
                   ring_threshold_bytes=read(env.integer, "ring_threshold_bytes"),
                   ring_subchunk_bytes=read(env.integer, "ring_subchunk_bytes"),
                   check=read(env.flag, "check"),
                   stall_warning_s=read(env.number, "stall_warning_s", 0),
                   stall_shutdown_s=read(env.number, "stall_shutdown_s", 0),
                   fusion_threshold_bytes=fusion_threshold_from_env(environ),
                   local_size=_node_size(environ),
                   device_comm=read(env.choice, "device_comm", ("auto",) + DEVICE_TRANSPORTS),
                   cuda_aware_mpi=read(env.flag, "cuda_aware_mpi"),
                   hierarchical=read(env.flag, "hierarchical"),
                   autotune=read(env.flag, "autotune"),
                   autotune_log=read(env.text, "autotune_log"),
                   autotune_steps=read(env.integer, "autotune_steps"),
                   autotune_warmup_steps=read(env.integer, "autotune_warmup_steps"))

    def ring_threshold(self, size):
        """The size in bytes from which auto takes the ring between ``size`` ranks: the
        setting, else 1 MiB for two ranks -- where the ring is MPI's own large-message exchange
        of halves, with MPI's bits, and Average scales only the half it completes -- and 32 MiB
        for more (the ring's 2(N-1) steps against MPI's fewer)."""
        if self.ring_threshold_bytes is not None:
            return self.ring_threshold_bytes
        return RING_THRESHOLD_TWO_RANKS if size == 2 else RING_THRESHOLD_BYTES

    def fusion_threshold(self, default):
        """The bucket size limit in bytes: the setting, else the caller's ``default``."""
        return default if self.fusion_threshold_bytes is None else self.fusion_threshold_bytes


def fusion_threshold_from_env(environ=None, default=None):
    """MPITRAIN_FUSION_THRESHOLD in bytes (the CLI's --fusion-threshold-bytes reads it too)."""
    return env.integer(ENV["fusion_threshold_bytes"], default, environ=environ)


def _node_size(environ):
    """MPITRAIN_NODE_SIZE, or its alias; both set to different values is an error."""
    size = env.integer(ENV["local_size"], None, environ=environ)
    alias = env.integer(NODE_SIZE_ALIAS, None, environ=environ)
    if size is not None and alias is not None and size != alias:
        raise ValueError(f"{ENV['local_size']}={size} but its alias {NODE_SIZE_ALIAS}={alias}: "
                         f"set one of the two")
    return alias if size is None else size


def _check_int(key, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} is not an integer")
    if value < minimum:
        raise ValueError(f"{key}={value} must be >= {minimum}")
