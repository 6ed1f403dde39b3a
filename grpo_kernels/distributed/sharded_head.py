"""An lm_head sharded for data parallelism (DeepSpeed ZeRO-3, FSDP2 DTensor) gathered around the fused head.

Neither layout shards the vocabulary for tensor parallelism: every rank runs the whole head on its own tokens, so
the head is gathered whole for the call (one full V x H head per rank, transiently) and its gradient is reduced
across ranks like every other parameter's. Tensor-parallel vocabulary shards take ``process_group=`` instead
(``vocab_parallel.py``), which never gathers the head.

- ZeRO-3 (``gather_head``): DeepSpeed partitions each parameter and empties ``param.data`` outside its owning
  module's forward. A caller that reads ``lm_head.weight`` directly (as TRL's fused forward does) may find it
  empty, and a gather there re-partitions on exit, so by the time autograd runs the backward the saved weight
  can be empty again. ``gather_head`` is a zero-argument callable returning a context manager under which weight
  and bias hold their full values (``zero3_gather_head``); the head enters it around its forward and again around
  every backward use of weight / bias. ZeRO-3's own hooks then reduce-scatter the gradient, when the call ran
  inside the model's forward (measured with DeepSpeed 0.19.8; docs/distributed.md, "DeepSpeed ZeRO-3").
- FSDP2 (``gathered_dtensor_head``): a weight that arrives as a sharded DTensor is all-gathered for the call by
  ``_GatherDataParallel``, whose backward reduce-scatters the full gradient back to the local shard, averaged
  over the mesh and reduced in fp32 (a bf16 head's gradient is cast back to bf16 after the sum). FSDP2 averages
  every gradient it reduces; ``DTensor.full_tensor()``'s default backward would only slice this rank's own
  gradient (each rank would keep the gradient of its own tokens). Measured against DDP's mean over ranks
  (docs/distributed.md, "FSDP2 (a DTensor weight)").
"""
from __future__ import annotations

import contextlib
import functools

import torch
from torch.autograd.function import once_differentiable


def check_gather_head(gather_head):
    """``gather_head`` validated: None or a zero-argument callable (called later, once per use)."""
    if gather_head is not None and not callable(gather_head):
        raise ValueError("gather_head must be None or a zero-argument callable returning a context manager under "
                         f"which weight and bias hold their full values, got {type(gather_head).__name__}")
    return gather_head


def zero3_gather_head(*params):
    """A ``gather_head`` for DeepSpeed ZeRO-3: a zero-argument callable whose context holds ``params`` (the head's
    weight and bias; None entries are ignored) whole, e.g.
    ``gather_head=zero3_gather_head(self.lm_head.weight, self.lm_head.bias)`` inside the model's forward.

    Each entry gathers only the parameters that are ZeRO-3 partitions not already available, with
    ``deepspeed.zero.GatheredParameters`` (read-only), and re-partitions only those on exit. Parameters that are
    already gathered (by the caller's own ``GatheredParameters``, by ZeRO-3's hooks around a module's forward or
    backward, by a tied embedding's module) are left alone: gathering them again would raise DeepSpeed's "Nested
    GatheredParameters contexts cannot overlap parameters", and re-partitioning them on exit would empty a head
    that ZeRO-3 still uses. For plain tensors (no ZeRO-3, DDP, a single process) it is a no-op context, so the same
    model code runs with and without DeepSpeed; DeepSpeed is imported only when a parameter is a ZeRO-3 partition.
    The same contract as TRL's ``maybe_gather_lm_head_ctx``.
    """
    return functools.partial(_zero3_gather, tuple(params))


def _zero3_gather(params):
    partitions = {id(p): p for p in params if p is not None and hasattr(p, "ds_id")}  # by identity: tied heads
    if not partitions:
        return contextlib.nullcontext()
    try:
        import deepspeed
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    except ImportError as error:
        raise ImportError("zero3_gather_head: the head's parameters are DeepSpeed ZeRO-3 partitions (they carry "
                          "ds_id) but deepspeed cannot be imported") from error
    # Why refuse INFLIGHT: GatheredParameters does not wait for a partition ZeRO-3 is prefetching, and its exit
    # asserts "Cannot partition a param in flight" after the whole head has run; say so before any work.
    inflight = [p for p in partitions.values() if p.ds_status == ZeroParamStatus.INFLIGHT]
    if inflight:
        raise RuntimeError(f"zero3_gather_head: {len(inflight)} head parameter(s) are being prefetched by ZeRO-3 "
                           "(ds_status INFLIGHT); call the fused head inside the model's forward, where ZeRO-3 has "
                           "gathered them, or outside a prefetch")
    to_gather = [p for p in partitions.values() if p.ds_status != ZeroParamStatus.AVAILABLE]
    return deepspeed.zero.GatheredParameters(to_gather) if to_gather else contextlib.nullcontext()


def check_head_options(weight, bias, process_group, vocab_start, gather_head) -> None:
    """The opening checks shared by ``linear_token_logprobs`` and ``fused_linear_grpo_loss``: ``gather_head``'s
    type, and the options only one of the two sharded layouts takes (vocab-parallel or data-parallel)."""
    check_gather_head(gather_head)
    if process_group is not None:
        if gather_head is not None:
            raise ValueError("gather_head cannot be combined with process_group: a vocab-parallel head keeps its "
                             "shard local, pass the shard itself as weight")
        local_shard_only(weight, bias)
    elif vocab_start is not None:
        raise ValueError("vocab_start is only meaningful with process_group (a vocab-parallel head)")


