"""Device arrays (CuPy, Numba): what differs from the host -- array families and transport.

collectives.py hands every array exposing ``__cuda_array_interface__`` (or a Numba device array,
which under NUMBA_ENABLE_CUDASIM=1 is a simulated one) to the functions here, which have the same
names and signatures as the host API. allreduce and grouped_allreduce are host.py's own
(``allreduce_checked``, ``grouped``: validation, agreement, integer means, the fusion loop) run
over a device array family (``_Family``: allocation, copies, the transport below), so the two
paths cannot drift apart; a mismatch is a CollectiveError on every rank, never a hang.

The process's GPU (``select_device``, re-exported here; made current on the thread running each
device collective) is gpu.py's.

Allreduce transport, chosen once (on the first device collective, identically on every rank,
logged once by rank 0; ``MPITRAIN_DEVICE_COMM=nccl|mpi|host`` -- CommSettings.device_comm --
forces one):

    nccl   cupy.cuda.nccl, when CuPy has it; the NCCL unique id is broadcast over MPI. NCCL
           reduces in place on the device, on the current CuPy stream (the legacy default
           stream unless the caller changed it, which Numba kernels also use). Not when two
           ranks share a GPU: NCCL refuses two ranks on one device. Ranks compare (host, PCI
           bus id), not ordinals: with a per-rank CUDA_VISIBLE_DEVICES every rank is on its
           GPU 0, and emulated nodes (MPITRAIN_NODE_SIZE) may split one host.
    mpi    CUDA-aware MPI, when the MPI library says so (MPIX_Query_cuda_support() == 1, asked
           through ctypes because mpi4py does not wrap it; MPITRAIN_CUDA_AWARE_MPI=0|1, i.e.
           CommSettings.cuda_aware_mpi, overrides). The device is synchronised first: MPI
           reads device memory directly and knows nothing of queued kernels.
    host   staging through pinned host buffers around the host allreduce (our ring): copy down,
           reduce, copy up, each copy finished before the host reads or reuses the buffer.
           Always available; the only choice under the CUDA simulator.

Average is Sum then a device scale by postscale/N (prescale first), like the host path; dtypes
a transport cannot reduce (float16 on MPI, int16 on NCCL) take the host path. The fusion buffer
of grouped_allreduce lives on the device, with fusion.py's plan. The one-off collectives
(broadcast, allgather, reducescatter, alltoall: parameter broadcast at start, metrics) stage
through the host (host.py). The transport, NCCL communicator and device fusion buffer live in
the World each collective is given as ``state`` (the global set's or a process set's, resolved
by collectives.py), so ``mt.shutdown()`` and ``mt.remove_process_set`` forget them. The only
place in the package that branches on the device array type is ``_family``.
"""
import ctypes
import os
import re
import socket
import sys

import numpy as np
from mpi4py import MPI

from mpitrain.comm import host as host_collectives
from mpitrain.comm import world
from mpitrain.comm.build_info import cuda_built, nccl_built
from mpitrain.comm.engine import allreduce_flat as host_allreduce_flat
from mpitrain.comm.gpu import bind_thread, select_device
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import DTYPES, MPI_OPS, Average, mpi_can_reduce, on_device, reduce_kind
from mpitrain.comm.settings import DEVICE_TRANSPORTS as TRANSPORTS
from mpitrain.comm.watchdog import watched

__all__ = ["TRANSPORTS", "select_device", "cuda_aware_mpi", "transport", "allreduce",
           "allreduce_", "grouped_allreduce", "grouped_allreduce_", "allgather", "broadcast",
           "broadcast_", "reducescatter", "alltoall"]


# --- array families -----------------------------------------------------------------------------

class _Family:
    """A device array family: its kernels module (copy, scale, empty, to_host, to_device,
    synchronize), the staging helpers below, and what host.py's collectives need of an array
    family (host.HostArrays has the same attributes), so one implementation serves both."""

    fields = {"device": True}             # moved by the device's transport (kinds.py)
    home = staticmethod(lambda state: state.device)       # state.device["fusion"]

    def __init__(self, kernels, new_pinned):
        self.kernels = kernels
        self.empty, self.copy = kernels.empty, kernels.copy
        self._new_pinned = new_pinned           # (n, dtype) -> a pinned host array
        self._pinned = {}

    @staticmethod
    def flat(a):
        return a if a.ndim == 1 else a.reshape(a.size)

    def as_float64(self, a):
        """The float64 mean of integers, as on the host (integer averages are small metrics)."""
        return self.kernels.to_device(self.kernels.to_host(a).astype(np.float64))

    def allreduce_flat(self, state, flat, op, pre, post):
        return _allreduce_flat(state, self, flat, op, pre, post)

    def pinned(self, n, dtype):
        """A pinned host buffer of >= n elements, reused across calls."""
        buf = self._pinned.get(np.dtype(dtype))
        if buf is None or buf.size < n:
            buf = self._pinned[np.dtype(dtype)] = self._new_pinned(max(n, 1), dtype)
        return buf[:n]


