"""The fused average of a list of gradients, and DistributedGradientTape (horovod.tensorflow's).

``reduce_gradients`` sends every gradient of a call in one host round trip: one
``grouped_allreduce`` (one fusion buffer per dtype), eagerly or as one node of a tf.function,
never one collective per variable. ``None`` gradients stay None and are not sent (every rank
must have the same ones: where they differ the call is a CollectiveError on every rank, not a
hang); ``tf.IndexedSlices`` are made dense first (``sparse_as_dense`` is accepted and has no
other effect: Horovod's allgather of sparse gradients is not offered).
"""
import tensorflow as tf

from mpitrain import comm
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.ops import (Average, Problem, Sum, global_process_set,
                                     grouped_allreduce, refuse)


def scale_factors(op, gradient_predivide_factor, process_set, who):
    """(op, prescale, postscale) for Horovod's ``gradient_predivide_factor``: the gradients
    are divided by the factor before the sum and by N / factor after it."""
    factor = float(gradient_predivide_factor)
    if factor != 1.0 and op is not Average:
        refuse("grouped_allreduce", Problem(ValueError, f"{who}: gradient_predivide_factor "
                                                        f"needs op=Average"), process_set)
    if factor == 1.0:
        return op, 1.0, 1.0
    return Average, 1.0 / factor, factor


def reduce_gradients(grads, compression=Compression.none, op=Average,
                     gradient_predivide_factor=1.0, process_set=global_process_set,
                     name=None, who="DistributedGradientTape"):
    """The list ``grads`` averaged (``op``) over the set in one fused host call; None
    entries stay None, IndexedSlices come back dense."""
    grads = list(grads)
    where = [i for i, g in enumerate(grads) if g is not None]
    if not where:
        if tf.executing_eagerly():          # meets a rank that has gradients: an error there
            comm.agree(process_set, "grouped_allreduce", {"name": name, "empty": True},
                       who=f"mpitrain.tensorflow.{who}")
        return grads
    op, pre, post = scale_factors(op, gradient_predivide_factor, process_set, who)
    reduced = grouped_allreduce([tf.convert_to_tensor(grads[i]) for i in where],
                                compression=compression, op=op, prescale_factor=pre,
                                postscale_factor=post, process_set=process_set, name=name)
    out = list(grads)
    for i, r in zip(where, reduced):
        out[i] = r
    return out


class _DistributedGradientTape(tf.GradientTape):
    """tf.GradientTape whose ``gradient`` returns the average over the ranks."""

    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=tf.UnconnectedGradients.NONE):
        grads = super().gradient(target, sources, output_gradients, unconnected_gradients)
        flat = tf.nest.flatten(grads, expand_composites=False)
        s = self._mpitrain
        reduced = reduce_gradients(flat, s["compression"], s["op"],
                                   s["gradient_predivide_factor"], s["process_set"])
        return tf.nest.pack_sequence_as(grads, reduced, expand_composites=False)


_classes = {}


def DistributedGradientTape(gradtape, device_dense='', device_sparse='',
                            compression=Compression.none, sparse_as_dense=False, op=Average,
                            gradient_predivide_factor=1.0, num_groups=0, groups=None,
                            process_set=global_process_set, scale_local_gradients=True):
    """``gradtape`` (a tf.GradientTape that has recorded) whose ``gradient(loss, vars)``
    returns the gradients averaged over the ranks, in one fused exchange per call.

    op: Average (default) or Sum; gradient_predivide_factor: divide by it before the sum and
    by N / it after (Average only). compression: ``Compression.fp16`` sends float32 and
    float64 gradients as float16. ``device_*``, ``num_groups``, ``groups`` and
    ``scale_local_gradients`` are accepted for Horovod's scripts (every gradient goes in one
    group); IndexedSlices are made dense whatever ``sparse_as_dense``."""
    if op is not Average and op is not Sum:
        refuse("grouped_allreduce", Problem(ValueError, f"DistributedGradientTape: op must be "
                                                        f"Average or Sum, got {op!r}"),
               process_set)
    base = type(gradtape)
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedGradientTape, base), {})
        _classes[base] = cls
    tape = object.__new__(cls)
    tape.__dict__.update(gradtape.__dict__)     # the same recording: no private name touched
    tape._mpitrain = {"compression": compression, "op": op,
                      "gradient_predivide_factor": gradient_predivide_factor,
                      "process_set": process_set}
    return tape
