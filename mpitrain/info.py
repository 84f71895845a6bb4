"""``python -m mpitrain.info [--json]`` (or ``mpitrainrun --check-build``): what this
installation has, on one screen.

    mpitrain 0.1.0, its Python, NumPy and Numba; the MPI library, its standard, the thread
    level MPI gave and the ranks and hosts of this job; what the comm layer can use (its build
    booleans, comm/build_info.py); the kernel backends and the GPUs they see; the front ends
    that are installed; every declared MPITRAIN_* variable that is set (runtime/env.py).

Every rank takes part in one allgather of its host name; rank 0 alone prints. Nothing here
initialises the mpitrain World (``mt.init``): a bad setting is then shown, not raised, and a
job that cannot agree still gets its report. Every probe of an optional package is guarded:
what fails to import or to answer is "not available", never a traceback. TensorFlow and Keras
are looked up, not imported (slow); versions come from the installed package metadata.
"""
import argparse
import importlib.metadata
import importlib.util
import json
import socket
import sys

import mpi4py
import numba
import numpy as np
from mpi4py import MPI

import mpitrain
from mpitrain import comm, kernels
from mpitrain.runtime import env
# The training CLI reads every MPITRAIN_* variable there is (its flags', the comm layer's, the
# data's, the thread budget's); importing it declares them all, so env.snapshot() has each.
from mpitrain.train import cli as training_cli  # noqa: F401

THREAD_LEVELS = {MPI.THREAD_SINGLE: "MPI_THREAD_SINGLE", MPI.THREAD_FUNNELED: "MPI_THREAD_FUNNELED",
                 MPI.THREAD_SERIALIZED: "MPI_THREAD_SERIALIZED",
                 MPI.THREAD_MULTIPLE: "MPI_THREAD_MULTIPLE"}
FRONT_ENDS = ("torch", "tensorflow", "keras")


def hosts_of_job(world=None):
    """[(host, ranks on it)] in rank order of first appearance: one allgather, on every rank."""
    world = MPI.COMM_WORLD if world is None else world
    counts = {}
    for host in world.allgather(socket.gethostname()):
        counts[host] = counts.get(host, 0) + 1
    return list(counts.items())


def describe_job(hosts):
    """``"4 ranks on 2 hosts: a (2), b (2)"`` from ``[(host, ranks)]``."""
    ranks = sum(n for _, n in hosts)
    listed = ", ".join(f"{host} ({n})" for host, n in hosts)
    return (f"{ranks} rank{'s' if ranks != 1 else ''} on {len(hosts)} "
            f"host{'s' if len(hosts) != 1 else ''}: {listed}")


def _guarded(probe, default=None):
    """``probe()``, or ``default`` when it raises anything at all."""
    try:
        return probe()
    except Exception:  # noqa: BLE001 - an optional package that fails to answer: not available
        return default


def _version(distribution):
    """The installed version of ``distribution``, or None."""
    return _guarded(lambda: importlib.metadata.version(distribution))


def _numba_cuda():
    """{"available": bool, "devices": int, "simulator": bool} of numba.cuda."""
    def probe():
        from numba import cuda
        available = bool(cuda.is_available())
        return {"available": available, "devices": len(cuda.gpus) if available else 0,
                "simulator": bool(numba.config.ENABLE_CUDASIM)}
    return _guarded(probe, {"available": False, "devices": 0, "simulator": False})


def _cupy():
    """{"installed": bool, "version": str | None, "devices": int} of CuPy."""
    if _guarded(lambda: importlib.util.find_spec("cupy")) is None:
        return {"installed": False, "version": None, "devices": 0}

    def probe():
        import cupy
        return {"installed": True, "version": cupy.__version__,
                "devices": int(cupy.cuda.runtime.getDeviceCount())}
    return _guarded(probe, {"installed": True, "version": _version("cupy"), "devices": 0})


def _cpu_kernels():
    """{"available", "kernels" (of the contract's, "contract"), "numba_threads"} of the CPU
    backend (numba.njit kernels)."""
    def probe():
        module = kernels.get("cpu", "numba")
        return {"available": True, "kernels": sum(hasattr(module, k)
                                                  for k in kernels.contract.KERNELS),
                "contract": len(kernels.contract.KERNELS),
                "numba_threads": int(numba.config.NUMBA_NUM_THREADS)}
    return _guarded(probe, {"available": False, "kernels": 0,
                            "contract": len(kernels.contract.KERNELS), "numba_threads": 0})


