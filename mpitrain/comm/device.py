"""Collectives on device buffers (CuPy arrays, Numba device arrays), and GPU selection.

collectives.py hands every array exposing ``__cuda_array_interface__`` (or a Numba device array,
which under NUMBA_ENABLE_CUDASIM=1 is a simulated one) to the functions here, which have the same
names and signatures as the host API. Arguments are validated and agreed across ranks exactly as
on the host (check.py's agreement), so a mismatch is a CollectiveError on every rank, never a hang.

GPU selection: ``select_device()`` binds the process to GPU ``local_rank % device_count``; the
training loop calls it before it allocates anything (a CUDA context created on the wrong GPU
cannot be moved). CuPy and Numba keep the current GPU per thread, and a new thread starts on GPU
0: a device collective may run on the comm thread (queued behind non-blocking collectives in
flight, handles.ordered), so every device collective first binds the process's GPU on the thread
that runs it (once per thread).

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
of grouped_allreduce lives on the device: its plan follows fusion.py's rules (by dtype in order of
first appearance, packed in input order up to MPITRAIN_FUSION_THRESHOLD bytes) so it is identical
on every rank and reruns are bitwise identical. The one-off collectives (broadcast, allgather,
reducescatter, alltoall: parameter broadcast at start, metrics) stage through the host (host.py).
The chosen GPU lives in the global World (``world.current().device``: one per process); the
transport, NCCL communicator and device fusion buffer in the World each collective is given as
``state`` (the global set's or a process set's, resolved by collectives.py), so
``mt.shutdown()`` and ``mt.remove_process_set`` forget them.

Array families: the only place in the package that branches on the array type is ``_family``;
everything else goes through a family's kernels module (mpitrain.kernels.cuda_cupy or
cuda_numba) and its three copy/pinned helpers.
"""
import ctypes
import importlib.util
import os
import re
import socket
import sys
import threading

import numpy as np
from mpi4py import MPI

from mpitrain.comm import host as host_collectives
from mpitrain.comm import world
from mpitrain.comm.build_info import cuda_built, device_count, nccl_built
from mpitrain.comm.engine import allreduce_flat as host_allreduce_flat
from mpitrain.comm.fusion import FusionBuffer
from mpitrain.comm.kinds import Kind
from mpitrain.comm.ops import (DTYPES, MPI_OPS, Average, first_error, integer_average,
                               integer_average_error, on_device, reduce_args, reduce_kind)
from mpitrain.comm.settings import DEVICE_TRANSPORTS as TRANSPORTS


# --- array families -----------------------------------------------------------------------------

class _Family:
    """What the device collectives need of one array family: its kernels module (copy, scale,
    empty, to_host, to_device, synchronize) and the helpers below."""

    def __init__(self, kernels, new_pinned):
        self.kernels = kernels
        self._new_pinned = new_pinned           # (n, dtype) -> a pinned host array
        self._pinned = {}

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


# --- GPU selection ------------------------------------------------------------------------------

def select_device(local_rank=None, flavour=None):
    """Bind this process to GPU ``local_rank % device_count()`` (idempotent); returns its id.

    Call before any device allocation. local_rank defaults to mpitrain's local rank. flavour
    "numba" (``--kernels numba``) binds Numba only and never imports CuPy; otherwise CuPy too,
    when it is installed.
    """
    state = world.current().device                  # the process's GPU: the global World's
    if state.get("device") is not None:
        return state["device"]
    count = device_count()
    if count < 1:
        raise RuntimeError("--device cuda: no CUDA device is visible (device_count() == 0)")
    rank = world.local_rank() if local_rank is None else int(local_rank)
    dev = rank % count
    cupy = None
    if flavour != "numba" and ("cupy" in sys.modules
                               or importlib.util.find_spec("cupy") is not None):
        import cupy
    _make_current(dev, cupy)
    state["device"] = dev
    return dev


_this_thread = threading.local()     # .device: the GPU made current on this thread


