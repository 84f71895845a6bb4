"""DistributedOptimizer for Keras 3 optimizers, and load_model (horovod.tensorflow.keras's).

The wrapper is an instance of a subclass of the optimizer's own class (``isinstance(opt,
keras.optimizers.SGD)`` holds; it saves under the original class's name, so a saved model
loads in plain Keras too) whose ``apply`` -- which ``apply_gradients`` and Keras's
``train_step`` call -- first averages every gradient over the ranks in one fused exchange
(mpitrain.tensorflow.gradients), then runs the optimizer's own update. It works eagerly and
inside ``model.fit``'s tf.function; not under ``jit_compile=True`` (Keras's "auto" chooses
False on a CPU-only machine; pass ``jit_compile=False`` to ``compile`` on a GPU one).

``backward_passes_per_step=k``: the gradients of k calls are summed into local accumulators
(divided by k with ``average_aggregated_gradients=True``), and only every k-th call averages
them over the ranks and updates the variables (the others leave the variables and the
optimizer's ``iterations`` alone), as Horovod's.
"""
import keras
import tensorflow as tf

from mpitrain.keras.backend import check_backend
from mpitrain.tensorflow.compression import Compression
from mpitrain.tensorflow.gradients import reduce_gradients, scale_factors
from mpitrain.tensorflow.ops import Average, Problem, Sum, global_process_set, refuse


class Settings:
    """What the wrapper adds to the optimizer, kept out of Keras's attribute tracking."""

    def __init__(self, compression, op, predivide, passes, average_aggregated, process_set):
        self.compression = compression
        self.op = op
        self.predivide = predivide
        self.passes = passes
        self.average_aggregated = average_aggregated
        self.process_set = process_set
        self.accumulators = None        # backward_passes_per_step > 1: (count, [sums])


class _DistributedOptimizer:
    """The methods the wrapped class adds (mixed in before the optimizer's own class)."""

    def apply(self, grads, trainable_variables=None):
        s = self._mpitrain
        grads = [None if g is None else tf.convert_to_tensor(g) for g in grads]
        if s.passes == 1:
            return super().apply(self._mpitrain_reduce(grads), trainable_variables)
        return self._mpitrain_accumulate(grads, trainable_variables)

    def _mpitrain_reduce(self, grads):
        s = self._mpitrain
        return reduce_gradients(grads, s.compression, s.op, s.predivide, s.process_set,
                                who="DistributedOptimizer")

    def _mpitrain_accumulate(self, grads, trainable_variables):
        s = self._mpitrain
        if trainable_variables is not None and not self.built:
            with tf.init_scope():
                self.build(trainable_variables)
        if s.accumulators is None:
            with tf.init_scope():
                count = tf.Variable(0, dtype=tf.int64, trainable=False)
                sums = [None if g is None else
                        tf.Variable(tf.zeros(g.shape, g.dtype), trainable=False)
                        for g in grads]
            s.accumulators = (count, sums)
        count, sums = s.accumulators
        for acc, g in zip(sums, grads):
            if g is not None:
                acc.assign_add(g)
        count.assign_add(1)
        outer = super()

        def update():
            totals = [None if acc is None else acc.read_value() for acc in sums]
            if s.average_aggregated:
                totals = [None if t is None else t / tf.cast(s.passes, t.dtype)
                          for t in totals]
            outer.apply(self._mpitrain_reduce(totals), trainable_variables)
            for acc in sums:
                if acc is not None:
                    acc.assign(tf.zeros_like(acc))
            return tf.constant(True)

        return tf.cond(count % s.passes == 0, update, lambda: tf.constant(False))


_classes = {}


def wrapped_class(base):
    """The subclass of ``base`` with the wrapper's methods, one per class, named and placed
    as ``base`` is (so that Keras saves it as ``base``)."""
    cls = _classes.get(base)
    if cls is None:
        cls = type(base.__name__, (_DistributedOptimizer, base),
                   {"__module__": base.__module__, "__qualname__": base.__qualname__})
        _classes[base] = cls
    return cls


def DistributedOptimizer(optimizer, name=None, device_dense='', device_sparse='',
                         compression=Compression.none, sparse_as_dense=False,
                         gradient_predivide_factor=1.0, op=Average, backward_passes_per_step=1,
                         average_aggregated_gradients=False, num_groups=0, groups=None,
                         process_set=global_process_set, scale_local_gradients=True):
    """``optimizer`` (any keras.optimizers.Optimizer) averaging its gradients over the ranks
    before each update, in one fused exchange. Use the returned optimizer from then on.

    An optimizer not yet built comes back as a new one made from its config (Horovod's way);
    a built one (with variables, e.g. a loaded model's) is wrapped in place, its state kept.
    op: Average or Sum; gradient_predivide_factor: divide by it before the sum, by N / it
    after; compression: ``Compression.fp16`` sends float32 gradients as float16;
    backward_passes_per_step and average_aggregated_gradients: see the module's docstring.
    ``name``, ``device_*``, ``sparse_as_dense``, ``num_groups``, ``groups`` and
    ``scale_local_gradients`` are accepted for Horovod's scripts."""
    check_backend()
    who = "DistributedOptimizer"
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        refuse("grouped_allreduce", Problem(TypeError, f"{who}: expected a Keras optimizer, "
                                                       f"got {type(optimizer).__name__}"),
               process_set)
    if op is not Average and op is not Sum:
        refuse("grouped_allreduce", Problem(ValueError, f"{who}: op must be Average or Sum, "
                                                        f"got {op!r}"), process_set)
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        refuse("grouped_allreduce", Problem(ValueError, f"{who}: backward_passes_per_step "
                                                        f"must be an integer >= 1, got "
                                                        f"{backward_passes_per_step!r}"),
               process_set)
    scale_factors(op, gradient_predivide_factor, process_set, who)
    base = type(optimizer)
    if isinstance(optimizer, _DistributedOptimizer):
        base = next(c for c in base.__mro__[1:] if not issubclass(c, _DistributedOptimizer))
    cls = wrapped_class(base)
    if optimizer.built:         # its variables stay its own: the same object, its class changed
        wrapped = optimizer
        wrapped.__class__ = cls
    else:
        wrapped = cls.from_config(optimizer.get_config())
    wrapped._mpitrain = Settings(compression, op, gradient_predivide_factor,
                                 backward_passes_per_step, average_aggregated_gradients,
                                 process_set)
    return wrapped


def load_model(filepath, custom_optimizers=None, custom_objects=None,
               compression=Compression.none, **kwargs):
    """``keras.models.load_model(filepath)`` with the model's optimizer wrapped in
    DistributedOptimizer (its state as saved). ``custom_optimizers``: optimizer classes the
    file names besides Keras's own; ``kwargs`` go to DistributedOptimizer."""
    check_backend()
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or ():
        objects.setdefault(cls.__name__, cls)
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    if getattr(model, "optimizer", None) is not None:
        model.optimizer = DistributedOptimizer(model.optimizer, compression=compression,
                                               **kwargs)
    return model
