"""The process's GPU: chosen once, and current on every thread that runs a device collective.

``select_device()`` binds the process to GPU ``local_rank % device_count``; the training loop
calls it before it allocates anything (a CUDA context created on the wrong GPU cannot be moved).
CuPy and Numba keep the current GPU per thread, and a new thread starts on GPU 0: a device
collective may run on the comm thread (queued behind non-blocking collectives in flight,
handles.ordered), so every device collective (device.py) first binds the process's GPU on the
thread that runs it (``bind_thread``, once per thread). The chosen GPU lives in the global World
(``world.current().device["device"]``: one per process).
"""
import importlib.util
import sys
import threading

from mpitrain.comm import world
from mpitrain.comm.build_info import device_count


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


def bind_thread():
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
