"""Device allreduce benchmark: mpitrain's allreduce on GPU buffers next to NCCL and torch.

    [MPITRAIN_DEVICE_COMM=host|mpi|nccl] mpiexec -n 2 python benchmarks/allreduce_device.py
        [--kernels cupy|numba] [--min-bytes 4K] [--max-bytes 256M] [--factor 4]
        [--reference cupy-nccl torch-nccl torch-gloo] [--json PATH]

Our side is ``mt.allreduce_`` (Sum) on a float32 device array, through the transport that
comm/device.py chooses (or MPITRAIN_DEVICE_COMM forces: run the script once per transport). The
references reduce the same kind of buffer in the same run, alternating with ours:
``cupy-nccl`` (cupy.cuda.nccl.NcclCommunicator.allReduce) and ``torch-nccl`` need one rank per
GPU (NCCL refuses two ranks on one device); ``torch-gloo`` (torch.distributed's gloo on CUDA
tensors, which stages through the host) runs when ranks share a GPU too. A reference that cannot
run here is listed in the JSON's "references_skipped" with the reason; a transport forced by
MPITRAIN_DEVICE_COMM that cannot run here writes ``{"skipped": reason}`` and exits 0.

Each call is timed between barriers until the device is idle; reported: the median over
iterations of the slowest rank, algbw = bytes / time, busbw = algbw * 2(N-1)/N. Every size is
checked first against the exact sum; a wrong value prints the size and exits 1. Rank 0 prints
the table and writes JSON.
"""
import argparse
import datetime
import socket
import sys

import numpy as np
from mpi4py import MPI

import benchutil
import mpitrain as mt
from mpitrain.comm import device, world

REFERENCES = ("cupy-nccl", "torch-nccl", "torch-gloo")


def shares_gpu(comm):
    """True when two ranks of this node are bound to the same GPU."""
    ids = world.local_comm().allgather(device.select_device())
    return comm.allreduce(int(len(set(ids)) < len(ids)), op=MPI.MAX) == 1


def cupy_nccl(comm):
    """allreduce(buf) through a raw cupy.cuda.nccl communicator (the NCCL yardstick)."""
    import cupy
    from cupy.cuda import nccl
    uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
    nc = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())

    def allreduce(buf):
        nc.allReduce(buf.data.ptr, buf.data.ptr, buf.size, nccl.NCCL_FLOAT32, nccl.NCCL_SUM,
                     cupy.cuda.get_current_stream().ptr)
    return allreduce


def torch_dist(comm, backend):
    """allreduce(buf) through a torch.distributed group of ``backend`` (the default group is
    gloo, set up once over TCP with rank 0's port) on a zero-copy view of buf."""
    import torch
    import torch.distributed as dist
    if not dist.is_initialized():
        port = None
        if comm.Get_rank() == 0:
            with socket.socket() as s:
                s.bind(("", 0))
                port = s.getsockname()[1]
        one_host = world.local_comm().Get_size() == comm.Get_size()
        host = comm.bcast("127.0.0.1" if one_host else socket.gethostname(), root=0)
        port = comm.bcast(port, root=0)
        torch.cuda.set_device(device.select_device())
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size(),
                                timeout=datetime.timedelta(seconds=120))
    group = dist.new_group(backend=backend)      # one group per reference, same order everywhere
    last = [None, None]                 # (buf, tensor view of buf): the timed loop reuses one buf

    def allreduce(buf):
        if last[0] is not buf:
            last[:] = [buf, torch.as_tensor(buf, device="cuda")]     # shares buf's memory
        dist.all_reduce(last[1], group=group)
    return allreduce


def make_references(comm, k, names, shared):
    """{name: allreduce(buf)} of the references usable here (each tried once on a small buffer),
    and {name: why not}."""
    refs, skipped = {}, {}
    for name in names:
        if name.endswith("nccl") and shared:
            skipped[name] = "ranks share a GPU (NCCL needs one rank per GPU)"
            continue
        try:
            if name == "cupy-nccl":
                refs[name] = cupy_nccl(comm)
            else:
                refs[name] = torch_dist(comm, name.split("-")[1])
            refs[name](k.zeros((4,), np.float32))
            k.synchronize()
        except Exception as exc:  # noqa: BLE001 - a missing reference is reported, not fatal
            refs.pop(name, None)
            skipped[name] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        # a reference is used only if it came up on every rank
        ok = comm.allreduce(int(name in refs), op=MPI.MIN)
        if not ok and name in refs:
            del refs[name]
            skipped[name] = "failed on another rank"
    return refs, skipped


