"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for ``grpo.train --fsdp``: sharding, gathered calls, gradient
sync, clipping, checksums and sharded checkpoints.

Layout: every decoder layer is its own FSDP unit, then the ``GRPOPolicy`` root, whose group holds what is left
(embeddings, final norm, lm_head, and the head bias buffer). During the root's forward the root group is gathered,
so the fused head receives ``lm_head.weight`` as a plain unsharded tensor; a layer gathers its own parameters in
its forward and frees them after (again in backward). Parameters, gradients and AdamW state are 1/N per rank.

Calls into the model that do not go through ``GRPOPolicy.forward`` (sampling, greedy evaluation, old / reference
log-probs) run inside ``gathered(root)``: the root group is all-gathered for the block (the layer units still
gather themselves) and everything is resharded at its end.

Under autocast (bf16 on CUDA) the units use ``MixedPrecisionPolicy(param_dtype=autocast, reduce_dtype=fp32)``:
layers are all-gathered in bf16 (half the traffic), gradients are reduce-scattered and kept in fp32 next to the
fp32 master shards. The root does not cast its inputs: the batch carries fp32 advantages and log-probs.
"""
from __future__ import annotations

import contextlib
import os

import torch
import torch.distributed as dist
from torch import nn

from .distributed import DistEnv
from .errors import UsageError

SHARDED_DIR = "sharded"  # checkpoint-N/sharded/: torch.distributed.checkpoint files of model + optimizer


def _fsdp():
    try:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    except ImportError as exc:  # pragma: no cover - torch < 2.6
        raise UsageError(f"--fsdp needs torch.distributed.fsdp.fully_shard (FSDP2, torch >= 2.6): {exc}")
    return FSDPModule, MixedPrecisionPolicy, fully_shard


def is_fsdp(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit; False on a torch without FSDP2 (< 2.6), where nothing can be one."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(module, FSDPModule)


def decoder_layers(lm: nn.Module) -> list[nn.Module]:
    """The transformer blocks: modules of the classes the model lists as ``_no_split_modules`` (transformers'
    own unit of sharding and offloading), else ``base_model.layers``. Of listed modules nested in one another only
    the outermost is a unit (``fully_shard`` of a child after its parent fails: the parent's group already holds
    the child's parameters)."""
    names = set(getattr(lm, "_no_split_modules", None) or [])
    layers = _outermost([m for m in lm.modules() if type(m).__name__ in names])
    if not layers:
        layers = list(getattr(lm.base_model, "layers", []) or [])
    if not layers:
        raise UsageError(f"--fsdp: cannot find the decoder layers of {type(lm).__name__} (no _no_split_modules, "
                         "no base_model.layers)")
    return layers


def _outermost(modules: list[nn.Module]) -> list[nn.Module]:
    """``modules`` (in ``named_modules`` order: parents before children) less those inside another of them."""
    inner: set[int] = set()
    for m in modules:
        if id(m) not in inner:
            inner.update(id(c) for c in m.modules() if c is not m)
    return [m for m in modules if id(m) not in inner]


def shard(policy: nn.Module, env: DistEnv, autocast_dtype: torch.dtype | None) -> nn.Module:
    """``fully_shard`` each decoder layer of ``policy.lm``, then ``policy`` itself (the root), over all ranks.
    In place; returns ``policy`` (now also an ``FSDPModule``) with its shards and buffers on ``env.device``: pass
    it on the CPU so that no full copy ever lands on the device. Build the optimizer after this call."""
    _, MixedPrecisionPolicy, fully_shard = _fsdp()
    from torch.distributed.device_mesh import init_device_mesh

    if not dist.is_initialized():
        raise UsageError("--fsdp needs a process group (torchrun, or grpo.train's 1-rank group)")
    mesh = init_device_mesh(env.device.type, (dist.get_world_size(),))
    layer_mp = root_mp = MixedPrecisionPolicy()
    if autocast_dtype is not None:
        layer_mp = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32)
        root_mp = MixedPrecisionPolicy(param_dtype=autocast_dtype, reduce_dtype=torch.float32,
                                       cast_forward_inputs=False)
    for layer in decoder_layers(policy.lm):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp)
    fully_shard(policy, mesh=mesh, mp_policy=root_mp)
    _buffers_to(policy, env.device)
    return policy


def _buffers_to(module: nn.Module, device: torch.device) -> None:
    """``fully_shard`` moves the parameters and buffers of the modules it manages to the mesh's device (a model
    built on the CPU reaches the GPU one unit at a time, as shards); this moves any buffer it did not manage (none
    in the layout above: the root manages everything outside the layers; a safeguard for custom models)."""
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and buf.device != device:
                sub._buffers[name] = buf.to(device)


@contextlib.contextmanager
def gathered(root: nn.Module | None):
    """Run model code outside ``root.forward`` (sampling, ``token_logprobs``) with the root group all-gathered.
    The layer units gather themselves in their own forward hooks. On exit every group is resharded and the
    record of these forward calls (used to prefetch in backward) is cleared. No-op for a module without FSDP.
    Not for use between the micro-batches of one gradient accumulation."""
    if root is None or not is_fsdp(root):
        yield
        return
    # FSDP2 picks as root the first unit that runs a forward; make sure that is ``root`` (not a layer called
    # by the sampler) before anything else runs. Its forward hooks do the same.
    root._get_fsdp_state()._lazy_init()
    root.unshard()
    try:
        yield
    finally:
        _reset_forward_state(root)


