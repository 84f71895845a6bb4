"""torch.Tensor <-> the arrays the comm layer reduces: which dtypes travel, how, and the errors.

The comm layer is array-agnostic: a CPU tensor's ``.numpy()`` is a zero-copy view of its
storage, so a collective on it reads and (in place) writes the tensor itself; a CUDA tensor
exposes ``__cuda_array_interface__``, so the device path (NCCL, CUDA-aware MPI or host staging)
takes it as it takes a CuPy array. This file decides, per tensor, what goes down and how the
result comes back as a tensor of the input's dtype and device (``Bridge``).

How each dtype travels:
- float32, float64, float16, int8, int16, int32, int64, uint8: as they are (a view);
- bool: as uint8 bytes; a reduction is Min (logical and), Max (logical or) or Product (and);
  Sum and Average have no bool result and are refused;
- bfloat16: NumPy has no bfloat16, so reductions run on a float32 copy and round back to
  bfloat16 once, at the end (round to nearest even: one rounding, not one per addition); the
  collectives that only move bytes (allgather, broadcast, alltoall) move its 16-bit patterns
  exactly, as int16.
Anything else (complex, float8, sparse tensors) is refused.

The comm layer's agreement compares the dtypes it is given, so a bfloat16 tensor (reduced as
float32, moved as int16) or a bool one (uint8) would pass for the dtype it travels as:
``agree_dtypes`` checks those tensors' own dtypes across ranks first, one small message more,
only for them.

Errors are agreed: a bad argument on one rank must not leave the others waiting in the
collective, so ``refuse`` puts this rank's message in the same cross-rank agreement every
collective begins with. Every rank with the same error raises it (TypeError for a non-tensor or
an unsupported dtype, ValueError otherwise); when only some ranks have one, every rank raises
CollectiveError naming them.
"""
import numpy as np
import torch

from mpitrain import comm

# dtypes the comm layer reduces as they are
NATIVE = (torch.float32, torch.float64, torch.float16, torch.int8, torch.int16, torch.int32,
          torch.int64, torch.uint8)
SUPPORTED = NATIVE + (torch.bool, torch.bfloat16)
INTEGER = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)
BOOL_OPS = (comm.Min, comm.Max, comm.Product)


class Problem:
    """One rank's reason to refuse a call: the exception type and the message."""

    def __init__(self, exc_type, message):
        self.exc_type = exc_type
        self.message = message


def refuse(kind, problem, process_set):
    """Raise ``problem`` on every rank of ``process_set`` (the other ranks meet this rank in the
    agreement of the collective they are calling). Does not return."""
    try:
        # an in-place collective is agreed under its plain kind (allreduce_ as allreduce)
        comm.agree(process_set, kind.rstrip("_"), {"refused": True}, error=problem.message,
                   ordered=True,
                   who=f"mpitrain.torch.{kind}")
    except ValueError as exc:                  # every rank refused: the same error everywhere
        raise problem.exc_type(str(exc)) from None
    raise AssertionError("an agreement with an error always raises")   # pragma: no cover


def tensor_problem(tensor, kind, index=None):
    """Why ``tensor`` cannot go into collective ``kind``, or None."""
    what = kind if index is None else f"{kind}: tensor {index}"
    if not isinstance(tensor, torch.Tensor):
        return Problem(TypeError, f"{what}: expected a torch.Tensor, got "
                                  f"{type(tensor).__name__}")
    if tensor.layout is not torch.strided:
        return Problem(ValueError, f"{what}: {tensor.layout} tensors are not supported; "
                                   f"pass a dense tensor (tensor.to_dense())")
    if tensor.dtype not in SUPPORTED:
        names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED)
        return Problem(TypeError, f"{what}: dtype {tensor.dtype} is not supported; use one of "
                                  f"{names}")
    if not tensor.is_contiguous():
        return Problem(ValueError, f"{what}: the tensor is not contiguous (shape "
                                   f"{tuple(tensor.shape)}, stride {tensor.stride()}); pass "
                                   f"tensor.contiguous()")
    if tensor.device.type not in ("cpu", "cuda"):
        return Problem(ValueError, f"{what}: tensors on {tensor.device.type} are not "
                                   f"supported (cpu or cuda)")
    return None


