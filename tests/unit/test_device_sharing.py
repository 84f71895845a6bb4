"""Whether ranks share a GPU (NCCL refuses two ranks on one device): device.py compares each
rank's (host, PCI address), never the ordinal. The GPUs are stubs (a fake CuPy, a fake Numba
device list), so no GPU is needed."""
import socket
import sys
import types

import pytest
from numba import cuda

from mpitrain.comm import device


def _fake_cupy(bus_ids):
    """A CuPy whose GPU ``i`` has the PCI bus id ``bus_ids[i]`` (CuPy's spelling)."""
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        Device=lambda i: types.SimpleNamespace(pci_bus_id=bus_ids[i])))


def _on(monkeypatch, host, ordinal, bus_id):
    """This process on ``host``, its GPU ``ordinal`` at ``bus_id``."""
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({ordinal: bus_id}))
    monkeypatch.setattr(device, "_current_device", lambda: ordinal)


class _Comm:
    """Rank 0's communicator: ``others`` are what the other ranks contribute to an allgather
    (None: as many as this rank, each a copy of what it sends); ``sent`` what this rank sent."""

    def __init__(self, others=None):
        self.others, self.sent = others, None

    def allgather(self, mine):
        self.sent = mine
        return [mine] + (self.others if self.others is not None else [mine])

    def Allreduce(self, sendbuf, recvbuf, op):       # noqa: N802 - every rank agrees
        pass

    def Get_rank(self):                              # noqa: N802
        return 0


def _choose(monkeypatch, where, comm, local, forced="auto"):
    """device.transport of a fresh World on ``where`` (host, ordinal, bus id); NCCL usable,
    CUDA-aware MPI not."""
    _on(monkeypatch, *where)
    monkeypatch.setattr(device, "_nccl_ok", lambda: True)
    monkeypatch.setattr(device, "cuda_aware_mpi", lambda: False)
    state = types.SimpleNamespace(device={}, comm=comm, local=local,
                                  settings=types.SimpleNamespace(device_comm=forced))
    return device.transport(state)


def _transport(monkeypatch, me, other, one_node=True, forced="auto"):
    """The transport rank 0 (on ``me``) chooses beside a second rank (on ``other``). one_node:
    the World's node communicator holds both ranks (not with MPITRAIN_NODE_SIZE=1)."""
    comm, local = _Comm(), _Comm()
    _choose(monkeypatch, other, comm, local)             # what the second rank contributes
    return _choose(monkeypatch, me, _Comm([comm.sent]),
                   _Comm([local.sent] if one_node else []), forced)


def test_different_ordinals_on_one_bus_share_a_gpu(monkeypatch):
    # MPITRAIN_NODE_SIZE=1 on one host: each rank alone on its emulated node, one GPU
    me, other = ("node-a", 0, "0000:3B:00.0"), ("node-a", 1, "0000:3b:00.0")
    assert _transport(monkeypatch, me, other, one_node=False) == "host"
    with pytest.raises(ValueError, match="share a GPU"):
        _transport(monkeypatch, me, other, one_node=False, forced="nccl")


def test_the_same_ordinal_on_different_buses_is_not_shared(monkeypatch):
    # a per-rank CUDA_VISIBLE_DEVICES: every rank's GPU is its GPU 0
    me, other = ("node-a", 0, "0000:3B:00.0"), ("node-a", 0, "0000:5E:00.0")
    assert _transport(monkeypatch, me, other) == "nccl"


def test_the_same_bus_on_different_hosts_is_not_shared(monkeypatch):
    me, other = ("node-a", 0, "0000:3B:00.0"), ("node-b", 0, "0000:3B:00.0")
    assert _transport(monkeypatch, me, other, one_node=False) == "nccl"


def test_numba_names_a_gpu_as_cupy_does(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setitem(sys.modules, "cupy", None)                # the Numba flavour: no CuPy
    gpu = types.SimpleNamespace(get_device_identity=lambda: {
        "pci_domain_id": 0, "pci_bus_id": 0x3B, "pci_device_id": 0})
    monkeypatch.setattr(cuda, "gpus", [gpu])
    numba_id = device._gpu_identity(0)
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy({0: "0000:3B:00.0"}))
    assert numba_id == device._gpu_identity(0) == ("node-a", "0000:3b:00")


def test_without_a_pci_address_the_uuid_then_the_ordinal(monkeypatch):
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setitem(sys.modules, "cupy", None)
    simulated = types.SimpleNamespace(device=types.SimpleNamespace(uuid="GPU-1234"))
    monkeypatch.setattr(cuda, "gpus", [simulated])                # the simulator's device list
    assert device._gpu_identity(0) == ("node-a", "GPU-1234")
    monkeypatch.setattr(cuda, "gpus", [])                         # no CUDA driver
    assert device._gpu_identity(0) == ("node-a", "ordinal 0")
    assert device._gpu_identity(-1) == ("node-a", "ordinal -1")    # no GPU chosen