def _front_ends():
    """name -> its installed version (None when not installed), found without importing it."""
    found = {}
    for name in FRONT_ENDS:
        spec = _guarded(lambda: importlib.util.find_spec(name))
        found[name] = (_version(name) or "installed") if spec is not None else None
    return found


def report(hosts):
    """The whole report as a dict (what ``--json`` prints); ``hosts`` from hosts_of_job."""
    level = MPI.Query_thread()
    numba_cuda, cupy = _numba_cuda(), _cupy()
    counts = {n for _, n in hosts}
    return {
        "mpitrain": mpitrain.__version__,
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "numpy": np.__version__,
        "numba": numba.__version__,
        "mpi": {
            "mpi4py": mpi4py.__version__,
            "library": " ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
            "standard": "%d.%d" % MPI.Get_version(),
            "thread_level": THREAD_LEVELS.get(level, str(level)),
            "ranks": sum(n for _, n in hosts),
            "hosts": dict(hosts),
            "job": describe_job(hosts),
        },
        # comm/build_info.py's booleans; the two that would initialise the World (mt.init) are
        # answered from what this report already has: the thread level and the host counts.
        "comm": {
            "mpi_built": _guarded(comm.mpi_built, False),
            "mpi_threads_supported": level == MPI.THREAD_MULTIPLE,
            "nccl_built": _guarded(comm.nccl_built, False),
            "cuda_built": _guarded(comm.cuda_built, False),
            "is_homogeneous": len(counts) == 1,
        },
        "kernels": {
            "cpu/numba": _cpu_kernels(),
            "cuda/numba": {"available": numba_cuda["available"]},
            "cuda/cupy": {"available": cupy["devices"] > 0},
        },
        "gpu": {"numba.cuda": numba_cuda, "cupy": cupy},
        "front_ends": _front_ends(),
        "settings": {name: value for name, value in env.snapshot().items() if value is not None},
        "unknown_settings": env.unknown(),
    }


def _yes(value):
    return "yes" if value else "no"


def format_report(info):
    """The report as lines of text, one screen."""
    mpi, comm_layer, gpu = info["mpi"], info["comm"], info["gpu"]
    cpu = info["kernels"]["cpu/numba"]
    numba_cuda, cupy = gpu["numba.cuda"], gpu["cupy"]
    lines = [
        f"mpitrain {info['mpitrain']}",
        f"  Python            {info['python']} ({info['python_executable']})",
        f"  NumPy             {info['numpy']}",
        f"  Numba             {info['numba']}",
        "MPI",
        f"  mpi4py            {mpi['mpi4py']}",
        f"  MPI library       {mpi['library']}",
        f"  MPI standard      {mpi['standard']}",
        f"  thread level      {mpi['thread_level']}",
        f"  job               {mpi['job']}",
        "Comm layer",
    ]
    lines += [f"  {name:<22}{_yes(value)}" for name, value in comm_layer.items()]
    lines += [
        "Kernels",
        f"  cpu/numba         {_yes(cpu['available'])}"
        + (f" ({cpu['kernels']} of {cpu['contract']} kernels, {cpu['numba_threads']} Numba threads)"
           if cpu["available"] else ""),
        f"  cuda/numba        {_yes(numba_cuda['available'])}"
        + (f" ({numba_cuda['devices']} device(s)"
           + (", simulator)" if numba_cuda["simulator"] else ")")
           if numba_cuda["available"] else ""),
        f"  cuda/cupy         "
        + (f"{_yes(cupy['devices'] > 0)} (CuPy {cupy['version']}, {cupy['devices']} device(s))"
           if cupy["installed"] else "no (CuPy not installed)"),
        "Front ends",
    ]
    lines += [f"  {name:<18}{version or 'not installed'}"
              for name, version in info["front_ends"].items()]
    lines.append("MPITRAIN_* settings")
    lines += [f"  {name}={value}" for name, value in info["settings"].items()] or ["  (none set)"]
    lines += [f"  {line}" for line in info["unknown_settings"]]
    return lines


def main(argv=None):
    """Every rank: the allgather; rank 0: print the report. Returns 0."""
    parser = argparse.ArgumentParser(prog="python -m mpitrain.info",
                                     description="What this mpitrain installation has.")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    hosts = hosts_of_job()
    if MPI.COMM_WORLD.Get_rank() == 0:
        info = report(hosts)
        print(json.dumps(info, indent=1) if args.json else "\n".join(format_report(info)),
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
