"""``grpo_loss``'s fast path (``paths.LOGITS_FAST``): one Triton kernel per row computes the logsumexp, the
per-token loss terms and their gradient, and rewrites the row as d logits in the forward; the backward only
scales them by the incoming gradient (docs/kernels.md, "Logits path"). The logits transform (temperature, soft cap)
reaches the kernel from the validated inputs; it caps every logit it reads and applies the cap's derivative.

``loss_in_forward`` and ``hand_out`` are the path's one body (``ops.py``): the eager Function writes d logits into
the logits buffer when asked (``inplace_backward``) and scales them there in the backward; the registered op, under
torch.compile, returns d logits as an output and scales a copy.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..config import GRPOLossConfig, LogitTransform
from ..inputs import LogitsInputs, LossInputs, LossTokens
from ..loss_types import LOSS_TABLE
from ..metrics import ENTROPY, LOSS, metrics_from_sums
from ..sequences import token_sums


@ops.options_type
@dataclass(frozen=True)
class LossOptions:
    """The non-tensor inputs of the path: the loss options, the logits transform and the kernel's rows in flight
    (the plan's: ``Plan.rows_in_flight``)."""

    cfg: GRPOLossConfig
    transform: LogitTransform
    programs: int = 0


def loss_in_forward(logits, ids, tokens: LossTokens, count, o: LossOptions, inplace: bool):
    """(loss fp32 0-dim, term sums fp64, d logits of the loss at an incoming gradient of 1); count: the 0-dim
    valid-token count (>= 1) of the entropy bonus; with ``inplace`` d logits is the logits buffer itself."""
    from ..kernels.logits_loss_kernels import grad_in_forward  # lazy: creates the Triton kernel
    cfg = o.cfg
    h_scale = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / count).float().reshape(1)
    dlogits, terms = grad_in_forward(logits, ids, tokens, h_scale, cfg, o.transform,
                                     LOSS_TABLE[cfg.loss_type].policy_kind, inplace, o.programs)
    # deterministic (no fp64 copy of the terms); batch-invariant: the per-sequence trees of sequences.py
    sums = token_sums(terms, tuple(ids.shape), tokens.cu_seqlens, cfg.batch_invariant)
    loss = sums[LOSS]
    if cfg.entropy_coef != 0.0:
        loss = loss - cfg.entropy_coef * sums[ENTROPY] / count.double()
    return loss.float(), sums, dlogits


def hand_out(dlogits, grad_loss, mask_f, in_place: bool):
    """d logits scaled by the incoming gradient of the loss, in fp32 with one rounding to the logits' dtype: in
    place by the scale kernel (eager: padded rows skipped, nothing done for a gradient of 1), or into a new buffer
    (the registered op's backward, which AOTAutograd traces)."""
    if in_place:
        from ..kernels.logits_loss_kernels import scale_dlogits_
        return scale_dlogits_(dlogits, grad_loss, mask_f)
    return (dlogits.float() * grad_loss).to(dlogits.dtype)


class _LogitsLossInForward(torch.autograd.Function):
    """logits -> (loss, term sums), with d loss / d logits computed by the forward kernel."""

    @staticmethod
    def forward(ctx, logits, ids, tokens: LossTokens, count, o: LossOptions, inplace: bool):
        loss, sums, dlogits = loss_in_forward(logits, ids, tokens, count, o, inplace)
        ctx.dlogits, ctx.mask_f = dlogits, tokens.mask_f
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        if ctx.dlogits is None:
            raise RuntimeError("grpo_loss(grad_in_forward=True) computed its gradient once, in the forward; a second "
                               "backward (retain_graph=True) needs grad_in_forward=False")
        dlogits, ctx.dlogits = ctx.dlogits, None  # dropped here so that autograd can take the buffer as .grad
        dlogits = hand_out(dlogits, grad_loss, ctx.mask_f, in_place=True)
        return dlogits.view(dlogits.shape), None, None, None, None, None


@custom_op("grpo_kernels::logits_loss_fast", mutates_args=())
def _logits_loss_fast(logits: torch.Tensor, ids: torch.Tensor, tokens: list[Optional[torch.Tensor]],
                      count: torch.Tensor, floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, term sums, d logits) of ``loss_in_forward``; tokens: ``LossTokens.as_list()``; options:
    ``ops.encode(LossOptions)``."""
    loss, sums, dlogits = loss_in_forward(logits, ids, LossTokens(*tokens), count, ops.decode(LossOptions, floats, ints),
                                          inplace=False)
    return loss, sums, dlogits.contiguous()


@_logits_loss_fast.register_fake
def _(logits, ids, tokens, count, floats, ints):
    from ..kernels.logits_loss_kernels import N_TERMS
    return (logits.new_empty((), dtype=torch.float32), logits.new_empty((N_TERMS,), dtype=torch.float64),
            torch.empty_like(logits, memory_format=torch.contiguous_format))


def _fast_backward(ctx, grad_loss, _grad_sums, _grad_dlogits):
    (dlogits,) = ctx.saved_tensors
    return ops.grads_for_inputs(ctx, hand_out(dlogits, grad_loss, None, in_place=False))


_logits_loss_fast.register_autograd(_fast_backward, setup_context=ops.setup_saving_gradient_output)


def logits_loss_in_forward(inputs: LogitsInputs, batch: LossInputs, cfg: GRPOLossConfig, plan, inplace: bool):
    """(loss, metrics) of ``grpo_loss`` from one kernel that also writes d logits (into the logits buffer when
    ``inplace``: the logits hold d logits as soon as this returns), with the plan's rows in flight."""
    B, T = inputs.ids.shape
    weights = batch.token_weights(cfg, B, T, inputs.logits.device)
    tokens, o = LossTokens.of(batch, weights), LossOptions(cfg, inputs.transform, plan.rows_in_flight or 0)
    if ops.compiling():  # the Function does not trace: its registered op does
        loss, sums, _ = _logits_loss_fast(inputs.logits, inputs.ids, tokens.as_list(), weights.count, *ops.encode(o))
    else:
        loss, sums = _LogitsLossInForward.apply(inputs.logits, inputs.ids, tokens, weights.count, o, bool(inplace))
    return loss, metrics_from_sums(sums, sums[ENTROPY], weights.count, batch.ref_logps is not None, cfg.loss_type)
