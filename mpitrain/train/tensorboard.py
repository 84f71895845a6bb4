"""TensorBoard event files of the training records (``--tensorboard DIR``), written through the
``tensorboardX`` package: an optional dependency (``pip install -e '.[tensorboard]'``), imported
only when a ``TensorBoard`` is made.

A record is one of the metrics dicts the trainer writes as JSON lines; ``write`` turns its numeric
fields into scalars at the record's ``step``, under a tag named by the record's event::

    {"event": "step", "step": 10, "loss": 2.3, "lr": 1e-3, "grad_norm": 0.8}
        -> train/loss, train/lr, train/grad_norm at step 10
    {"event": "eval", "step": 40, "test_loss": 1.9, "test_accuracy": 0.41}
        -> eval/test_loss, eval/test_accuracy at step 40

Fields that are not real numbers (strings, None, booleans) and ``step`` itself are skipped.
TensorBoard stores scalars as float32. The files are flushed every ``flush_secs`` and on
``close()``; run ``tensorboard --logdir DIR`` to view them.
"""
import importlib.util
import numbers
import os

from mpitrain.runtime.errors import UsageError

INSTALL = "pip install -e '.[tensorboard]'"
PREFIXES = {"step": "train"}      # a record's event -> its tags' prefix (else the event itself)
SKIPPED = ("event", "step")       # fields that are not scalars of their own


def require():
    """Raise UsageError (one line) unless the ``tensorboardX`` package can be imported; call it
    up front, before training, where a missing package should stop the job."""
    if importlib.util.find_spec("tensorboardX") is None:
        raise UsageError(f"TensorBoard event files need the tensorboardX package: {INSTALL}")


class TensorBoard:
    """Scalars into TensorBoard event files in ``logdir`` (created if missing).

    ``scalar(tag, value, step)`` writes one; ``write(record)`` every numeric field of a metrics
    record (see the module docstring); ``close()`` flushes and closes the file (also on leaving
    a ``with`` block). ``flush_secs``: how often the pending events reach the disk.
    """

    def __init__(self, logdir, flush_secs=10):
        require()
        from tensorboardX import SummaryWriter
        self.logdir = os.fspath(logdir)
        self.writer = SummaryWriter(logdir=self.logdir, flush_secs=flush_secs)

    def scalar(self, tag, value, step):
        """Write ``value`` (a real number) under ``tag`` at ``step`` (an integer >= 0)."""
        if self.writer is None:
            raise ValueError(f"TensorBoard({self.logdir!r}) is closed: cannot write {tag!r}")
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"TensorBoard tag {tag!r}: expected a non-empty string")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"TensorBoard scalar {tag!r}: value {value!r} is not a real number")
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"TensorBoard scalar {tag!r}: step {step!r} is not an integer >= 0")
        self.writer.add_scalar(tag, float(value), int(step))

    def write(self, record):
        """Every real-number field of ``record`` as ``<prefix>/<field>`` at ``record["step"]``:
        prefix "train" for a "step" record (or one without "event"), else the event's name.
        Returns the tags written."""
        if "step" not in record:
            raise ValueError(f"TensorBoard record without a 'step': {sorted(record)}")
        event = record.get("event", "step")
        prefix = PREFIXES.get(event, event)
        tags = []
        for key, value in record.items():
            if key in SKIPPED or isinstance(value, bool) or not isinstance(value, numbers.Real):
                continue
            tag = f"{prefix}/{key}"
            self.scalar(tag, value, record["step"])
            tags.append(tag)
        return tags

    def flush(self):
        """Write the pending events to the disk now."""
        if self.writer is not None:
            self.writer.flush()

    def close(self):
        """Flush and close the event file; later calls do nothing."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"TensorBoard({self.logdir!r}{', closed' if self.writer is None else ''})"
