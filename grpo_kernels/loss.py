"""Functional GRPO losses and their thin ``nn.Module`` wrappers.

Both losses validate their arguments once (``inputs.py``), then run two stages: a vocab sweep (Triton or chunked
PyTorch) that yields per-token log-prob, entropy and logsumexp, then the contract's per-token loss, masks and
reduction on B x T tensors: ``reference.loss_from_logps``, or on the Triton path for token-level configurations the
per-token kernel of ``triton_loss_stage``. The gradient of the second stage w.r.t. (logp, entropy) is the per-token
scalar ``g`` of docs/DESIGN.md section 3 that the sweep's backward turns into d logits / d hidden / d weight.
"""
from __future__ import annotations

import torch
from torch import nn

from . import triton_loss_stage
from .config import GRPOLossConfig, resolve_config
from .inputs import HeadInputs, LogitsInputs, LossInputs
from .linear_loss_in_forward import gradient_in_forward, light_path_chunk_bytes
from .logprobs_from_hidden import head_token_logprobs, linear_token_logprobs
from .loss_types import per_token_gradient_known
from .logprobs_from_logits import logits_token_logprobs
from .reference import loss_from_logps
from .sharded_head import check_head_options, gathered, gathered_dtensor_head


def _loss_stage(logps, entropy, batch: LossInputs, cfg: GRPOLossConfig, impl: str):
    """The per-token loss, masks and reduction: one Triton kernel where it applies, else the reference."""
    B, T = logps.shape
    if impl == "triton" and per_token_gradient_known(cfg) and B * T > 0:
        return triton_loss_stage.fused_loss_from_logps(logps, entropy, batch, cfg)
    return loss_from_logps(logps, batch.advantages, mask=batch.mask, old_logps=batch.old_logps,
                           ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=entropy,
                           num_items_in_batch=batch.num_items_in_batch, sampling_logps=batch.sampling_logps,
                           config=cfg)


def grpo_loss(logits, ids, advantages, mask=None, old_logps=None, ref_logps=None, is_ratio=None,
              num_items_in_batch=None, config: GRPOLossConfig | None = None, impl: str = "auto",
              sampling_logps=None, inplace_backward: bool = False, **config_overrides):
    """GRPO loss from logits (B, T, V) aligned with ``ids`` (B, T): returns ``(loss, metrics)``.

    advantages (B,) or (B, T); mask (B, T) (None = all valid); old_logps / ref_logps / sampling_logps (B, T);
    is_ratio (B,), (B, 1) or (B, T); num_items_in_batch normalizes dapo / cispo / vespo (default: mask.sum()).
    config: a ``GRPOLossConfig``; keyword overrides (``loss_type="grpo"``, ``beta=0.04``...) apply on top.
    inplace_backward: write d logits into the logits buffer (no second B x T x V tensor). With the gradient computed
    in the forward (``config.grad_in_forward``, the default on the Triton path where the per-token gradient is known
    once a row is swept, and the logits require grad) the buffer holds d logits as soon as this returns.
    Returns a 0-dim fp32 loss (fp64 for fp64 logits) and a dict of detached 0-dim metrics.
    """
    cfg = resolve_config(config, config_overrides)
    inputs = LogitsInputs.validate(logits, ids, cfg.temperature, impl, dims=(3,))
    B, T = ids.shape
    batch = LossInputs.validate(B, T, logits.device, cfg, advantages, mask, old_logps, ref_logps, is_ratio,
                                sampling_logps, num_items_in_batch)
    if triton_loss_stage.grad_in_forward_applies(inputs, cfg):
        return triton_loss_stage.grad_in_forward_loss(inputs, batch, cfg, inplace_backward)
    logps, entropy, _ = logits_token_logprobs(inputs, inplace_backward, row_mask=mask)
    return _loss_stage(logps, entropy, batch, cfg, inputs.impl)


def fused_linear_grpo_loss(hidden, weight, ids, advantages, mask=None, bias=None, old_logps=None, ref_logps=None,
                           is_ratio=None, num_items_in_batch=None, config: GRPOLossConfig | None = None,
                           impl: str = "auto", sampling_logps=None, process_group=None,
                           vocab_start: int | None = None, gather_head=None, **config_overrides):
    """GRPO loss from final hidden states and the lm_head, never writing the B x T x V logits.

    hidden (B, T, H) or (B*T, H); weight (V, H); bias (V,) or None; ids (B, T); other arguments as
    ``grpo_loss``. Gradients flow to hidden, weight and bias, each only when it requires grad (a frozen head
    does no d weight work). On the Triton path, token-level configurations compute the gradients in the forward
    (``config.grad_in_forward``, chunks sized by ``config.memory_budget``); everything else takes the
    memory-light recompute path, whose ``config.deterministic`` selects the atomics-free backward.

    Vocab-parallel (``process_group``): ``weight`` / ``bias`` are this rank's vocabulary shard starting at
    ``vocab_start``, everything else is replicated, as for ``linear_token_logprobs``; every rank gets the same
    loss, its own dW / dbias and the all-reduced d hidden. Both impls take the recompute path there (the gradient
    in the forward needs the global logsumexp first).

    A head sharded for data parallelism (a DTensor from FSDP2, or a DeepSpeed ZeRO-3 partition with
    ``gather_head=grpo_kernels.zero3_gather_head(weight, bias)``, inside the model's forward) is gathered for the
    call, as for ``linear_token_logprobs``; ``gather_head`` is entered around the forward and, on the memory-light
    path, again around the backward's recompute.
    """
    check_head_options(weight, bias, process_group, vocab_start, gather_head)
    if process_group is not None:
        from .vocab_parallel import vocab_parallel_grpo_loss
        return vocab_parallel_grpo_loss(hidden, weight, ids, advantages, mask, bias, old_logps, ref_logps, is_ratio,
                                        num_items_in_batch, config, impl, sampling_logps, config_overrides,
                                        process_group, vocab_start)
    cfg = resolve_config(config, config_overrides)
    weight, bias = gathered_dtensor_head(weight, bias)
    with gathered(gather_head):
        inputs = HeadInputs.validate(hidden, weight, ids, bias, cfg.temperature, impl, ids_dims=(2,))
        B, T = ids.shape
        batch = LossInputs.validate(B, T, hidden.device, cfg, advantages, mask, old_logps, ref_logps, is_ratio,
                                    sampling_logps, num_items_in_batch)
        # the gradient-in-forward paths read weight / bias only here: their backward hands out stored gradients
        in_forward = gradient_in_forward(inputs, batch, cfg)
        if in_forward is not None:
            return in_forward
        logps, entropy, _ = head_token_logprobs(inputs, cfg.deterministic, row_mask=mask,
                                                chunk_bytes=light_path_chunk_bytes(cfg), gather_head=gather_head)
    return _loss_stage(logps, entropy, batch, cfg, inputs.impl)


