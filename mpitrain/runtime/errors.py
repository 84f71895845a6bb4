"""Every exception type mpitrain raises of its own, in one place (the runtime layer: any layer may
raise them). Each says what the user sees: the CLI prints one line and exits 2 for the ValueErrors
(bad input), 1 for OutputError; CollectiveError is raised on every rank."""


class UsageError(ValueError):
    """Bad input from the user (flag, env var, checkpoint): one line, exit code 2, no traceback."""


class CheckpointError(UsageError):
    """A checkpoint that cannot be used: unreadable, corrupt, or written by another model."""


class DataError(ValueError):
    """Missing, corrupt or mismatched data: one line naming the file/dir and what is wrong."""


class FetchOffline(DataError):
    """No source of a file could be reached (no network, host down, HTTP error)."""


class CollectiveError(RuntimeError):
    """Ranks called a collective with arguments that do not match; raised on every rank."""


class OutputError(RuntimeError):
    """A file the job writes could not be written (a full disk, a vanished folder): one line and
    exit code 1; what was written before is intact (checkpoints and --save are atomic)."""


class Interrupted(Exception):
    """Ctrl-C (SIGINT) during a run: where it stopped, and what a --resume would continue.
    ``agreed``: every rank raised it after the same step (so they may wait for rank 0's line)."""

    def __init__(self, step, checkpoint_step, folder, agreed=False):
        super().__init__(step, checkpoint_step, folder)
        self.step, self.checkpoint_step, self.folder = step, checkpoint_step, folder
        self.agreed = agreed

    def __str__(self):
        if self.step is None:
            return "interrupted while starting, before the first step"
        if self.checkpoint_step is None:
            return f"interrupted at step {self.step}; no checkpoint was written"
        return (f"interrupted at step {self.step}; the last checkpoint is step "
                f"{self.checkpoint_step} in {self.folder} (--resume continues from it)")


class Preempted(Exception):
    """A stop signal (SIGTERM, ...) reached a rank: every rank stopped after the same step, with
    a checkpoint where there is a checkpoint folder. ``signal``: the signal's name."""

    def __init__(self, signal, step, checkpoint_step, folder):
        super().__init__(signal, step, checkpoint_step, folder)
        self.signal, self.step = signal, step
        self.checkpoint_step, self.folder = checkpoint_step, folder

    def __str__(self):
        where = (f"the checkpoint of step {self.checkpoint_step} is in {self.folder} (--resume "
                 f"continues from it)" if self.checkpoint_step is not None
                 else "no checkpoint was written (no --checkpoint-dir)")
        return f"preempted ({self.signal}) after step {self.step}; {where}"


def one_line(exc):
    """An exception's text on one line (its type's name when it has none), for the one-line
    errors above."""
    return " ".join(str(exc).split()) or type(exc).__name__
