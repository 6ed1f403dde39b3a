"""The per-token stage of the loss in one Triton kernel, for configurations that need no cross-token statistic.

``loss_from_logps`` (the reference) remains the definition and the path for everything else: sequence-level
ratios, vespo, the off-policy and entropy masks. Here the reduction becomes per-token weights ``w`` (mask times
the loss type's normalizer), so ``loss = sum(w * l)`` and ``d loss / d logp = w * d l / d logp``, which the kernel
writes in the same pass as the loss terms and metrics.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import GRPOLossConfig
from .inputs import LossInputs
from .loss_types import LOSS_TABLE, per_token_gradient_known, reduction_weights


class _FusedTokenLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logps, old_logps, ref_logps, advantages, is_ratio, mask_f, weights, cfg, kind):
        from .kernels.token_loss_kernels import token_loss_forward  # lazy: creates the Triton kernel
        grad, sums = token_loss_forward(logps, old_logps, ref_logps, advantages, is_ratio, mask_f, weights, cfg,
                                        kind)
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(sums)
        return sums[0].to(torch.float32), sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        (grad,) = ctx.saved_tensors
        return grad_loss * grad, None, None, None, None, None, None, None, None


def fused_loss_from_logps(logps, entropy, batch: LossInputs, cfg: GRPOLossConfig):
    """Same contract and results as ``reference.loss_from_logps`` when ``per_token_gradient_known(cfg)``."""
    assert per_token_gradient_known(cfg), "the Triton per-token stage needs a token-local configuration"
    mask, old_logps, ref_logps = batch.mask, batch.old_logps, batch.ref_logps
    advantages, is_ratio, num_items_in_batch = batch.advantages, batch.is_ratio, batch.num_items_in_batch
    B, T = logps.shape
    mask_b = torch.ones(B, T, dtype=torch.bool, device=logps.device) if mask is None else mask.bool()
    mask_f = mask_b.float()
    n_valid = mask_f.sum()
    weights = reduction_weights(mask_f, cfg.loss_type, num_items_in_batch, cfg.max_completion_length).contiguous()
    loss, sums = _FusedTokenLoss.apply(logps, old_logps, ref_logps, advantages, is_ratio, mask_f, weights, cfg,
                                       LOSS_TABLE[cfg.loss_type].policy_kind)
    masked_entropy_sum = torch.where(mask_b, entropy, 0.0).sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * masked_entropy_sum / n_valid.clamp(min=1)
    count = n_valid.clamp(min=1).double()
    with torch.no_grad():
        ratio = (sums / count).float()
        metrics = {
            "kl": ratio[1] if ref_logps is not None else torch.zeros((), device=logps.device),
            "entropy": (masked_entropy_sum.detach() / count).float(),
            "clip_ratio/low_mean": ratio[2],
            "clip_ratio/high_mean": ratio[3],
            "clip_ratio/region_mean": ratio[4],
        }
        if LOSS_TABLE[cfg.loss_type].policy == "cispo":
            metrics["cispo_clip_ratio"] = ratio[5]
    return loss, metrics