def _reset_forward_state(root: nn.Module, use_reset_iter_state: bool | None = None) -> None:
    """Reshard every group of ``root`` and forget the forward calls recorded since the last backward (FSDP2 keeps
    them to order its backward prefetches; calls that no backward follows would otherwise pile up until the
    next training backward, forever for the frozen reference). torch >= 2.12 has ``reset_iter_state`` for this;
    torch 2.6-2.11 only have the per-module ``reshard``, and the record lives in private state that differs
    across versions (one ``_fsdp_param_group`` per state, later a list ``_fsdp_param_groups``), so it is cleared
    where found. ``use_reset_iter_state`` (default: when torch has it) picks the path (tests run both)."""
    if use_reset_iter_state is None:
        use_reset_iter_state = hasattr(root, "reset_iter_state")
    if use_reset_iter_state:
        root.reset_iter_state()
        return
    state = root._get_fsdp_state()
    for sub in getattr(getattr(state, "_state_ctx", None), "all_states", None) or [state]:
        groups = getattr(sub, "_fsdp_param_groups", None)
        if groups is None:
            groups = [g for g in [getattr(sub, "_fsdp_param_group", None)] if g is not None]
        for group in groups:
            group.reshard()
            indices = getattr(group, "_post_forward_indices", None)
            if indices is not None:
                indices.clear()
    order = getattr(getattr(state, "_comm_ctx", None), "post_forward_order", None)
    if order is not None:
        order.clear()
    # After an exception inside gathered(), a layer may still be mid-forward: forget it, as reset_iter_state does
    # (no-ops after a normal exit, where every post-forward hook already did this).
    ctx = getattr(state, "_state_ctx", None)
    if ctx is not None and hasattr(ctx, "iter_forward_root"):
        ctx.iter_forward_root = None
    for sub in getattr(ctx, "all_states", None) or [state]:
        training_state = getattr(sub, "_training_state", None)
        if training_state is not None and hasattr(type(training_state), "IDLE"):
            sub._training_state = type(training_state).IDLE


def gradient_sync(model: nn.Module, sync: bool, env: DistEnv):
    """The context of one micro-batch's backward: gradients are reduced across ranks only when ``sync``.
    FSDP2: ``set_requires_gradient_sync`` (without sync, each layer's *unsharded* gradient accumulates locally, in
    the reduce dtype, until a synced backward); DDP: ``no_sync``; a single process: nothing."""
    if is_fsdp(model):
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if env.enabled and not sync:
        return model.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` that also works on FSDP2 shards: the total norm of the *full* gradient (a DTensor's
    partial norms are all-reduced), then every gradient scaled by the same factor. Returns that norm."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads, 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return total


def shard_checksums(module: nn.Module, env: DistEnv) -> list[float]:
    """Collective: the parameter checksum of ``Trainer.param_checksums`` over each rank's *local* parameters, rank
    order. Without FSDP every rank holds a replica (equal values = ranks in sync). Under FSDP they differ (each
    rank holds other rows) and their sum is the checksum of the full parameters (comparable with an unsharded run
    and with the saved ``model/``)."""
    from torch.distributed.tensor import DTensor

    totals = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    with torch.no_grad():
        for p in module.parameters():
            local = (p.to_local() if isinstance(p, DTensor) else p).double()
            totals[env.rank] += local.sum() + 1e-3 * local.abs().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(totals)
    return totals.tolist()


# ----------------------------------------------------------------------------------------------- checkpoints
def save_sharded(path: str, root: nn.Module, optimizer) -> None:
    """Collective: model + optimizer state of every rank under ``path/sharded`` (torch.distributed.checkpoint,
    one file per rank plus metadata; reshardable onto another world size)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(root, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(path, SHARDED_DIR))


def load_sharded(path: str, root: nn.Module, optimizer) -> None:
    """Collective: restore what ``save_sharded`` wrote into the sharded ``root`` and its ``optimizer``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    folder = os.path.join(path, SHARDED_DIR)
    if not os.path.isdir(folder):
        raise UsageError(f"--resume {path!r}: no {SHARDED_DIR}/ folder: this checkpoint was saved without --fsdp; "
                         "resume it without --fsdp, or start a new --fsdp run from it with --model "
                         f"{os.path.join(path, 'model')}")
    model_state, optim_state = get_state_dict(root, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(root, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_lm_state_dict(root: nn.Module) -> dict[str, torch.Tensor]:
    """Collective: the full (unsharded) state dict of ``root.lm`` gathered onto rank 0's CPU (empty elsewhere),
    keyed like ``root.lm.state_dict()``: what ``save_pretrained`` writes."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out = {k[len("lm."):]: v for k, v in full.items() if k.startswith("lm.")}
    # Tied parameters (lm_head.weight is embed_tokens.weight) come back as separate gathered copies; make them one
    # tensor again so that save_pretrained writes it once, as it does for an unsharded tied model.
    first: dict[int, str] = {}
    for name, p in root.lm.named_parameters(remove_duplicate=False):
        if id(p) in first and name in out and first[id(p)] in out:
            out[name] = out[first[id(p)]]
        first.setdefault(id(p), name)
    return out
