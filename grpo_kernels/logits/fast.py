"""``grpo_loss``'s fast path (``planner.LOGITS_FAST``): one Triton kernel per row computes the logsumexp, the
per-token loss terms and their gradient, and rewrites the row as d logits in the forward; the backward only
scales them by the incoming gradient (docs/kernels.md, "Logits path"). The soft cap (``cfg.softcap``) travels in the
config to ``grad_in_forward``, whose kernel caps every logit it reads and applies the cap's derivative to d logits.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..config import GRPOLossConfig
from ..inputs import LogitsInputs, LossInputs, LossTokens, TokenWeights
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
    """logits -> (loss, term sums), with d loss / d logits computed by the forward kernel (``params.cfg`` carries
    the temperature and the soft cap to it)."""

    @staticmethod
    def forward(ctx, logits, params: LogitsFastParams):
        from ..kernels.logits_loss_kernels import grad_in_forward  # lazy: creates the Triton kernel
        cfg, batch, weights = params.cfg, params.batch, params.weights
        h_scale = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / weights.count).float().reshape(1)
        dlogits, terms = grad_in_forward(logits, params.ids, LossTokens.of(batch, weights), h_scale, cfg,
                                         LOSS_TABLE[cfg.loss_type].policy_kind, params.inplace)
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


@custom_op("grpo_kernels::logits_loss_fast", mutates_args=())
def _logits_loss_fast(logits: torch.Tensor, ids: torch.Tensor, mask_f: torch.Tensor, weights: torch.Tensor,
                      old_logps: Optional[torch.Tensor], ref_logps: Optional[torch.Tensor], advantages: torch.Tensor,
                      is_ratio: Optional[torch.Tensor], count: torch.Tensor, loss_type: str, beta: float,
                      epsilon_low: float, epsilon_high: float, delta: Optional[float], temperature: float,
                      use_bias_correction_kl: bool, sapo_temperature_pos: float, sapo_temperature_neg: float,
                      entropy_coef: float,
                      softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss fp32 0-dim, term sums fp64 (N_TERMS,), d logits of the loss) from the ``logits.fast`` row kernel;
    count: the 0-dim valid-token count (>= 1) of the entropy bonus; softcap: None or the logits' cap (in ``cfg``)."""
    from ..kernels.logits_loss_kernels import grad_in_forward
    from ..metrics import ENTROPY, LOSS
    cfg = ops.config_from_args(loss_type, beta, epsilon_low, epsilon_high, delta, temperature,
                               use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, entropy_coef,
                               softcap)
    h_scale = None if entropy_coef == 0.0 else (-entropy_coef / count).float().reshape(1)
    tokens = LossTokens(advantages, mask_f.contiguous(), weights, old_logps, ref_logps, is_ratio)
    dlogits, terms = grad_in_forward(logits, ids, tokens, h_scale, cfg, LOSS_TABLE[loss_type].policy_kind, False)
    sums = terms.sum(0, dtype=torch.float64)
    loss = sums[LOSS]
    if entropy_coef != 0.0:
        loss = loss - entropy_coef * sums[ENTROPY] / count.double()
    return loss.float(), sums, dlogits.contiguous()


@_logits_loss_fast.register_fake
def _(logits, ids, mask_f, weights, old_logps, ref_logps, advantages, is_ratio, count, *cfg):
    from ..kernels.logits_loss_kernels import N_TERMS
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty((N_TERMS,), dtype=torch.float64),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


def _fast_backward(ctx, grad_loss, _grad_sums, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    # the scale in fp32, one rounding to the logits' dtype (as the eager scale kernel)
    return ops.grads_for_inputs(ctx, (dlogits.float() * grad_loss).to(dlogits.dtype))


_logits_loss_fast.register_autograd(_fast_backward, setup_context=ops.setup_saving_gradient_output)


def _compiled_loss(logits, params):
    """``_LogitsLossInForward`` through the registered op (under torch.compile): (loss, term sums)."""
    w = params.weights
    loss, sums, _ = _logits_loss_fast(logits, params.ids, w.mask_f, w.weights, params.batch.old_logps,
                                      params.batch.ref_logps, params.batch.advantages, params.batch.is_ratio,
                                      w.count, **ops.config_args(params.cfg))
    return loss, sums


def logits_loss_in_forward(inputs: LogitsInputs, batch: LossInputs, cfg: GRPOLossConfig, inplace: bool):
    """(loss, metrics) of ``grpo_loss`` from one kernel that also writes d logits (into the logits buffer when
    ``inplace``: the logits hold d logits as soon as this returns)."""
    B, T = inputs.ids.shape
    weights = batch.token_weights(cfg, B, T, inputs.logits.device)
    params = LogitsFastParams(inputs.ids, batch, weights, cfg, bool(inplace))
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op does
        loss, sums = _compiled_loss(inputs.logits, params)
    else:
        loss, sums = _LogitsLossInForward.apply(inputs.logits, params)
    return loss, metrics_from_sums(sums, sums[ENTROPY], weights.count, batch.ref_logps is not None, cfg.loss_type)
