"""What a job reports: rank 0's output files (``Outputs``) and the numbers of its records
(``Records``: the "step", "eval", "epoch" and "summary" JSON lines, the progress bar, the timing).

Timing: the first ``min(TIMING_WARMUP_STEPS, steps // 2)`` steps of a job (JIT compilation, cold
caches) are excluded from samples_per_sec / step_time_ms / comm_time_ms; evaluation and checkpoint
time are never in them. samples_per_sec is global: all ranks' samples per second of step time;
comm_time_ms is DistributedOptimizer's ``comm_time_s`` per step.
"""
import json
import os
import sys
import threading
import time

import numpy as np

from mpitrain import comm
from mpitrain.runtime.errors import OutputError, one_line
from mpitrain.train.tensorboard import TensorBoard

TIMING_WARMUP_STEPS = 5
LOG_RECORDS_PER_EPOCH = 10


class Outputs:
    """Rank 0's files: the JSON-lines metrics and the --tensorboard events (opened only once the
    job is known to be valid), checkpoints and --save. A write that fails is kept, not raised
    (the other ranks would wait for rank 0 in their next collective), nothing more is written,
    and ``check()`` -- a collective every rank calls at the same point of the loop -- raises it
    as the same OutputError on every rank (and preempt.py's step flags tell every rank at the next step).
    ``attempt(..., background=True)`` (--checkpoint-async) writes on one background thread,
    after the previous background write has finished; ``wait()`` waits for it."""

    def __init__(self, rank):
        self.rank, self.path, self.fd, self.error = rank, None, None, None
        self.writing = None         # the background write in progress (a Thread), or None
        self.board = None           # --tensorboard: its writer (rank 0)

    def open_tensorboard(self, folder):
        """Rank 0: the --tensorboard event files, which get the step and eval records."""
        if folder and self.rank == 0:
            self.board = TensorBoard(folder)

    def open_metrics(self, path, append):
        """Rank 0: start the --metrics-json file (appended to when resuming). A symbolic link
        at the path is replaced by the file, never written through (as checkpoints, --save and
        --timeline, which are renamed over it); a FIFO does not block the open. A failure is
        this job's output error (``check``), not rank 0's alone."""
        if path and self.rank == 0:
            self.path = path
            flags = (os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
                     | (0 if append else os.O_TRUNC))
            try:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                if os.path.islink(path):
                    os.unlink(path)
                self.fd = os.open(path, flags, 0o644)
                os.set_blocking(self.fd, True)
            except OSError as exc:
                self.error = f"cannot write --metrics-json {path}: {exc.strerror or one_line(exc)}"

    def write(self, record):
        """Append one metrics record (rank 0, with --metrics-json)."""
        if self.fd is not None:
            self.attempt("--metrics-json", self.path, lambda: self._append(record))
        if self.board is not None and record.get("event") in ("step", "eval"):
            self.attempt("--tensorboard", self.board.logdir, lambda: self.board.write(record))

    def _append(self, record):
        """One line, whole or not at all: a write cut short (a full disk) is taken back."""
        line = memoryview((json.dumps(record) + "\n").encode())
        end = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while line:
                line = line[os.write(self.fd, line):]
        except OSError:
            os.ftruncate(self.fd, end)
            raise

    def attempt(self, what, path, write, background=False):
        """Rank 0: ``write()``, keeping an OSError as this job's output error; ``background``:
        on a thread of its own, once the previous background write is done."""
        if self.rank != 0:
            return
        if background:
            self.wait()
        if self.error is not None:
            return
        if background:
            self.writing = threading.Thread(target=self._attempt, args=(what, path, write),
                                            name="mpitrain-checkpoint-writer", daemon=True)
            self.writing.start()
        else:
            self._attempt(what, path, write)

    def _attempt(self, what, path, write):
        try:
            write()
        except OSError as exc:
            self.error = f"cannot write {what} {path}: {exc.strerror or one_line(exc)}"

    def wait(self):
        """Rank 0: wait for the background write in progress, if any."""
        if self.writing is not None:
            self.writing.join()
            self.writing = None

    def check(self):
        """Collective: raise rank 0's output error, if any, on every rank."""
        error = comm.broadcast_object(self.error, root_rank=0)
        if error is not None:
            raise OutputError(error)

    def close(self):
        self.wait()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.board is not None:
            self.board.close()
            self.board = None