class _NumbaFamily(_Family):
    """Numba device arrays (real or simulated) and foreign CAI arrays wrapped by Numba."""

    name = "numba"

    def __init__(self):
        from numba import cuda
        from mpitrain import kernels
        super().__init__(kernels.get("cuda", "numba"), cuda.pinned_array)
        self.cuda = cuda

    def wrap(self, x):
        return x if getattr(x, "__cuda_ndarray__", False) else self.cuda.as_cuda_array(x)

    def contiguous(self, x):
        return x.is_c_contiguous()

    def to_host(self, flat, host):
        flat.copy_to_host(host)
        self._wait(flat)

    def to_dev(self, host, flat):
        flat.copy_to_device(host)
        self._wait(flat)

    @staticmethod
    def _wait(flat):
        """Numba copies on the array's own stream when it has one -- a producer's, adopted by
        as_cuda_array from ``__cuda_array_interface__["stream"]`` -- and then asynchronously:
        the copy must be done before the pinned buffer is read or reused. Without a stream
        (0) the copy was synchronous."""
        if flat.stream:
            flat.stream.synchronize()

    def stream_ptr(self):
        return 0                                   # Numba launches on the legacy default stream


class _CupyFamily(_Family):
    name = "cupy"

    def __init__(self):
        import cupy
        import cupyx
        from mpitrain import kernels
        super().__init__(kernels.get("cuda", "cupy"), cupyx.empty_pinned)
        self.cupy = cupy

    def wrap(self, x):
        return x

    def contiguous(self, x):
        return x.flags.c_contiguous

    def to_host(self, flat, host):
        flat.get(out=host)

    def to_dev(self, host, flat):
        flat.set(host)            # asynchronous on the current stream: the source is pinned
        self.cupy.cuda.get_current_stream().synchronize()

    def stream_ptr(self):
        return self.cupy.cuda.get_current_stream().ptr


_families = {}


def _family(x):
    """The family of a device array: CuPy arrays stay CuPy, everything else goes through Numba."""
    cupy = sys.modules.get("cupy")
    key = "cupy" if cupy is not None and isinstance(x, cupy.ndarray) else "numba"
    if key not in _families:
        _families[key] = _CupyFamily() if key == "cupy" else _NumbaFamily()
    return _families[key]


# --- which GPU (select_device and bind_thread: gpu.py) --------------------------------------------

def _current_device():
    """This process's GPU id (select_device's, else CuPy's current one), or -1."""
    dev = world.current().device.get("device")
    if dev is not None:
        return dev
    if "cupy" in sys.modules:
        try:
            return sys.modules["cupy"].cuda.Device().id
        except Exception:  # noqa: BLE001 - no device: nothing to compare
            return -1
    return -1


def _gpu_identity(dev):
    """(host, GPU) naming GPU ``dev`` of this process across ranks: two ranks share a GPU when
    theirs are equal. The GPU is its PCI address, else Numba's UUID (the simulator has no PCI
    address), else the ordinal (-1: none)."""
    return socket.gethostname(), (_pci_address(dev) if dev >= 0 else None) or f"ordinal {dev}"


def _pci_address(dev):
    """"domain:bus:device" of GPU ``dev`` (CuPy's if CuPy is loaded, else Numba's; both give the
    same string), Numba's UUID where there is no PCI address, or None."""
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        try:
            domain, bus, slot = re.split("[:.]", cupy.cuda.Device(dev).pci_bus_id)[:3]
            return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}"
        except Exception:  # noqa: BLE001 - CuPy without this device: ask Numba
            pass
    try:
        from numba import cuda
        gpu = cuda.gpus[dev]
        if not hasattr(gpu, "get_device_identity"):                 # the simulator's
            return gpu.device.uuid
        ids = gpu.get_device_identity()
        return (f"{ids['pci_domain_id']:04x}:{ids['pci_bus_id']:02x}:"
                f"{ids['pci_device_id']:02x}")
    except Exception:  # noqa: BLE001 - no CUDA driver: the ordinal is all there is
        return None


# --- transport choice ---------------------------------------------------------------------------

