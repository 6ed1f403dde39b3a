"""The per-token stage of the loss: from per-token log-probs and entropies (B, T) to the loss and its metrics.

Two implementations of one contract, chosen by the planner (``Plan.token_stage``): ``reference.loss_from_logps``,
the definition, for every configuration; and, for configurations whose per-token gradient is known once the
reduction weights are (``loss_types.per_token_gradient_known``), one Triton kernel that writes the loss terms, the
metrics' sums and ``d loss / d logp = w * d l / d logp`` in one pass (``kernels/token_loss_kernels.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from . import ops
from .config import GRPOLossConfig
from .inputs import LossInputs, TokenWeights
from .loss_types import LOSS_TABLE
from .metrics import LOSS, metrics_from_sums
from .reference import loss_from_logps


@dataclass(frozen=True)
class TokenStageParams:
    """The non-differentiable inputs of ``_TokenStage``."""

    batch: LossInputs
    weights: TokenWeights
    cfg: GRPOLossConfig


class _TokenStage(torch.autograd.Function):
    """logps (B, T) -> (loss, term sums); the kernel's gradient is saved and scaled in the backward."""

    @staticmethod
    def forward(ctx, logps, params: TokenStageParams):
        from .kernels.token_loss_kernels import token_loss_forward  # lazy: creates the Triton kernel
        batch, cfg = params.batch, params.cfg
        grad, sums = token_loss_forward(logps, batch.old_logps, batch.ref_logps, batch.advantages, batch.is_ratio,
                                        params.weights.mask_f, params.weights.weights, cfg,
                                        LOSS_TABLE[cfg.loss_type].policy_kind)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(sums)
        return sums[LOSS].to(torch.float32), sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None


def loss_from_token_logprobs(logps, entropy, batch: LossInputs, cfg: GRPOLossConfig, stage: str):
    """(loss, metrics) from per-token log-probs and entropies; ``stage`` "triton" or "reference" (the plan's)."""
    if stage != "triton":
        return loss_from_logps(logps, batch.advantages, mask=batch.mask, old_logps=batch.old_logps,
                               ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=entropy,
                               num_items_in_batch=batch.num_items_in_batch, sampling_logps=batch.sampling_logps,
                               config=cfg)
    B, T = logps.shape
    weights = batch.token_weights(cfg, B, T, logps.device)
    params = TokenStageParams(batch, weights, cfg)
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op (ops.py) does
        loss, sums = ops.token_stage(logps, params)
    else:
        loss, sums = _TokenStage.apply(logps, params)
    masked_entropy_sum = torch.where(weights.mask_b, entropy, 0.0).sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * masked_entropy_sum / weights.count
    return loss, metrics_from_sums(sums, masked_entropy_sum, weights.count, batch.ref_logps is not None,
                                   cfg.loss_type)