class GRPOLoss(nn.Module):
    """``grpo_loss`` with a fixed ``GRPOLossConfig``: ``GRPOLoss(loss_type="grpo")(logits, ids, advantages)``."""

    def __init__(self, config: GRPOLossConfig | None = None, impl: str = "auto", **overrides):
        super().__init__()
        self.config = resolve_config(config, overrides)
        self.impl = impl

    def forward(self, logits, ids, advantages, mask=None, **kwargs):
        return grpo_loss(logits, ids, advantages, mask, config=self.config, impl=self.impl, **kwargs)


_LIGER_NAMES = {"_input": "hidden", "lin_weight": "weight", "selected_token_ids": "ids",
                "attention_mask": "mask", "ref_per_token_logps": "ref_logps",
                "old_per_token_logps": "old_logps", "vllm_is_ratio": "is_ratio"}


class FusedLinearGRPOLoss(nn.Module):
    """``fused_linear_grpo_loss`` with a fixed config; a drop-in for Liger's ``LigerFusedLinearGRPOLoss``.

    forward takes our names (hidden, weight, ids, advantages, mask, bias, old_logps, ref_logps, is_ratio,
    num_items_in_batch) or Liger's (_input, lin_weight, selected_token_ids, attention_mask, advantages, bias,
    ref_per_token_logps, old_per_token_logps, ref_input, ref_weight, ref_bias, vllm_is_ratio,
    num_items_in_batch), positionally in Liger's order too. With ``ref_input``/``ref_weight`` and no
    ``ref_logps`` the reference log-probs are computed with the fused no-grad path. ``process_group`` /
    ``vocab_start`` (keywords) make it a vocab-parallel head, ``gather_head`` gathers a ZeRO-3 partitioned one
    (``fused_linear_grpo_loss``). Returns (loss, metrics).
    """

    _POSITIONAL = ("hidden", "weight", "ids", "mask", "advantages", "bias", "ref_logps", "old_logps",
                   "ref_input", "ref_weight", "ref_bias", "is_ratio", "num_items_in_batch")

    def __init__(self, config: GRPOLossConfig | None = None, impl: str = "auto", **overrides):
        super().__init__()
        self.config = resolve_config(config, overrides)
        self.impl = impl

    def forward(self, *args, **kwargs):
        if len(args) > len(self._POSITIONAL):
            raise ValueError(f"FusedLinearGRPOLoss.forward takes at most {len(self._POSITIONAL)} positional "
                             f"arguments, got {len(args)}")
        named = dict(zip(self._POSITIONAL, args))
        for key, value in kwargs.items():
            key = _LIGER_NAMES.get(key, key)
            if key in named:
                raise ValueError(f"argument {key!r} given twice")
            named[key] = value
        unknown = set(named) - set(self._POSITIONAL) - {"sampling_logps", "process_group", "vocab_start",
                                                        "gather_head"}
        if unknown:
            raise ValueError(f"unknown argument(s) {sorted(unknown)} for FusedLinearGRPOLoss.forward")
        for required in ("hidden", "weight", "ids", "advantages"):
            if named.get(required) is None:
                raise ValueError(f"FusedLinearGRPOLoss.forward needs {required!r}")
        ref_input, ref_weight, ref_bias = (named.pop(k, None) for k in ("ref_input", "ref_weight", "ref_bias"))
        if named.get("ref_logps") is None and self.config.beta != 0.0 and ref_input is not None:
            with torch.no_grad():
                named["ref_logps"] = linear_token_logprobs(
                    ref_input, named["weight"] if ref_weight is None else ref_weight, named["ids"],
                    bias=named.get("bias") if ref_weight is None else ref_bias, temperature=self.config.temperature,
                    impl=self.impl, process_group=named.get("process_group"),
                    vocab_start=named.get("vocab_start"),
                    gather_head=named.get("gather_head") if ref_weight is None else None).view(named["ids"].shape)
        return fused_linear_grpo_loss(config=self.config, impl=self.impl, **named)