@contextlib.contextmanager
def gathered(gather_head):
    """Enter ``gather_head()`` (a no-op when None), checking that it gave a context manager."""
    if gather_head is None:
        yield
        return
    ctx = gather_head()
    if not (hasattr(ctx, "__enter__") and hasattr(ctx, "__exit__")):
        raise ValueError("gather_head() must return a context manager (e.g. deepspeed.zero.GatheredParameters), "
                         f"got {type(ctx).__name__}")
    with ctx:
        yield


def _dtensor_types():
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without torch.distributed
        return None
    return DTensor, Replicate, Shard


def is_dtensor(t) -> bool:
    types = _dtensor_types()
    return types is not None and isinstance(t, types[0])


def _check_data_parallel(name: str, t) -> None:
    """A DTensor the fused head can gather: FSDP2's Shard(0) on one mesh dimension, Replicate on the others (HSDP).

    Anything else (Shard on the hidden dimension, several sharded mesh dimensions as with FSDP + tensor
    parallelism, Partial) is a layout whose gradient reduction we cannot infer."""
    _, Replicate, Shard = _dtensor_types()
    placements = tuple(t.placements)
    shards = [p for p in placements if type(p) is Shard and p.dim == 0]
    if len(shards) > 1 or not all(type(p) is Replicate or (type(p) is Shard and p.dim == 0) for p in placements):
        raise ValueError(
            f"{name} is a DTensor with placements {placements} on a mesh of shape {tuple(t.device_mesh.shape)}: the "
            "fused head gathers only a data-parallel (FSDP2 / HSDP) head, Shard(0) on one mesh dimension and "
            "Replicate on the others. For a tensor-parallel vocabulary shard pass its local tensor "
            f"({name}.to_local()) with process_group= (the vocab-parallel head), or gather it yourself.")


class _GatherDataParallel(torch.autograd.Function):
    """DTensor shard -> the full tensor; backward: the full gradient summed over the mesh and divided by its size,
    back in the shard's placements (a reduce-scatter, plus an all-reduce over HSDP's replicate dimension), reduced
    in fp32 at least and returned in the shard's dtype."""

    @staticmethod
    def forward(ctx, t):
        ctx.spec = (t.device_mesh, tuple(t.placements), t.shape, t.stride(), t.dtype)
        return t.full_tensor()

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        from torch.distributed.tensor import DTensor, Partial

        mesh, placements, shape, stride, dtype = ctx.spec
        # Why Partial and a division: each rank holds d loss_rank / dW for its own tokens; the parameter's gradient
        # in data parallelism is their mean (what DDP and FSDP2's own reduce-scatter give every other parameter).
        # Why fp32: a bf16 / fp16 sum over ranks rounds at every step; FSDP2 reduces in fp32 under the usual
        # reduce_dtype=float32, so the head's gradient is summed like every other one, then cast back.
        reduce_dtype = torch.promote_types(grad.dtype, torch.float32)
        partial = DTensor.from_local(grad.to(reduce_dtype) / mesh.size(), mesh, [Partial()] * mesh.ndim,
                                     run_check=False, shape=shape, stride=stride)
        return partial.redistribute(mesh, placements).to(dtype)


def check_dtensor_head(weight, bias) -> bool:
    """Whether (weight, bias) is a DTensor head; raises a ValueError naming the argument for one the fused head cannot
    gather (mixed DTensor / plain, a placement other than FSDP2's / HSDP's). No collective: a validation."""
    if not is_dtensor(weight) and not is_dtensor(bias):
        return False
    if bias is not None and is_dtensor(weight) != is_dtensor(bias):
        raise ValueError("weight and bias must both be DTensors or both plain tensors, got weight "
                         f"{type(weight).__name__} and bias {type(bias).__name__}")
    _check_data_parallel("weight", weight)
    if bias is not None:
        _check_data_parallel("bias", bias)
    return True


def backward_context(gather_head):
    """What the head's backward enters again (a zero-argument callable, or None without ``gather_head``): a ZeRO-3
    partition is emptied when the forward's gather context exits."""
    return None if gather_head is None else functools.partial(gathered, gather_head)


def gathered_dtensor_head(weight, bias):
    """(weight, bias) as plain full tensors when weight is a data-parallel DTensor (FSDP2), else unchanged.

    The gradient flows back to the DTensor shards averaged over the mesh (``_GatherDataParallel``)."""
    if not check_dtensor_head(weight, bias):
        return weight, bias
    return _GatherDataParallel.apply(weight), None if bias is None else _GatherDataParallel.apply(bias)


def local_shard_only(weight, bias) -> None:
    """The vocab-parallel head (``process_group=``) takes this rank's shard as a plain tensor, never a DTensor."""
    for name, t in (("weight", weight), ("bias", bias)):
        if is_dtensor(t):
            raise ValueError(f"{name} must be this rank's vocabulary shard as a plain tensor with process_group=, got "
                             f"a DTensor with placements {tuple(t.placements)}: pass {name}.to_local()")