def verify(comm, k, n, fns):
    """Every implementation on integer-valued data against the exact sum; names that failed."""
    size, rank = comm.Get_size(), comm.Get_rank()
    base = (np.arange(n) % 7).astype(np.float32)                   # (n,)
    bad = []
    for name, fn in fns.items():
        buf = k.to_device(base * (rank + 1))
        fn(buf)
        k.synchronize()
        if not np.array_equal(k.to_host(buf), base * (size * (size + 1) / 2)):
            bad.append(name)
    return sorted(set(sum(comm.allgather(bad), [])))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kernels", default="cupy", choices=("cupy", "numba"))
    p.add_argument("--min-bytes", default="4K")
    p.add_argument("--max-bytes", default="256M")
    p.add_argument("--factor", type=int, default=4, help="size step (default x4)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per size and side")
    p.add_argument("--reference", nargs="*", default=list(REFERENCES), choices=REFERENCES)
    p.add_argument("--json", default=None, help="write the results here (rank 0)")
    args = p.parse_args(argv)
    mt.init()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    from mpitrain import kernels
    device.select_device()
    k = kernels.get("cuda", args.kernels)
    shared = shares_gpu(comm)
    try:
        transport = device.transport()          # raises on every rank when a forced one is unusable
    except ValueError as exc:
        if rank == 0:
            print(f"allreduce_device: skipped: {exc}")
            write_json(args.json, {"skipped": str(exc)})
        return 0
    refs, skipped = make_references(comm, k, args.reference, shared)
    sides = {f"mpitrain-{transport}": lambda buf: mt.allreduce_(buf, op=mt.Sum), **refs}
    lo, hi = benchutil.parse_bytes(args.min_bytes), benchutil.parse_bytes(args.max_bytes)
    sizes, s = [], max(4, lo)
    while s <= hi:
        sizes.append(s)
        s *= max(2, args.factor)
    bus = 2 * (size - 1) / size if size > 1 else 1.0
    if rank == 0:
        print(f"# device allreduce float32, N={size}, kernels={args.kernels}, transport="
              f"{transport}, ranks share a GPU: {shared}")
        for name, why in skipped.items():
            print(f"# skipped {name}: {why}")
        print(f"{'size':>10} " + " ".join(f"{n + ' busbw':>22}" for n in sides) + "  (GB/s)")
    results = []
    for nbytes in sizes:
        n = nbytes // 4
        bad = verify(comm, k, n, sides)
        if bad:
            if rank == 0:
                print(f"WRONG RESULT at {nbytes} B from {', '.join(bad)}", file=sys.stderr)
            return 1
        bufs = {name: k.zeros((n,), np.float32) for name in sides}
        times = {name: [] for name in sides}
        order = list(sides)
        for i in range(args.iters + 1):
            for name in (order if i % 2 == 0 else order[::-1]):   # neither always goes first
                t = benchutil.timed(lambda: sides[name](bufs[name]), comm.Barrier, k.synchronize)
                if i:                                               # call 0 warms up
                    times[name].append(t)
        med = benchutil.slowest(comm, *(np.median(times[name]) for name in sides))
        row = {"bytes": nbytes, **{name: {"s": float(t), "algbw_GBps": nbytes / t / 1e9,
                                          "busbw_GBps": nbytes / t / 1e9 * bus}
                                   for name, t in zip(sides, med)}}
        results.append(row)
        if rank == 0:
            print(f"{nbytes:>10} " + " ".join(f"{row[name]['busbw_GBps']:>22.3f}"
                                             for name in sides), flush=True)
    if rank == 0:
        write_json(args.json, {"ranks": size, "kernels": args.kernels, "transport": transport,
                               "shared_gpu": shared, "sides": list(sides),
                               "references_skipped": skipped, "iters": args.iters,
                               "results": results})
    return 0


def write_json(path, doc):
    if path:
        benchutil.write_json(path, doc)
        print(f"# wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