def _bind_thread():
    """Make the process's GPU (select_device's) current on the calling thread, once per thread:
    CuPy and Numba keep it per thread, and a thread that never chose one (the comm thread) runs
    on GPU 0. CuPy is bound only if loaded (select_device loads it unless the flavour is numba)."""
    dev = world.current().device.get("device")
    if dev is not None and getattr(_this_thread, "device", None) != dev:
        _make_current(dev, sys.modules.get("cupy"))


def _make_current(dev, cupy):
    """GPU ``dev`` current on the calling thread for Numba and, unless ``cupy`` is None, CuPy."""
    if cupy is not None:
        cupy.cuda.Device(dev).use()
    from numba import cuda
    if cuda.is_available():
        cuda.select_device(dev)
    _this_thread.device = dev


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
    k = fam.kernels
    size = state.comm.Get_size()
    how = transport(state) if size > 1 and flat.size else "none"
    dtype = np.dtype(flat.dtype).name
    if how == "nccl" and dtype not in _NCCL_TYPES or how == "mpi" and dtype == "float16":
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


def _flat(a):
    return a if a.ndim == 1 else a.reshape(a.size)


def _check(x, kind):
    """(wrapped array, family, error string or None) for one device argument; first of all the
    process's GPU is made current on this thread (every device collective starts here)."""
    _bind_thread()
    fam = _family(x)
    a = fam.wrap(x)
    if np.dtype(a.dtype) not in DTYPES:
        names = ", ".join(d.name for d in DTYPES)
        return a, fam, f"{kind}: dtype {a.dtype} is not supported; use one of {names}"
    if not fam.contiguous(a):
        return a, fam, f"{kind}: device arrays must be C-contiguous, got shape {a.shape}"
    return a, fam, None


def _copy_of(fam, a):
    out = fam.kernels.empty(a.shape, a.dtype)
    fam.kernels.copy(out, a)
    return out


# --- allreduce ----------------------------------------------------------------------------------

