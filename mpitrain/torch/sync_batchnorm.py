"""SyncBatchNorm: BatchNorm whose batch statistics are those of the global batch.

With data parallelism each rank normalises its own shard, so a small per-rank batch gives
noisy statistics. ``SyncBatchNorm`` (a torch ``_BatchNorm``, hence a drop-in for
``BatchNorm1d/2d/3d``) allreduces, per channel, the count, sum and sum of squares of its input
in forward, and the sums of the gradient and of gradient times centred input in backward: one
small allreduce each way (float64, so E[x^2] - E[x]^2 loses no precision), and every rank
normalises with the statistics of the whole batch, as ``BatchNorm2d`` on all ranks' samples
together would. The weight and bias gradients stay local sums: DistributedOptimizer averages
them like every other gradient. Counts travel too, so uneven shards and ranks that have joined
(contributing zeros) are weighted right.

In eval mode, or with one rank, it is plain batch normalisation.
"""
import torch
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from mpitrain import comm
from mpitrain.torch.ops import Sum, allreduce_


def _channel_dims(x):
    return [d for d in range(x.dim()) if d != 1]


def _sum_over_ranks(values, process_set):
    """``values`` (float64, 1-D) summed over the set's ranks, in place."""
    return allreduce_(values, op=Sum, name="SyncBatchNorm", process_set=process_set)


class SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalisation over every rank's batch: forward and backward each allreduce."""

    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, process_set):
        x = x.contiguous()
        channels = x.shape[1]
        dims = _channel_dims(x)
        x64 = x.double()
        stats = torch.cat([x64.sum(dims), (x64 * x64).sum(dims),
                           torch.tensor([x.numel() / channels], dtype=torch.float64,
                                        device=x.device)])
        stats = _sum_over_ranks(stats, process_set)
        count = stats[-1]
        if count.item() < 2:
            raise ValueError(f"SyncBatchNorm: {int(count.item())} value(s) per channel over "
                             f"all ranks; training needs at least 2")
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean * mean).clamp_min(0.0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * (count / (count - 1))
                running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
                running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype),
                                                    alpha=momentum)
        shape = [1, channels] + [1] * (x.dim() - 2)
        mean_, invstd_ = mean.to(x.dtype).view(shape), invstd.to(x.dtype).view(shape)
        out = (x - mean_) * invstd_
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        ctx.save_for_backward(x, weight, mean_, invstd_)
        ctx.count, ctx.process_set = count, process_set
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean, invstd = ctx.saved_tensors
        grad_out = grad_out.contiguous()
        channels = x.shape[1]
        dims = _channel_dims(x)
        xmu = x - mean
        sum_dy = grad_out.double().sum(dims)
        sum_dy_xmu = (grad_out * xmu).double().sum(dims)
        grad_weight = grad_bias = None
        if weight is not None:
            grad_weight = (sum_dy_xmu * invstd.view(-1).double()).to(weight.dtype)
            grad_bias = sum_dy.to(weight.dtype)
        sums = _sum_over_ranks(torch.cat([sum_dy, sum_dy_xmu]), ctx.process_set)
        shape = mean.shape
        mean_dy = (sums[:channels] / ctx.count).to(x.dtype).view(shape)
        mean_dy_xmu = (sums[channels:] / ctx.count).to(x.dtype).view(shape)
        scale = invstd if weight is None else invstd * weight.view(shape)
        grad_x = (grad_out - mean_dy - xmu * invstd * invstd * mean_dy_xmu) * scale
        return grad_x, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """``SyncBatchNorm(num_features, eps=1e-5, momentum=0.1, affine=True,
    track_running_stats=True, process_set=global_process_set)``: batch normalisation with the
    statistics of the batch of every rank of ``process_set``, for input of shape (N, C, ...)."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, device=None, dtype=None,
                 process_set=comm.global_process_set):
        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        self.process_set = process_set

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected input of 2 or more dimensions (N, C, "
                             f"...), got {input.dim()}")

    def forward(self, input):
        self._check_input_dim(input)
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            factor = (1.0 / float(self.num_batches_tracked) if self.momentum is None
                      else self.momentum)
        batch_stats = self.training or not self.track_running_stats
        if not batch_stats or self.process_set.size() == 1:
            return F.batch_norm(
                input, self.running_mean if not batch_stats or self.track_running_stats
                else None,
                self.running_var if not batch_stats or self.track_running_stats else None,
                self.weight, self.bias, batch_stats, factor, self.eps)
        track = self.training and self.track_running_stats
        return SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean if track else None,
            self.running_var if track else None, self.eps, factor, self.process_set)

    @classmethod
    def convert_sync_batchnorm(cls, module, process_set=comm.global_process_set):
        """``module`` with every BatchNorm layer (``_BatchNorm``) replaced by a SyncBatchNorm
        holding its parameters and running statistics (the module itself if it is one)."""
        out = module
        if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
            out = cls(module.num_features, module.eps, module.momentum, module.affine,
                      module.track_running_stats, process_set=process_set)
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            out.training = module.training
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_set))
        return out