def _nccl_ok():
    from numba import config
    return not config.ENABLE_CUDASIM and nccl_built() and cuda_built()


def cuda_aware_mpi():
    """MPITRAIN_CUDA_AWARE_MPI=0|1 if set, else the MPI library's MPIX_Query_cuda_support()."""
    forced = world.current().settings.cuda_aware_mpi
    if forced is not None:
        return forced
    from numba import config
    if config.ENABLE_CUDASIM:
        return False
    paths = sorted({line.split()[-1] for line in open("/proc/self/maps")
                    if "/libmpi" in line and ".so" in line}) if os.path.exists("/proc/self/maps") \
        else []
    for path in paths + [None]:
        try:
            query = getattr(ctypes.CDLL(path), "MPIX_Query_cuda_support", None)
        except OSError:
            continue
        if query is not None:
            query.restype = ctypes.c_int
            return query() == 1
    return False


def transport(state=None):
    """The allreduce transport ('nccl' | 'mpi' | 'host') of a World (default: the global set's);
    chosen once per World, the same on every rank of it."""
    state = world.current() if state is None else state
    if state.device.get("transport") is not None:
        return state.device["transport"]
    comm = state.comm
    forced = state.settings.device_comm              # validated and agreed at init
    # NCCL refuses two ranks of one communicator on the same GPU (ranks sharing GPUs)
    ids = comm.allgather(_gpu_identity(_current_device()))
    shared_gpu = len(set(ids)) < len(ids)
    # a transport is usable only if it is usable on every rank
    local = np.array([_nccl_ok() and not shared_gpu, cuda_aware_mpi(), True], np.int32)
    comm.Allreduce(MPI.IN_PLACE, local, op=MPI.MIN)
    usable = {t: bool(v) for t, v in zip(TRANSPORTS, local)}
    if forced != "auto" and not usable[forced]:
        why = {"nccl": "cupy.cuda.nccl is not available on every rank, or ranks share a GPU",
               "mpi": "the MPI library is not CUDA-aware on every rank "
                      "(MPIX_Query_cuda_support; MPITRAIN_CUDA_AWARE_MPI=1 overrides)"}[forced]
        raise ValueError(f"MPITRAIN_DEVICE_COMM={forced}: {why}")
    choice = forced if forced != "auto" else next(t for t in TRANSPORTS if usable[t])
    if comm.Get_rank() == 0:
        how = "forced by MPITRAIN_DEVICE_COMM" if forced != "auto" else "auto"
        print(f"mpitrain: device allreduce via {choice} ({how}; usable: "
              f"{', '.join(t for t in TRANSPORTS if usable[t])})", file=sys.stderr, flush=True)
    state.device["transport"] = choice
    return choice


# --- the flat device allreduce ------------------------------------------------------------------

_NCCL_TYPES = {"int8": "NCCL_INT8", "uint8": "NCCL_UINT8", "int32": "NCCL_INT32",
               "int64": "NCCL_INT64", "float16": "NCCL_FLOAT16", "float32": "NCCL_FLOAT32",
               "float64": "NCCL_FLOAT64"}
_NCCL_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX"}


def _nccl_comm(state):
    """The NCCL communicator of a World (unique id from its rank 0 over MPI)."""
    if state.device.get("nccl") is None:
        from cupy.cuda import nccl
        comm = state.comm
        uid = nccl.get_unique_id() if comm.Get_rank() == 0 else None
        uid = comm.bcast(uid, root=0)
        state.device["nccl"] = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
    return state.device["nccl"]


def _allreduce_flat(state, fam, flat, op, pre, post):
    """Allreduce the contiguous 1-D device array ``flat`` in place (scaling included)."""
    with watched(state.record, "allreduce data"):     # the transport's choice too
        k = fam.kernels
        size = state.comm.Get_size()
        how = transport(state) if size > 1 and flat.size else "none"
        dtype = np.dtype(flat.dtype).name
        if how == "nccl" and dtype not in _NCCL_TYPES or how == "mpi" and not mpi_can_reduce(
                dtype):
            how = "host"
        if how == "host":
            host = fam.pinned(flat.size, flat.dtype)               # (n,) pinned
            fam.to_host(flat, host)
            host_allreduce_flat(state, host, op, pre, post)
            fam.to_dev(host, flat)
            return flat
        if pre != 1.0:
            k.scale(flat, pre)
        kind = reduce_kind(op)
        if how == "nccl":
            from cupy.cuda import nccl
            ptr = flat.__cuda_array_interface__["data"][0]
            _nccl_comm(state).allReduce(ptr, ptr, flat.size, getattr(nccl, _NCCL_TYPES[dtype]),
                                   getattr(nccl, _NCCL_OPS[kind]), fam.stream_ptr())
        elif how == "mpi":
            k.synchronize()                                          # MPI reads device memory now
            state.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI_OPS[kind])
        factor = post / size if op is Average else post
        if factor != 1.0:
            k.scale(flat, factor)
        return flat


