"""Faults injected at an exact training step, for the launcher and preemption tests.

``python tests/support/faults.py CLI-FLAGS...`` runs ``python -m mpitrain`` with
``Trainer.train_step`` wrapped: before step ``FAULT_STEP + 1`` (that is, once FAULT_STEP steps
are done), on rank ``FAULT_RANK`` (``all``: every rank; or on every rank of host
``FAULT_HOST``: hydra's PMI_HOSTNAME, or srun's SLURMD_NODENAME), and
only on launch ``FAULT_LAUNCH`` (MPITRAIN_RESTART_COUNT; ``any``: every launch), it does
``FAULT``:

    kill    SIGKILL itself (a crash: no Python cleanup, no MPI_Abort)
    term    SIGTERM itself (a preemption notice), then trains on
    int     SIGINT itself (a ``kill -INT`` of that rank, or Ctrl-C where it hits every rank)
    stall   sleeps FAULT_SLEEP_S (never reaches the step's collective)
    slow    sleeps FAULT_SLEEP_S before this step and every later one (a job that runs long)
    raise   raises RuntimeError (the abort hook ends the job)

``FAULT_TIMES=PATH`` appends ``fail <time>`` when the fault hits and, on rank 0 of a relaunch,
``resumed <time>`` when its first step is done: the restart overhead (docs/launching.md).

Being exact, the tests need no timing: the step a fault hits is the step it was told. Without
FAULT it is ``python -m mpitrain``.
"""
import os
import signal
import sys
import time


def _applies(trainer):
    env = os.environ
    if "FAULT" not in env:
        return False
    step = int(env["FAULT_STEP"])
    if trainer.step != step and not (env["FAULT"] == "slow" and trainer.step > step):
        return False
    launch = env.get("FAULT_LAUNCH", "0")
    if launch != "any" and env.get("MPITRAIN_RESTART_COUNT", "0") != launch:
        return False
    if "FAULT_HOST" in env:
        host = env.get("PMI_HOSTNAME") or env.get("SLURMD_NODENAME")
        return host == env["FAULT_HOST"]
    rank = env.get("FAULT_RANK", "0")
    return rank == "all" or trainer.rank == int(rank)


def _note(what):
    if os.environ.get("FAULT_TIMES"):
        with open(os.environ["FAULT_TIMES"], "a") as f:
            f.write(f"{what} {time.time():.3f}\n")


def main():
    from mpitrain.train import cli, loop

    step_once = loop.Trainer.train_step

    first = [os.environ.get("MPITRAIN_RESTART_COUNT", "0") != "0"]

    def train_step(self, step):
        if _applies(self):
            fault = os.environ["FAULT"]
            _note("fail")
            if fault == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "term":
                os.kill(os.getpid(), signal.SIGTERM)
            elif fault == "int":
                os.kill(os.getpid(), signal.SIGINT)
            elif fault in ("stall", "slow"):
                time.sleep(float(os.environ.get("FAULT_SLEEP_S", "120")))
            elif fault == "raise":
                raise RuntimeError(f"injected fault at step {self.step}")
        result = step_once(self, step)
        if first[0] and self.rank == 0:
            first[0] = False
            _note("resumed")
        return result

    loop.Trainer.train_step = train_step
    cli.main(sys.argv[1:])


if __name__ == "__main__":
    main()
