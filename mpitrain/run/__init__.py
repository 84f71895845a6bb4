"""``mpitrainrun`` / ``python -m mpitrain.run``: start a job through the MPI launcher that is
there (MPICH's mpiexec, Open MPI's mpirun, Slurm's srun) and keep it alive -- restart on
failure from the newest valid checkpoint, host discovery and blacklisting, between --min-np and
--max-np ranks, preemption passed on to the ranks (docs/launching.md).

hosts.py (-H, --hostfile, discovery, the blacklist), engines.py (each launcher's command line
and failure report), supervisor.py (the restart loop), cli.py (the flags). It starts no MPI of
its own: the ranks do.
"""
from mpitrain.run.cli import main

__all__ = ["main"]