# dtypes that travel as another dtype's values or bytes
DISGUISED = (torch.bool, torch.bfloat16)


def agree_dtypes(kind, tensors, process_set):
    """When a tensor's dtype travels disguised (bfloat16 as float32 or int16, bool as uint8),
    check every rank's torch dtypes first: a float32 tensor on one rank and a bfloat16 one on
    another is a CollectiveError on every rank (the float32 rank's collective meets this
    check), not a silent reduction."""
    if any(t.dtype in DISGUISED for t in tensors):
        comm.agree(process_set, "dtype check (bfloat16 or bool)",
                   {"collective": kind.rstrip("_"),
                    "dtype": [str(t.dtype).replace("torch.", "") for t in tensors]},
                   ordered=True, who=f"mpitrain.torch.{kind}")


def reduction_problem(tensor, op, kind):
    """Why ``op`` cannot reduce ``tensor``'s dtype, or None (the tensor itself is valid)."""
    if tensor.dtype is torch.bool and op not in BOOL_OPS:
        return Problem(ValueError, f"{kind}: {op!r} of bool tensors has no bool result; use "
                                   f"Max (logical or), Min or Product (logical and), or "
                                   f"convert to an integer dtype")
    return None


def is_integer(tensor):
    return tensor.dtype in INTEGER


def synchronize_device(tensor):
    """Wait for torch's queued kernels on the tensor's device: MPI and NCCL's own stream read
    the buffer next and know nothing of torch's stream."""
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()


def device_array(tensor):
    """A CUDA tensor as the device path takes it: a CuPy view when CuPy is installed (NCCL's
    path), else the tensor itself (its ``__cuda_array_interface__``, through Numba)."""
    try:
        import cupy
    except ImportError:
        return tensor
    with cupy.cuda.Device(tensor.device.index):
        return cupy.asarray(tensor)


def array_of(tensor):
    """The array sharing ``tensor``'s memory: a NumPy view on the CPU, a device array on CUDA."""
    return tensor.numpy() if tensor.device.type == "cpu" else device_array(tensor)


def as_tensor(array, like):
    """A result array as a tensor on ``like``'s device, sharing memory where it can."""
    if isinstance(array, np.ndarray):
        out = torch.from_numpy(array)
        return out if like.device.type == "cpu" else out.to(like.device)
    out = torch.as_tensor(array, device=like.device)
    torch.cuda.synchronize(like.device)       # the collective's stream before torch's
    return out


class Bridge:
    """One tensor's trip through a collective: ``array`` goes down, ``back(result)`` is the
    tensor the caller gets (the input itself for an in-place call).

    move_only: the collective moves bytes (allgather, broadcast, alltoall): bool and bfloat16
    travel as their bit patterns. Otherwise it reduces: bool as uint8, bfloat16 as a float32
    copy. ``copied``: ``array`` is a private copy, so reducing it in place costs nothing extra;
    ``private``: make one anyway (a group reduced in place for an out-of-place call).
    """

    def __init__(self, tensor, in_place, move_only=False, private=False):
        self.tensor = tensor
        self.in_place = in_place
        dtype = tensor.dtype
        t = tensor.detach()
        self.copied = False
        if dtype is torch.bool:
            t = t.view(torch.uint8)
        elif dtype is torch.bfloat16:
            if move_only:
                t = t.view(torch.int16)
            else:
                t = t.float()
                self.copied = True
        if private and not self.copied:
            t = t.clone()
            self.copied = True
        self.view_dtype = t.dtype
        synchronize_device(tensor)
        self.array = array_of(t)

    def back(self, result):
        """The caller's tensor from the collective's ``result`` array."""
        tensor = self.tensor
        if self.in_place:
            if self.copied:                                 # bfloat16: round the float32 back
                tensor.detach().copy_(as_tensor(result, tensor))
            elif tensor.is_cuda:
                torch.cuda.synchronize(tensor.device)
            return tensor
        out = as_tensor(result, tensor)
        if out.dtype is not self.view_dtype:                # the integer Average's float64
            out = out.to(self.view_dtype)
        if tensor.dtype is not self.view_dtype:
            out = out.to(tensor.dtype) if self.copied else out.view(tensor.dtype)
        return out
