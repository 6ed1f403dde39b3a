"""``grpo_loss``'s fast path (``planner.LOGITS_FAST``): one Triton kernel per row computes the logsumexp, the
per-token loss terms and their gradient, and rewrites the row as d logits in the forward; the backward only
scales them by the incoming gradient (docs/kernels.md, "Logits path").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from .. import ops
from ..config import GRPOLossConfig
from ..inputs import LogitsInputs, LossInputs, TokenWeights
from ..loss_types import LOSS_TABLE
from ..metrics import ENTROPY, LOSS, metrics_from_sums


@dataclass(frozen=True)
class LogitsFastParams:
    """The non-differentiable inputs of ``_LogitsLossInForward``."""

    ids: torch.Tensor
    batch: LossInputs
    weights: TokenWeights
    cfg: GRPOLossConfig
    inplace: bool


class _LogitsLossInForward(torch.autograd.Function):
    """logits -> (loss, term sums), with d loss / d logits computed by the forward kernel."""

    @staticmethod
    def forward(ctx, logits, params: LogitsFastParams):
        from ..kernels.logits_loss_kernels import grad_in_forward  # lazy: creates the Triton kernel
        cfg, batch, weights = params.cfg, params.batch, params.weights
        h_scale = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / weights.count).float().reshape(1)
        dlogits, terms = grad_in_forward(logits, params.ids, weights.mask_f.contiguous(), weights.weights,
                                         batch.old_logps, batch.ref_logps, batch.advantages, batch.is_ratio, h_scale,
                                         cfg, LOSS_TABLE[cfg.loss_type].policy_kind, params.inplace)
        sums = terms.sum(0, dtype=torch.float64)  # no fp64 copy of the terms; deterministic
        ctx.dlogits, ctx.mask_f = dlogits, weights.mask_f
        ctx.mark_non_differentiable(sums)
        loss = sums[LOSS]
        if cfg.entropy_coef != 0.0:
            loss = loss - cfg.entropy_coef * sums[ENTROPY] / weights.count.double()
        return loss.float(), sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        if ctx.dlogits is None:
            raise RuntimeError("grpo_loss(grad_in_forward=True) computed its gradient once, in the forward; a second "
                               "backward (retain_graph=True) needs grad_in_forward=False")
        from ..kernels.logits_loss_kernels import scale_dlogits_
        dlogits, ctx.dlogits = ctx.dlogits, None  # dropped here so that autograd can take the buffer as .grad
        scale_dlogits_(dlogits, grad_loss, ctx.mask_f)
        return dlogits.view(dlogits.shape), None


def logits_loss_in_forward(inputs: LogitsInputs, batch: LossInputs, cfg: GRPOLossConfig, inplace: bool):
    """(loss, metrics) of ``grpo_loss`` from one kernel that also writes d logits (into the logits buffer when
    ``inplace``: the logits hold d logits as soon as this returns)."""
    B, T = inputs.ids.shape
    weights = batch.token_weights(cfg, B, T, inputs.logits.device)
    params = LogitsFastParams(inputs.ids, batch, weights, cfg, bool(inplace))
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op (ops.py) does
        loss, sums = ops.logits_loss_fast(inputs.logits, params)
    else:
        loss, sums = _LogitsLossInForward.apply(inputs.logits, params)
    return loss, metrics_from_sums(sums, sums[ENTROPY], weights.count, batch.ref_logps is not None, cfg.loss_type)
