"""torch.distributed's gloo allreduce, timed as benchmarks/allreduce.py times ours: float32 sum,
each call between barriers, the median over iterations of the slowest rank.

    mpiexec -n N python benchmarks/gloo_allreduce.py MASTER_ADDR [--sizes 4K,1M,64M]

Ranks take their rank and size from the MPI launcher's environment (PMI_RANK/PMI_SIZE, or
Open MPI's OMPI_COMM_WORLD_*) and meet at MASTER_ADDR:29500 (GLOO_SOCKET_IFNAME picks the
interface); rank 0 prints one JSON line: {"ranks": N, "results": [{"bytes", "s", "busbw_GBps"}]}.
Needs torch (pip install 'mpitrain[torch]').
"""
import argparse
import json
import os
import sys
import time

import benchutil


def launcher_rank():
    env = os.environ
    for rank, size in (("PMI_RANK", "PMI_SIZE"),
                       ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank in env:
            return int(env[rank]), int(env[size])
    return 0, 1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("master_addr")
    p.add_argument("--port", type=int, default=29500)
    p.add_argument("--sizes", default="4K,64K,1M,16M,64M")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    rank, size = launcher_rank()
    dist.init_process_group("gloo", init_method=f"tcp://{args.master_addr}:{args.port}",
                            rank=rank, world_size=size)
    rows = []
    for nbytes in (benchutil.parse_bytes(s) for s in args.sizes.split(",")):
        x = torch.ones(nbytes // 4)
        dist.all_reduce(x)
        times = []
        for _ in range(args.iters):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(x)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(float(t))
        s = sorted(times)[len(times) // 2]
        bus = 2 * (size - 1) / size if size > 1 else 1.0
        rows.append({"bytes": nbytes, "s": s, "busbw_GBps": nbytes / s / 1e9 * bus})
    if rank == 0:
        print(json.dumps({"ranks": size, "results": rows}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
