"""CommSettings: every MPITRAIN_* setting of the comm layer, read once, validated once.

``mt.init()`` reads the environment into one frozen ``CommSettings`` (or takes the one passed as
``mt.init(settings=...)``), checks that every rank has the same one, and keeps it in the
communicator's state (world.py); nothing in the comm layer reads the environment afterwards.

    MPITRAIN_ALLREDUCE          algorithm            auto (by size) | ring | mpi
    MPITRAIN_RING_THRESHOLD     ring_threshold_bytes from this size on, auto takes the ring (32 MiB)
    MPITRAIN_RING_SUBCHUNK      ring_subchunk_bytes  pipelining piece of the ring (1 MiB)
    MPITRAIN_CHECK              check                0 turns the cross-rank agreement off (1)
    MPITRAIN_STALL_WARNING      stall_warning_s      report a stall after this long; 0 = off (60)
    MPITRAIN_STALL_SHUTDOWN     stall_shutdown_s     abort the job after this long; 0 = never (600)
    MPITRAIN_FUSION_THRESHOLD   fusion_threshold_bytes  bucket size limit (None: the caller's
                                                     default, 64 MiB; 4 MiB for overlap)
    MPITRAIN_NODE_SIZE          local_size           emulated nodes of k consecutive ranks (testing;
                                                     alias MPITRAIN_LOCAL_SIZE, the older name)
    MPITRAIN_HIERARCHICAL_ALLREDUCE  hierarchical    1: allreduce inside nodes, then across (0)
    MPITRAIN_AUTOTUNE           autotune             1: try fusion thresholds and ring/MPI on
                                                     the first training steps (autotune.py) (0)
    MPITRAIN_AUTOTUNE_LOG       autotune_log         CSV of the trials, written by rank 0
    MPITRAIN_AUTOTUNE_STEPS     autotune_steps       timed steps per trial (3)
    MPITRAIN_AUTOTUNE_WARMUP_STEPS  autotune_warmup_steps  untimed steps after each switch (1)
    MPITRAIN_DEVICE_COMM        device_comm          device allreduce: auto | nccl | mpi | host
    MPITRAIN_CUDA_AWARE_MPI     cuda_aware_mpi       0 | 1 overrides the MPI library's answer

Ranks with different values would take different paths and make unmatched MPI calls, so init
compares them first (world.py) and a difference is a CollectiveError on every rank.
"""
import dataclasses
import math
import os
from typing import Optional

from mpitrain import env

ALGORITHMS = ("auto", "ring", "mpi")
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
# Other names of the same variable: MPITRAIN_LOCAL_SIZE was the node size's first name.
ALIASES = {"local_size": "MPITRAIN_LOCAL_SIZE"}
_BUT = "but its alias"
NODE_SIZE_NAMES = "MPITRAIN_NODE_SIZE (alias MPITRAIN_LOCAL_SIZE)"      # for error messages
env.declare(*ENV.values(), *ALIASES.values())


@dataclasses.dataclass(frozen=True)
class CommSettings:
    algorithm: str = "auto"
    ring_threshold_bytes: int = 32 << 20
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
                raise ValueError(f"{key}={value!r}: expected 0 or 1")
        if self.autotune_log is not None and (not isinstance(self.autotune_log, str)
                                              or not self.autotune_log.strip()):
            raise ValueError(f"MPITRAIN_AUTOTUNE_LOG={self.autotune_log!r}: expected a file path")
        _check_int("MPITRAIN_AUTOTUNE_STEPS", self.autotune_steps, 1)
        _check_int("MPITRAIN_AUTOTUNE_WARMUP_STEPS", self.autotune_warmup_steps, 0)
        if self.device_comm not in DEVICE_TRANSPORTS + ("auto",):
            raise ValueError(f"MPITRAIN_DEVICE_COMM={self.device_comm!r}: expected one of nccl, "
                             f"mpi, host (or unset)")
        if self.cuda_aware_mpi not in (None, True, False):
            raise ValueError(f"MPITRAIN_CUDA_AWARE_MPI={self.cuda_aware_mpi!r}: expected 0 or 1")

    @classmethod
    def from_env(cls, environ=None):
        """The settings the environment asks for (unset or empty variables: the defaults)."""
        raw = env_values(environ)
        kw = {field: raw[field].lower() for field in ("algorithm", "device_comm")
              if raw[field] is not None}
        for field in ("ring_threshold_bytes", "ring_subchunk_bytes", "fusion_threshold_bytes",
                      "local_size", "autotune_steps", "autotune_warmup_steps"):
            if raw[field] is not None and _BUT in raw[field]:
                raise ValueError(f"{ENV[field]}={raw[field]}: set one of the two")
            if raw[field] is not None:
                kw[field] = _parse_int(NODE_SIZE_NAMES if field == "local_size" else ENV[field],
                                       raw[field])
        if raw["check"] is not None:
            kw["check"] = raw["check"] != "0"
        for field in ("hierarchical", "autotune"):
            if raw[field] is not None:
                kw[field] = _parse_flag(ENV[field], raw[field])
        if raw["autotune_log"] is not None:
            kw["autotune_log"] = raw["autotune_log"]
        if raw["cuda_aware_mpi"] in ("0", "1"):      # anything else: ask the library
            kw["cuda_aware_mpi"] = raw["cuda_aware_mpi"] == "1"
        for field in ("stall_warning_s", "stall_shutdown_s"):
            if raw[field] is not None:
                kw[field] = _parse_seconds(ENV[field], raw[field])
        return cls(**kw)

    def fusion_threshold(self, default):
        """The bucket size limit in bytes: the setting, else the caller's ``default``."""
        return default if self.fusion_threshold_bytes is None else self.fusion_threshold_bytes


def env_values(environ=None):
    """field -> the raw text of its variable (None when unset or blank)."""
    environ = os.environ if environ is None else environ
    values = {}
    for field, key in ENV.items():
        text = environ.get(key)
        values[field] = text if text is not None and text.strip() else None
    for field, alias in ALIASES.items():
        text = environ.get(alias)
        if text is None or not text.strip() or text == values[field]:
            continue
        # both names set to different values: parsing refuses it (same text on every rank
        # that has the same pair, so init's comparison still sees a difference as one)
        values[field] = text if values[field] is None else f"{values[field]} {_BUT} {alias}={text}"
    return values


def _parse_int(key, text):
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not an integer") from None


def _parse_flag(key, text):
    if text.strip() not in ("0", "1"):
        raise ValueError(f"{key}={text!r}: expected 0 or 1")
    return text.strip() == "1"


def _parse_seconds(key, text):
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{key}={text!r} is not a number of seconds") from None
    if not 0 <= value < math.inf:
        raise ValueError(f"{key}={text!r} must be >= 0 seconds (0 turns it off)")
    return value


def _check_int(key, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}={value!r} is not an integer")
    if value < minimum:
        raise ValueError(f"{key}={value} must be >= {minimum}")