def _check(x, kind):
    """(wrapped array, family, error string or None) for one device argument; first of all the
    process's GPU is made current on this thread (every device collective starts here)."""
    bind_thread()
    fam = _family(x)
    a = fam.wrap(x)
    if np.dtype(a.dtype) not in DTYPES:
        names = ", ".join(d.name for d in DTYPES)
        return a, fam, f"{kind}: dtype {a.dtype} is not supported; use one of {names}"
    if not fam.contiguous(a):
        return a, fam, f"{kind}: device arrays must be C-contiguous, got shape {a.shape}"
    return a, fam, None


# --- allreduce and grouped allreduce: host.py's, over a device family ----------------------------

def allreduce(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    a, fam, err = _check(x, Kind.ALLREDUCE)
    return host_collectives.allreduce_checked(state, fam, Kind.ALLREDUCE, a, err, op, name,
                                              prescale_factor, postscale_factor)


def allreduce_(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    a, fam, err = _check(x, Kind.ALLREDUCE_)
    host_collectives.allreduce_checked(state, fam, Kind.ALLREDUCE_, a, err, op, name,
                                       prescale_factor, postscale_factor)
    return x


def _grouped(state, kind, xs, in_place, op, name, prescale, postscale, threshold=None):
    xs = list(xs)
    checked = [_check(x, kind) if on_device(x) else
               (x, None, f"{kind}: host and device arrays mixed in one call") for x in xs]
    fams = {c[1].name: c[1] for c in checked if c[1] is not None}
    mixed = f"{kind}: CuPy and Numba device arrays mixed in one call" if len(fams) > 1 else None
    outs = host_collectives.grouped(state, next(iter(fams.values())), kind,
                                    [c[0] for c in checked], [c[2] for c in checked], in_place,
                                    op, name, prescale, postscale, threshold, mixed)
    return xs if in_place else outs


def grouped_allreduce(state, xs, op=Average, name=None, prescale_factor=1.0,
                      postscale_factor=1.0, fusion_threshold_bytes=None):
    return _grouped(state, Kind.GROUPED_ALLREDUCE, xs, False, op, name, prescale_factor,
                    postscale_factor, fusion_threshold_bytes)


def grouped_allreduce_(state, xs, op=Average, name=None, prescale_factor=1.0,
                       postscale_factor=1.0, fusion_threshold_bytes=None):
    return _grouped(state, Kind.GROUPED_ALLREDUCE_, xs, True, op, name, prescale_factor,
                    postscale_factor, fusion_threshold_bytes)


# --- one-off collectives: staged through the host ------------------------------------------------

def _checked(state, x, kind):
    """(wrapped array, family, its kernels) of a device argument; a local error in it is raised
    on every rank (the host call it goes on to would see a fine array)."""
    a, fam, err = _check(x, kind)
    state.agreement(kind.on_device, {}, err)
    return a, fam, fam.kernels


def allgather(state, x, name=None):
    a, _, k = _checked(state, x, Kind.ALLGATHER)
    return k.to_device(host_collectives.allgather(state, k.to_host(a), name=name))


def broadcast(state, x, root_rank, name=None):
    a, _, k = _checked(state, x, Kind.BROADCAST)
    return k.to_device(host_collectives.broadcast(state, k.to_host(a), root_rank, name=name))


def broadcast_(state, x, root_rank, name=None):
    a, fam, _ = _checked(state, x, Kind.BROADCAST_)
    host = fam.pinned(a.size, a.dtype)                             # (n,) pinned
    fam.to_host(fam.flat(a), host)
    host_collectives.broadcast_(state, host.reshape(a.shape), root_rank, name=name)
    fam.to_dev(host, fam.flat(a))
    return x


def reducescatter(state, x, op=Average, name=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    a, _, k = _checked(state, x, Kind.REDUCESCATTER)
    return k.to_device(host_collectives.reducescatter(
        state, k.to_host(a), op=op, name=name, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))


def alltoall(state, x, splits=None, name=None):
    a, _, k = _checked(state, x, Kind.ALLTOALL)
    res = host_collectives.alltoall(state, k.to_host(a), splits=splits, name=name)
    return k.to_device(res) if splits is None else (k.to_device(res[0]), res[1])
