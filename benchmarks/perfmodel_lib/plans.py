"""The model's workload: a zoo model's gradients in the buckets the trainer reduces them in,
planned by mpitrain/comm/buckets.py as comm/fusion.py (``--no-overlap``) or comm/overlap.py
(the default) plan them, with each overlapped bucket's ready time in backward."""
import dataclasses

import numpy as np

from mpitrain.comm.buckets import SOLO_BYTES, plan_buckets

from .errors import ModelError
from .inputs import backward_share


def gradient_tensor_bytes(model):
    """Byte size of each gradient tensor of a zoo model (float32), in declared order."""
    from mpitrain.nn import models
    net = models.get(model)
    return [int(p.data.size) * 4 for p in net.parameters()]


def fusion_plan(tensor_bytes, threshold):
    """[(bucket bytes, tensors in it)] of the fusion plan as comm/fusion.py makes it: a tensor of
    at least SOLO_BYTES travels alone (in place, not packed); the others are packed in order
    into buckets of <= threshold bytes (one larger than the threshold alone)."""
    return _byte_plan(tensor_bytes, threshold, consecutive=False)


def _byte_plan(tensor_bytes, threshold, consecutive):
    """[(bucket bytes, tensors in it)]: the gradients are all float32, so planning their sizes
    in bytes (as one-byte elements) compares bytes with the threshold and SOLO_BYTES exactly as
    planning float32 elements does."""
    buckets = plan_buckets(tensor_bytes, [np.uint8] * len(tensor_bytes), threshold, SOLO_BYTES,
                           consecutive=consecutive)
    return [(b.total, len(b.entries)) for b in buckets]


@dataclasses.dataclass
class OverlapPlan:
    """The overlapped trainer's buckets: ``buckets`` = [(bytes, tensors, ready)], in the order
    the comm thread runs them, ``ready`` = fraction of backward done when the bucket's last
    gradient is final; ``backward_share`` = backward's fraction of the compute time."""
    buckets: list
    backward_share: float

    def __post_init__(self):
        if not 0 < self.backward_share <= 1:
            raise ModelError(f"backward share {self.backward_share!r}: must be in (0, 1]")
        self.buckets = [(float(nb), int(c), float(r)) for nb, c, r in self.buckets]
        self.backward_share = float(self.backward_share)

    def to_json(self):
        return {"overlap": True, "backward_share": self.backward_share,
                "buckets": [{"bytes": nb, "tensors": c, "ready": r} for nb, c, r in self.buckets]}


def backward_layers(model, batch):
    """[(backward GEMM FLOPs, [gradient bytes of the layer's parameters])] per layer of a zoo
    model, forward order -- the GEMMs benchmarks/step.py's ``gemm_plan`` lists (dW, and dx for
    every layer but the first); layers without GEMMs (pooling, flatten) count 0."""
    from mpitrain.nn import Conv2D, Flatten, Linear, MaxPool2D, models
    net = models.get(model)
    out, shape = [], (batch,) + tuple(net.input_shape)
    for i, layer in enumerate(net.layers):
        flops = 0
        if isinstance(layer, Linear):
            flops = 2 * shape[0] * layer.in_features * layer.out_features      # dW = g^T x
            shape = (shape[0], layer.out_features)
        elif isinstance(layer, Conv2D):
            n, c, h, w = shape
            oh, ow = layer.output_hw(h, w)
            flops = 2 * n * oh * ow * layer.out_channels * c * layer.kernel_size ** 2
            shape = (n, layer.out_channels, oh, ow)
        elif isinstance(layer, MaxPool2D):
            n, c, h, w = shape
            ks, st = layer.kernel_size, layer.stride
            shape = (n, c, (h - ks) // st + 1, (w - ks) // st + 1)
        elif isinstance(layer, Flatten):
            shape = (shape[0], int(np.prod(shape[1:])))
        flops *= 2 if i > 0 else 1                  # dx: the first layer forms none
        out.append((flops, [int(p.data.size) * 4 for p in layer.parameters()]))
    return out


def overlap_buckets(layers, threshold):
    """[(bytes, tensors, ready)] as comm/overlap.py plans them: gradients in reverse layer order
    (the last layer's parameters, last first), packed into buckets of <= threshold bytes (a
    larger tensor, or one of at least SOLO_BYTES, alone). A layer reports all its gradients when
    its backward ends; ``ready`` of a bucket is the share of backward done then, assumed
    proportional to the backward FLOPs of the layers differentiated so far (``layers`` as
    ``backward_layers`` returns them)."""
    total = float(sum(f for f, _ in layers)) or 1.0
    tensors, done = [], 0.0                 # (bytes, ready) in submission order
    for flops, grads in reversed(layers):
        done += flops
        tensors += [(nb, min(1.0, done / total)) for nb in reversed(grads)]
    plan, i = [], 0
    for nb, count in _byte_plan([t[0] for t in tensors], threshold, consecutive=True):
        plan.append((nb, count, max(r for _, r in tensors[i:i + count])))
        i += count
    return plan


def default_threshold(overlap):
    """The trainer's bucket size: 4 MiB buckets with overlap, the 64 MiB fusion plan without."""
    if overlap:
        from mpitrain.parallel.gradients import OVERLAP_BUCKET_BYTES
        return OVERLAP_BUCKET_BYTES
    from mpitrain.comm.fusion import DEFAULT_THRESHOLD_BYTES
    return DEFAULT_THRESHOLD_BYTES


def make_plans(models, overlap, threshold, shares, batch):
    """{model: plan} for the trainer with or without overlap (threshold None: its default)."""
    threshold = default_threshold(overlap) if threshold is None else threshold
    if not overlap:
        return {m: fusion_plan(gradient_tensor_bytes(m), threshold) for m in models}
    return {m: OverlapPlan(overlap_buckets(backward_layers(m, batch), threshold),
                           backward_share(shares.get(m), batch)) for m in models}


def plan_json(plan):
    if isinstance(plan, OverlapPlan):
        return plan.to_json()
    return {"overlap": False, "buckets": [{"bytes": nb, "tensors": c} for nb, c in plan]}
