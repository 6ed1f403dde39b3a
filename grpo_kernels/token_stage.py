"""The per-token stage of the loss: from per-token log-probs and entropies (B, T) to the loss and its metrics.

Two implementations of one contract, chosen by the planner (``Plan.token_stage``): ``reference.loss_from_logps``,
the definition, for every configuration; and, for configurations whose per-token gradient is known once the
reduction weights are (``loss_types.per_token_gradient_known``), one Triton kernel that writes the loss terms, the
metrics' sums and ``d loss / d logp = w * d l / d logp`` in one pass (``kernels/token_loss_kernels.py``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from . import ops
from .config import GRPOLossConfig
from .inputs import LossInputs, LossTokens
from .loss_types import LOSS_TABLE
from .metrics import LOSS, metrics_from_sums
from .reference import loss_from_logps


def token_stage(logps, tokens: LossTokens, cfg: GRPOLossConfig):
    """(loss fp32 0-dim before the entropy bonus, term sums fp64, d loss / d logps (B, T) fp32) of the Triton
    per-token stage: the path's one body (``ops.py``)."""
    from .kernels.token_loss_kernels import token_loss_forward  # lazy: creates the Triton kernel
    grad, sums = token_loss_forward(logps, tokens, cfg, LOSS_TABLE[cfg.loss_type].policy_kind)
    return sums[LOSS].to(torch.float32), sums, grad


class _TokenStage(torch.autograd.Function):
    """logps (B, T) -> (loss, term sums); the kernel's gradient is saved and scaled in the backward."""

    @staticmethod
    def forward(ctx, logps, tokens: LossTokens, cfg: GRPOLossConfig):
        loss, sums, grad = token_stage(logps, tokens, cfg)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None


@custom_op("grpo_kernels::token_stage", mutates_args=())
def _token_stage(logps: torch.Tensor, tokens: list[Optional[torch.Tensor]],
                 floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_stage``; tokens: ``LossTokens.as_list()``; floats, ints: ``ops.encode(cfg)``."""
    return token_stage(logps, LossTokens(*tokens), ops.decode(GRPOLossConfig, floats, ints))


@_token_stage.register_fake
def _(logps, tokens, floats, ints):
    from .kernels.token_loss_kernels import N_SUMS
    return (logps.new_empty((), dtype=torch.float32), logps.new_empty((N_SUMS,), dtype=torch.float64),
            logps.new_empty(logps.shape, dtype=torch.float32))


def _stage_backward(ctx, grad_loss, _grad_sums, _grad_grad):
    (grad,) = ctx.saved_tensors
    return ops.grads_for_inputs(ctx, grad_loss * grad)


_token_stage.register_autograd(_stage_backward, setup_context=ops.setup_saving_gradient_output)


def loss_from_token_logprobs(logps, entropy, batch: LossInputs, cfg: GRPOLossConfig, stage: str):
    """(loss, metrics) from per-token log-probs and entropies; ``stage`` "triton" or "reference" (the plan's)."""
    if stage != "triton":
        return loss_from_logps(logps, batch.advantages, mask=batch.mask, old_logps=batch.old_logps,
                               ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=entropy,
                               num_items_in_batch=batch.num_items_in_batch, sampling_logps=batch.sampling_logps,
                               config=cfg, sequences=batch.seqs)
    B, T = logps.shape
    weights = batch.token_weights(cfg, B, T, logps.device)
    tokens = LossTokens.of(batch, weights)
    if ops.compiling():  # the Function does not trace: its registered op does
        loss, sums, _ = _token_stage(logps, tokens.as_list(), *ops.encode(cfg))
    else:
        loss, sums = _TokenStage.apply(logps, tokens, cfg)
    masked_entropy_sum = torch.where(weights.mask_b, entropy, 0.0).sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * masked_entropy_sum / weights.count
    return loss, metrics_from_sums(sums, masked_entropy_sum, weights.count, batch.ref_logps is not None,
                                   cfg.loss_type)