def allreduce(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    a, fam, err = _check(x, Kind.ALLREDUCE)
    if err is None and integer_average(a.dtype, op):
        # a float64 mean, as on the host, and through it (integer averages are small metrics)
        return fam.kernels.to_device(host_collectives.allreduce(
            state, fam.kernels.to_host(a), op=op, name=name, prescale_factor=prescale_factor,
            postscale_factor=postscale_factor))
    out = _copy_of(fam, a) if err is None else a
    return _allreduce_checked(state, Kind.ALLREDUCE, fam, out, err, op, name, prescale_factor,
                              postscale_factor)


def allreduce_(state, x, op=Average, name=None, prescale_factor=1.0, postscale_factor=1.0):
    a, fam, err = _check(x, Kind.ALLREDUCE_)
    if err is None and integer_average(a.dtype, op):
        err = integer_average_error(Kind.ALLREDUCE_, a.dtype)
    _allreduce_checked(state, Kind.ALLREDUCE_, fam, a, err, op, name, prescale_factor,
                       postscale_factor)
    return x


def _allreduce_checked(state, kind, fam, a, err, op, name, prescale, postscale):
    op, pre, post, fields, err2 = reduce_args(kind, op, prescale, postscale)
    fields.update(name=name, shape=tuple(a.shape), dtype=np.dtype(a.dtype).str, device=True)
    state.agreement(Kind.ALLREDUCE, fields, err or err2)
    _allreduce_flat(state, fam, _flat(a), op, pre, post)
    return a


# --- grouped allreduce through the device fusion buffer ------------------------------------------

class DeviceFusionBuffer(FusionBuffer):
    """fusion.FusionBuffer's plan with its flat buffers on the device (one per dtype)."""

    def __init__(self, fam, threshold_bytes):
        super().__init__(threshold_bytes, empty=fam.kernels.empty)
        self.fam = fam

    def allreduce(self, arrays, outs, reduce_flat):
        k = self.fam.kernels
        for bucket in self.plan(arrays):
            if len(bucket.entries) == 1:
                i = bucket.entries[0][0]
                if outs[i] is not arrays[i]:
                    k.copy(outs[i], arrays[i])
                reduce_flat(_flat(outs[i]))
                continue
            flat = self._buffers[bucket.dtype][:bucket.total]            # (total,) on device
            for i, off, n in bucket.entries:
                k.copy(flat[off:off + n], arrays[i])
            reduce_flat(flat)
            for i, off, n in bucket.entries:
                k.copy(outs[i], flat[off:off + n])
        return outs


def _grouped(state, kind, xs, in_place, op, name, prescale, postscale, threshold=None):
    xs = list(xs)
    checked = [_check(x, kind) if on_device(x) else
               (x, None, f"{kind}: host and device arrays mixed in one call") for x in xs]
    arrays = [c[0] for c in checked]
    fams = {c[1].name: c[1] for c in checked if c[1] is not None}
    errors = [c[2] for c in checked]
    errors += [f"{kind}: the Average of {np.dtype(a.dtype).name} device arrays is not an "
               f"integer; use mt.allreduce per array (a float64 mean) or op=mt.Sum"
               for a, fam, e in checked
               if fam is not None and e is None and integer_average(a.dtype, op)]
    if len(fams) > 1:
        errors.append(f"{kind}: CuPy and Numba device arrays mixed in one call")
    op, pre, post, fields, err = reduce_args(kind, op, prescale, postscale)
    try:  # a bad threshold on one rank must reach the agreement, not leave the others waiting
        threshold, threshold_err = host_collectives.fusion_threshold(state, threshold), None
    except ValueError as exc:
        threshold, threshold_err = None, str(exc)
    fields.update(name=name, threshold_bytes=threshold,
                  arrays=tuple((tuple(a.shape), np.dtype(a.dtype).str) for a in arrays),
                  device=True)        # moved by the device's transport (kinds.py)
    state.agreement(Kind.GROUPED_ALLREDUCE, fields, first_error(err, threshold_err, *errors))
    if not arrays:
        return []
    fam = next(iter(fams.values()))
    fusion = state.device.get("fusion")
    if fusion is None or fusion.fam is not fam or fusion.threshold_bytes != threshold:
        fusion = state.device["fusion"] = DeviceFusionBuffer(fam, threshold)
    outs = arrays if in_place else [fam.kernels.empty(a.shape, a.dtype) for a in arrays]
    fusion.allreduce(arrays, outs, lambda flat: _allreduce_flat(state, fam, flat, op, pre, post))
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
    """(wrapped array, family) of a device argument; a local error in it is raised on every rank
    (the host call it goes on to would see a fine array)."""
    a, fam, err = _check(x, kind)
    state.agreement(kind.on_device, {}, err)
    return a, fam


def _down(state, x, kind):
    """``_checked``, then a host copy of the array."""
    a, fam = _checked(state, x, kind)
    return fam.kernels.to_host(a), fam


def allgather(state, x, name=None):
    host, fam = _down(state, x, Kind.ALLGATHER)
    return fam.kernels.to_device(host_collectives.allgather(state, host, name=name))


def broadcast(state, x, root_rank, name=None):
    host, fam = _down(state, x, Kind.BROADCAST)
    return fam.kernels.to_device(host_collectives.broadcast(state, host, root_rank, name=name))


def broadcast_(state, x, root_rank, name=None):
    a, fam = _checked(state, x, Kind.BROADCAST_)
    host = fam.pinned(a.size, a.dtype)                             # (n,) pinned
    fam.to_host(_flat(a), host)
    host_collectives.broadcast_(state, host.reshape(a.shape), root_rank, name=name)
    fam.to_dev(host, _flat(a))
    return x


def reducescatter(state, x, op=Average, name=None, prescale_factor=1.0,
                  postscale_factor=1.0):
    host, fam = _down(state, x, Kind.REDUCESCATTER)
    return fam.kernels.to_device(host_collectives.reducescatter(
        state, host, op=op, name=name, prescale_factor=prescale_factor,
        postscale_factor=postscale_factor))


def alltoall(state, x, splits=None, name=None):
    host, fam = _down(state, x, Kind.ALLTOALL)
    res = host_collectives.alltoall(state, host, splits=splits, name=name)
    if splits is None:
        return fam.kernels.to_device(res)
    return fam.kernels.to_device(res[0]), res[1]
