"""The per-token stage of the loss in Triton, for configurations that need no cross-token statistic: after the
log-prob sweep (``fused_loss_from_logps``), or inside it with the gradient written by the forward kernel
(``grad_in_forward_loss``, ``grpo_loss``'s default on the Triton path).

``loss_from_logps`` (the reference) remains the definition and the path for everything else: sequence-level
ratios, vespo, the off-policy and entropy masks. Here the reduction becomes per-token weights ``w`` (mask times
the loss type's normalizer), so ``loss = sum(w * l)`` and ``d loss / d logp = w * d l / d logp``, which the kernel
writes in the same pass as the loss terms and metrics.
"""
from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from .config import GRPOLossConfig
from .inputs import LogitsInputs, LossInputs
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


def _weights(batch: LossInputs, cfg: GRPOLossConfig, B: int, T: int, device):
    """(bool mask, float mask, n_valid, reduction weights w) of the batch on its (B, T) grid."""
    mask_b = torch.ones(B, T, dtype=torch.bool, device=device) if batch.mask is None else batch.mask.bool()
    mask_f = mask_b.float()
    weights = reduction_weights(mask_f, cfg.loss_type, batch.num_items_in_batch, cfg.max_completion_length)
    return mask_b, mask_f, mask_f.sum(), weights.contiguous()


def _metrics(sums, entropy_sum, count, batch: LossInputs, cfg: GRPOLossConfig, device) -> dict:
    """The metrics dict from the per-token kernels' sums (token_loss_kernels' six) and the masked entropy sum."""
    with torch.no_grad():
        ratio = (sums / count).float()
        metrics = {
            "kl": ratio[1] if batch.ref_logps is not None else torch.zeros((), device=device),
            "entropy": (entropy_sum.detach() / count).float(),
            "clip_ratio/low_mean": ratio[2],
            "clip_ratio/high_mean": ratio[3],
            "clip_ratio/region_mean": ratio[4],
        }
        if LOSS_TABLE[cfg.loss_type].policy == "cispo":
            metrics["cispo_clip_ratio"] = ratio[5]
    return metrics


def fused_loss_from_logps(logps, entropy, batch: LossInputs, cfg: GRPOLossConfig):
    """Same contract and results as ``reference.loss_from_logps`` when ``per_token_gradient_known(cfg)``."""
    assert per_token_gradient_known(cfg), "the Triton per-token stage needs a token-local configuration"
    B, T = logps.shape
    mask_b, mask_f, n_valid, weights = _weights(batch, cfg, B, T, logps.device)
    loss, sums = _FusedTokenLoss.apply(logps, batch.old_logps, batch.ref_logps, batch.advantages, batch.is_ratio,
                                       mask_f, weights, cfg, LOSS_TABLE[cfg.loss_type].policy_kind)
    masked_entropy_sum = torch.where(mask_b, entropy, 0.0).sum()
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * masked_entropy_sum / n_valid.clamp(min=1)
    return loss, _metrics(sums, masked_entropy_sum, n_valid.clamp(min=1).double(), batch, cfg, logps.device)


class _GradInForwardLoss(torch.autograd.Function):
    """logits -> loss, with d loss / d logits computed by the forward kernel; backward scales it by grad_output."""

    @staticmethod
    def forward(ctx, logits, ids, batch, mask_f, weights, n_valid, cfg, inplace):
        from .kernels.logits_loss_kernels import grad_in_forward  # lazy: creates the Triton kernel
        count = n_valid.clamp(min=1)
        h_scale = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / count).float().reshape(1)
        dlogits, terms = grad_in_forward(logits, ids, mask_f, weights, batch.old_logps, batch.ref_logps,
                                         batch.advantages, batch.is_ratio, h_scale, cfg,
                                         LOSS_TABLE[cfg.loss_type].policy_kind, inplace)
        sums = terms.sum(0, dtype=torch.float64)  # no fp64 copy of the terms; deterministic
        ctx.dlogits, ctx.mask_f = dlogits, mask_f
        ctx.mark_non_differentiable(sums)
        loss = sums[0] if cfg.entropy_coef == 0.0 else sums[0] - cfg.entropy_coef * sums[6] / count.double()
        loss = loss.float()
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        if ctx.dlogits is None:
            raise RuntimeError("grpo_loss(grad_in_forward=True) computed its gradient once, in the forward; a second "
                               "backward (retain_graph=True) needs grad_in_forward=False")
        from .kernels.logits_loss_kernels import scale_dlogits_
        dlogits, ctx.dlogits = ctx.dlogits, None  # dropped here so that autograd can take the buffer as .grad
        scale_dlogits_(dlogits, grad_loss, ctx.mask_f)
        return dlogits.view(dlogits.shape), None, None, None, None, None, None, None


def grad_in_forward_applies(inputs: LogitsInputs, cfg: GRPOLossConfig) -> bool:
    """Whether ``grpo_loss`` computes its gradient in the forward kernel: Triton, ``cfg.grad_in_forward``, a
    configuration whose per-token gradient is known once the row is swept, and a gradient actually wanted."""
    return (inputs.impl == "triton" and cfg.grad_in_forward and per_token_gradient_known(cfg)
            and torch.is_grad_enabled() and inputs.logits.requires_grad and inputs.ids.numel() > 0)


def grad_in_forward_loss(inputs: LogitsInputs, batch: LossInputs, cfg: GRPOLossConfig, inplace: bool):
    """(loss, metrics) of ``grpo_loss`` from one kernel that also writes d logits (into the logits buffer when
    ``inplace``: the logits hold d logits as soon as this returns)."""
    B, T = inputs.ids.shape
    _, mask_f, n_valid, weights = _weights(batch, cfg, B, T, inputs.logits.device)
    loss, sums = _GradInForwardLoss.apply(inputs.logits, inputs.ids, batch, mask_f.contiguous(), weights, n_valid,
                                          cfg, bool(inplace))
    return loss, _metrics(sums[:6], sums[6], n_valid.clamp(min=1).double(), batch, cfg, inputs.logits.device)
