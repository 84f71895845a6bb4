"""The training side of ``python -m mpitrain`` (the top layer): config.py (Config: every knob of a
job), cli.py (its flags and exit codes), setup.py (``run``: the job assembled on every rank),
loop.py (Trainer: ``fit`` reads top to bottom), plan.py (StepPlan: how a step reads its samples),
progress.py (step, epoch, position, lr), records.py (metrics records, rank 0's files),
checkpoint.py (the one checkpoint format, also ``mt.checkpoint`` for own loops)."""
from mpitrain.train.loop import Trainer
from mpitrain.train.setup import run

__all__ = ["run", "Trainer"]