class Records:
    """The numbers of one job: per-step times, the loss/accuracy sums of the current log interval
    and epoch (the plan's Sums: one allreduce, or micro-shard order), and the records built from
    them. Rank 0 alone shows the bar and prints; every method that sums is collective."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.step_times, self.comm_times = [], []
        self.interval, self.epoch = trainer.plan.sums(), trainer.plan.sums()
        self.interval_start = 0      # index into step_times where the interval began
        self.last_eval = self.last_eval_step = None
        self.bar = None
        # the held-out split's name in records and lines: "test", or "val" for text windows
        self.heldout = "val" if getattr(trainer.test_set, "split", None) == "val" else "test"

    def open_bar(self, show):
        if show:
            from tqdm import tqdm
            t = self.trainer
            self.bar = tqdm(total=t.progress.remaining_steps(), unit="step", dynamic_ncols=True,
                            file=sys.stderr, desc=f"epoch {t.epoch + 1}")

    def close_bar(self):
        if self.bar is not None:
            self.bar.close()

    def add_step(self, seconds, comm_seconds, rows):
        self.step_times.append(seconds)
        self.comm_times.append(comm_seconds)
        self.interval.add(rows)
        self.epoch.add(rows)

    def show(self, loss, accuracy, epoch_end):
        if self.bar is not None:
            t = self.trainer
            samples_s = t.global_batch / max(self.step_times[-1], 1e-9)
            self.bar.set_postfix(loss=f"{loss:.3f}", acc=f"{accuracy:.2f}",
                                 samples_s=f"{samples_s:.0f}", refresh=False)
            self.bar.set_description(f"epoch {t.epoch + (0 if epoch_end else 1)}",
                                     refresh=False)
            self.bar.update(1)

    def log_step(self, metrics):
        t = self.trainer
        samples_s, step_ms, comm_ms = self.timing(first=self.interval_start)
        record = {"event": "step", "step": t.step, "epoch": t.progress.epochs_done(),
                  **_means(self.interval.total()), "lr": t.optimizer.lr,
                  "samples_per_sec": samples_s, "step_time_ms": step_ms, "comm_time_ms": comm_ms}
        if t.optimizer.grad_norm is not None:
            record["grad_norm"] = t.optimizer.grad_norm      # before clipping
        tokens = t.train_set.labels.shape[1:]
        if tokens:
            record["tokens_per_sec"] = samples_s * int(np.prod(tokens))
        metrics.write(record)
        self.interval_start = len(self.step_times)
        t.outputs.check()        # a metrics line that could not be written ends the job

    def log_eval(self, metrics, result):
        t = self.trainer
        self.last_eval, self.last_eval_step = result, t.step
        accuracy, test_loss = result[:2]
        split = self.heldout
        metrics.write({"event": "eval", "step": t.step, "epoch": t.progress.epochs_done(),
                              f"{split}_accuracy": accuracy, f"{split}_loss": test_loss})
        line = f"step {t.step}: {split} accuracy {accuracy:.4f}, {split} loss {test_loss:.4f}"
        if self.bar is not None:
            self.bar.write(line)             # above the bar, which stays at the bottom
        elif t.rank == 0:
            print(line, flush=True)

    def log_epoch(self, metrics):
        t = self.trainer
        record = {"event": "epoch", "epoch": t.epoch, "step": t.step,
                  **_means(self.epoch.total())}
        if self.last_eval_step == t.step:
            record.update({f"{self.heldout}_accuracy": self.last_eval[0],
                           f"{self.heldout}_loss": self.last_eval[1]})
        metrics.write(record)

    def summary(self, metrics, first_step, wall):
        """The summary record (the same dict on every rank) and rank 0's last line."""
        t, config = self.trainer, self.trainer.config
        accuracy, test_loss, correct, total = self.last_eval
        samples_s, step_ms, comm_ms = self.timing()
        split = self.heldout       # test_samples: labels scored (tokens, for text windows)
        summary = {"event": "summary", f"{split}_accuracy": accuracy, f"{split}_loss": test_loss,
                   f"{split}_correct": correct, f"{split}_samples": total,
                   "samples_per_sec": samples_s, "step_time_ms": step_ms, "comm_time_ms": comm_ms,
                   "comm_share": comm_ms / step_ms if step_ms else 0.0,
                   "ranks": t.size, "steps": t.step, "steps_run": t.step - first_step,
                   "epoch": t.progress.epochs_done(), "global_batch": t.global_batch,
                   "model": config.model, "dataset": config.dataset, "average": config.average,
                   "wall_time_s": time.perf_counter() - wall}
        metrics.write(summary)
        if t.rank == 0:
            print(f"{split} accuracy: {accuracy:.4f} ({correct}/{total}), {split} loss "
                  f"{test_loss:.4f}; "
                  f"{t.step} steps, {samples_s:.0f} samples/s over {t.size} rank(s), "
                  f"step {step_ms:.1f} ms, comm {comm_ms:.1f} ms", flush=True)
        return summary

    def timing(self, first=None):
        """(samples/s global, step ms, comm ms), averaged over ranks, over this job's steps from
        index ``first`` (a log interval) or, by default, all but the warm-up steps."""
        if first is None:
            first = min(TIMING_WARMUP_STEPS, len(self.step_times) // 2)
        elif len(self.step_times) > TIMING_WARMUP_STEPS:
            first = max(first, TIMING_WARMUP_STEPS)  # an interval never counts warm-up steps
        times, comms = self.step_times[first:], self.comm_times[first:]
        n = len(times)
        local = np.array([sum(times), sum(comms)], np.float64)
        total_s, comm_s = comm.allreduce(local, op=comm.Average)
        if n <= 0 or total_s <= 0:
            return 0.0, 0.0, 0.0
        return n * self.trainer.global_batch / total_s, 1e3 * total_s / n, 1e3 * comm_s / n


def _means(sums):
    """The records' "loss" and "accuracy" from (loss sum, correct, samples) over every rank."""
    return {"loss": sums[0] / sums[2], "accuracy": sums[1] / sums[2]}
