"""The fused head's fast paths: the loss and its gradients computed in the forward pass (``head.fast`` and
``head.fast_sequence``, docs/kernels.md "Fused head").

``head.fast``: for every configuration whose per-token gradient is known once a token's log-prob is, the
reduction is a per-token weight known before the sweep, so each row chunk goes logits (cuBLAS, fp32) -> fold, loss
terms and d logits (one Triton epilogue) -> dH, dW, dbias (cuBLAS): 6NHV instead of the light path's 8NHV, 4NHV for
a frozen head (``kernels/linear_epilogue_kernels.py``). The backward only scales the stored gradients by the
incoming gradient.

``head.fast_sequence``: configurations whose per-token gradient needs only its own sequence (GSPO's sequence
ratio, vespo's row weights, the off-policy row mask) take the same route with chunks of whole sequences: per chunk
the fold kernel gives log-probs and entropies, autograd through the reference loss on the chunk's sequences gives
their gradients, and the d-logits epilogue and GEMMs follow.

A soft cap (``cfg.softcap``, Gemma 2's ``final_logit_softcapping``) is applied by the epilogue kernels themselves,
before the temperature, in the fold and in the d-logits sweep (which multiplies by its derivative): the GEMMs see
raw logits and raw-logit gradients, so nothing here changes but the option passed on.

The head runs on the tensors as given: under autocast the Function casts hidden / weight to the compute dtype
itself, so that an fp32 (master) weight's gradient accumulates straight into its fp32 gradient (no second V x H
buffer); a half-precision weight's gradient accumulates in an fp32 buffer and is handed out rounded once.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..config import GRPOLossConfig
from ..inputs import HeadInputs, HeadTokens, LossInputs, ValidRows
from ..loss_types import LOSS_TABLE, reduction_weights
from ..metrics import metrics_from_sums
from ..reference import loss_from_logps


@dataclass(frozen=True)
class FastParams:
    """The non-differentiable inputs of the fast paths' Functions: the compute dtype, the loss options ``cfg``
    (temperature and soft cap included, read by the kernels' launchers) and, per path, the row chunking (``rows``),
    the per-token inputs (``tokens``) or the sequence chunks and their gradients."""

    dtype: torch.dtype
    cfg: GRPOLossConfig
    rows: int = 0
    tokens: HeadTokens | None = None
    entropy_scale: object = None
    bounds: tuple = ()
    token_grads: object = None
    grad_ids: torch.Tensor | None = None


def _compute_dtype(ctx, hidden, weight, bias, dtype):
    """hidden / weight / bias in the compute dtype (copies only where needed), and which gradients are wanted."""
    needs = [bool(n) and t is not None for n, t in zip(ctx.needs_input_grad[:3], (hidden, weight, bias))]
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    cast = [None if t is None else t.to(dtype) for t in (hidden, weight, bias)]
    return cast, needs


def _hand_out(ctx, grad_loss):
    """The gradients stored by a gradient-in-forward pass, scaled by the incoming gradient of the loss."""
    # Why only a scale: the forward already holds d loss / d (hidden, weight, bias) at grad_loss = 1.
    if ctx.grads is None:
        raise RuntimeError("fused_linear_grpo_loss computed its gradients in the forward and has already handed "
                           "them out (a second backward through the same graph, e.g. retain_graph=True): pass "
                           "grad_in_forward=False for repeated backward passes")
    out = []
    for grad, dtype in zip(ctx.grads, ctx.dtypes):
        if grad is None:
            out.append(None)
        elif grad.dtype == dtype:
            out.append(grad.mul_(grad_loss.to(grad.device)))  # in place: no second buffer
        else:
            scaled = torch.empty(grad.shape, dtype=dtype, device=grad.device)
            torch.mul(grad, grad_loss.to(grad.device), out=scaled)  # one rounding from the fp32 accumulator
            out.append(scaled)
    ctx.grads = None  # handed out (and partly scaled in place): release them with this backward
    return out


class _HeadLossInForward(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids) -> (loss, term sums); the gradients are made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, p: FastParams):
        from ..kernels.linear_epilogue_kernels import head_loss_and_grads  # lazy: creates the Triton kernels
        (h, w, b), needs = _compute_dtype(ctx, hidden, weight, bias, p.dtype)
        with torch.autocast(hidden.device.type, enabled=False):  # fp32 accumulation is the kernels' own
            logp, ent, terms, dh, dw32, db32 = head_loss_and_grads(
                h, w, b, ids, p.tokens, p.cfg, LOSS_TABLE[p.cfg.loss_type].policy_kind, p.rows, *needs)
        del h, w, b  # the compute-dtype copies (an fp32 master weight's bf16 copy) go before the backward
        # Fixed-order fp64 sums of the per-token terms: deterministic, and no precision lost over many tokens.
        sums = torch.cat([terms.double().sum(0), ent.double().sum().reshape(1)])
        loss = sums[0] - p.cfg.entropy_coef * sums[-1] * p.entropy_scale
        ctx.grads = (None if dh is None else dh.to(hidden.dtype), dw32, db32)
        ctx.mark_non_differentiable(sums)
        return loss.float(), sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        return (*_hand_out(ctx, grad_loss), None, None)


def _per_token(x, B: int, T: int, rows: ValidRows):
    """A (B,), (B, 1) or (B, T) tensor as fp32 contiguous values at the valid tokens."""
    if x is None:
        return None
    x = x.float()
    x = x.reshape(B, 1).expand(B, T) if x.dim() == 1 or x.shape[-1] == 1 else x
    (x,) = rows.compact(x.reshape(-1))
    return x.contiguous()


@custom_op("grpo_kernels::head_loss_fast", mutates_args=())
def _head_loss_fast(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                    row_mask: Optional[torch.Tensor], adv: torch.Tensor, w: torch.Tensor,
                    old: Optional[torch.Tensor], ref: Optional[torch.Tensor], isr: Optional[torch.Tensor],
                    ge: Optional[torch.Tensor], entropy_scale: torch.Tensor,
                    dtype: torch.dtype, rows: int, need_hidden: bool, need_weight: bool, need_bias: bool,
                    loss_type: str, beta: float, epsilon_low: float, epsilon_high: float, delta: Optional[float],
                    temperature: float, use_bias_correction_kl: bool, sapo_temperature_pos: float,
                    sapo_temperature_neg: float, entropy_coef: float,
                    softcap: Optional[float]) -> tuple[torch.Tensor, torch.Tensor,
                                                                               torch.Tensor, torch.Tensor,
                                                                               torch.Tensor]:
    """(loss, term sums fp64, d hidden, d weight fp32, d bias fp32) of ``head.fast`` at an incoming gradient of 1;
    a gradient not wanted is an empty (0,) tensor."""
    from ..kernels.linear_epilogue_kernels import head_loss_and_grads
    cfg = ops.config_from_args(loss_type, beta, epsilon_low, epsilon_high, delta, temperature,
                               use_bias_correction_kl, sapo_temperature_pos, sapo_temperature_neg, entropy_coef,
                               softcap)
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    hidden_rows, ids, adv, w, old, ref, isr = ops.take_rows(index, hidden, ids, adv, w, old, ref, isr)
    tokens = HeadTokens(adv=adv, w=w, old=old, ref=ref, isr=isr, ge=ge)
    need_bias = need_bias and bias is not None
    h, wt, b = (None if t is None else t.to(dtype) for t in (hidden_rows, weight, bias))
    with torch.autocast(hidden.device.type, enabled=False):
        _logp, ent, terms, dh, dw32, db32 = head_loss_and_grads(h, wt, b, ids, tokens, cfg,
                                                                 LOSS_TABLE[loss_type].policy_kind, rows,
                                                                 need_hidden, need_weight, need_bias)
    sums = torch.cat([terms.double().sum(0), ent.double().sum().reshape(1)])
    loss = (sums[0] - entropy_coef * sums[-1] * entropy_scale).float()
    empty = hidden.new_empty((0,))
    dh = empty if dh is None else ops.put_rows(index, N, dh.to(hidden.dtype))
    return loss, sums, dh, empty if dw32 is None else dw32, empty if db32 is None else db32


@_head_loss_fast.register_fake
def _(hidden, weight, bias, ids, row_mask, adv, w, old, ref, isr, ge, entropy_scale, dtype, rows, need_hidden,
      need_weight, need_bias, *cfg):
    from ..kernels.linear_epilogue_kernels import N_ROW_TERMS
    empty = hidden.new_empty((0,))
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32), hidden.new_empty((N_ROW_TERMS + 1,), dtype=torch.float64),
            torch.empty_like(hidden) if need_hidden else empty,
            weight.new_empty(weight.shape, dtype=f32) if need_weight else empty,
            bias.new_empty(bias.shape, dtype=f32) if need_bias and bias is not None else empty)


def _head_fast_setup(ctx, inputs, output):
    ctx.n_inputs = len(inputs)
    hidden, weight, bias = inputs[:3]
    ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.save_for_backward(*output[2:])
    ctx.mark_non_differentiable(*output[1:])


def _head_fast_backward(ctx, grad_loss, *_unused):
    grads = []
    for g, dtype, need in zip(ctx.saved_tensors, ctx.dtypes, ctx.needs_input_grad[:3]):
        # one rounding from the fp32 accumulator, as the eager hand-out
        grads.append((g * grad_loss).to(dtype) if need and dtype is not None else None)
    return ops.grads_for_inputs(ctx, *grads)


_head_loss_fast.register_autograd(_head_fast_backward, setup_context=_head_fast_setup)


def _compiled_head_loss(hidden, weight, bias, ids, row_mask, params, needs):
    """``_HeadLossInForward`` through the registered op (under torch.compile): (loss, term sums); row_mask:
    ``ValidRows.deferred``; needs: (hidden, weight, bias) gradient wanted."""
    t = params.tokens
    loss, sums, *_ = _head_loss_fast(hidden, weight, bias, ids, row_mask, t.adv, t.w, t.old, t.ref,
                                     t.isr, t.ge, params.entropy_scale, params.dtype, params.rows, *needs,
                                     **ops.config_args(params.cfg))
    return loss, sums


def head_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, plan, rows: ValidRows):
    """(loss, metrics) of ``fused_linear_grpo_loss`` on ``head.fast``: chunks of ``plan.chunk_rows`` valid tokens."""
    B, T = inputs.shape
    weights = batch.token_weights(cfg, B, T, inputs.hidden.device)
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    # d loss / d entropy of every valid token: loss = ... - entropy_coef * sum(entropy) / n_valid
    ge = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / weights.count).reshape(1).float()
    tokens = HeadTokens(adv=_per_token(batch.advantages, B, T, rows), w=_per_token(weights.weights, B, T, rows),
                        old=_per_token(batch.old_logps, B, T, rows), ref=_per_token(batch.ref_logps, B, T, rows),
                        isr=_per_token(batch.is_ratio, B, T, rows), ge=ge)
    params = FastParams(inputs.dtype, cfg, rows=plan.chunk_rows, tokens=tokens,
                        entropy_scale=1.0 / weights.count.double())
    if torch.compiler.is_compiling():  # the Function does not trace: its registered op does
        wants = torch.is_grad_enabled()
        needs = tuple(wants and t is not None and t.requires_grad for t in (hidden, inputs.weight, inputs.bias))
        loss, sums = _compiled_head_loss(hidden, inputs.weight, inputs.bias, ids, rows.deferred, params, needs)
    else:
        loss, sums = _HeadLossInForward.apply(hidden, inputs.weight, inputs.bias, ids, params)
    return loss, metrics_from_sums(sums, sums[-1], weights.count, batch.ref_logps is not None, cfg.loss_type)


class _HeadSequenceGradsInForward(torch.autograd.Function):
    """(hidden, weight, bias, ids) -> (anchor, logp, entropy): the gradients are made in forward and handed out
    by the backward of ``anchor``, a 0 added to the loss (whose value comes from the reference on logp, entropy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, p: FastParams):
        from ..kernels.linear_epilogue_kernels import head_sequence_grads  # lazy: creates the Triton kernels
        (h, w, b), needs = _compute_dtype(ctx, hidden, weight, bias, p.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, ent, dh, dw32, db32 = head_sequence_grads(h, w, b, ids, list(p.bounds), p.token_grads,
                                                            p.cfg.temperature, *needs, grad_ids=p.grad_ids,
                                                            softcap=p.cfg.softcap)
        del h, w, b
        ctx.grads = (None if dh is None else dh.to(hidden.dtype), dw32, db32)
        ctx.mark_non_differentiable(logp, ent)
        return torch.zeros((), dtype=torch.float32, device=hidden.device), logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_anchor, _grad_logp, _grad_ent):
        return (*_hand_out(ctx, grad_anchor), None, None)


def head_sequence_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, plan,
                                  rows: ValidRows, shard_view=None):
    """(loss, metrics) on ``head.fast_sequence`` (or, with ``shard_view``, ``head.fast_vocab_parallel``), chunks of
    whole sequences from the plan.

    Per chunk, d loss / d logp and d loss / d entropy come from autograd through the reference loss on those
    sequences alone (one definition of the maths), rescaled from the sub-batch's reduction weights to the batch's:
    within a sequence every reduction weights its tokens alike, so the rescale is exact.

    shard_view (a vocabulary shard, ``distributed/vocab_parallel.py``): ``shard_view(hidden, ids)`` -> (hidden whose
    gradient is summed over the ranks, ids clamped into the shard, one-hot ids (-1 where another rank owns the id),
    ``combine(r0, r1, logp, lse, entropy)`` turning a chunk's shard statistics into whole-vocabulary ones in place).
    With ``cfg.softcap`` the fold kernel's (logp, lse, entropy) are already those of the capped logits, so the combine
    (which works on them alone) and the d-logits epilogue (which recomputes the cap) need nothing more."""
    B, T = inputs.shape
    dev = inputs.hidden.device
    weights = batch.token_weights(cfg, B, T, dev)
    mask_b = weights.mask_b
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    grad_ids = combine = None
    if shard_view is not None:
        hidden, ids, grad_ids, combine = shard_view(hidden, ids)
    sequences_of = {r0: (b0, b1) for b0, b1, r0, _ in plan.sequence_chunks}
    bounds = (0,) + tuple(r1 for *_, r1 in plan.sequence_chunks)

    def rows_of(x, b0, b1):
        return None if x is None else x[b0:b1]

    def token_grads(r0, r1, logp, lse, ent):
        if combine is not None:
            combine(r0, r1, logp, lse, ent)
        b0, b1 = sequences_of[r0]
        sub_mask = mask_b[b0:b1]
        with torch.enable_grad():
            x = torch.zeros(sub_mask.shape, dtype=torch.float32, device=dev)
            x[sub_mask] = logp
            x.requires_grad_(True)
            e = None
            if cfg.entropy_coef != 0.0:
                e = torch.zeros(sub_mask.shape, dtype=torch.float32, device=dev)
                e[sub_mask] = ent
                e.requires_grad_(True)
            sub_loss, _ = loss_from_logps(x, batch.advantages[b0:b1], sub_mask,
                                          old_logps=rows_of(batch.old_logps, b0, b1),
                                          ref_logps=rows_of(batch.ref_logps, b0, b1),
                                          is_ratio=rows_of(batch.is_ratio, b0, b1), entropy=e,
                                          num_items_in_batch=None,
                                          sampling_logps=rows_of(batch.sampling_logps, b0, b1), config=cfg)
            grads = torch.autograd.grad(sub_loss, [x] if e is None else [x, e])
        sub_w = reduction_weights(sub_mask.float(), cfg.loss_type, None, cfg.max_completion_length)
        scale = (weights.weights[b0:b1][sub_mask] / sub_w[sub_mask])
        g = grads[0][sub_mask] * scale
        g_h = None if e is None else grads[1][sub_mask] * (sub_mask.sum().clamp(min=1) / weights.count)
        return g.float(), None if g_h is None else g_h.float()

    params = FastParams(inputs.dtype, cfg, bounds=bounds, token_grads=token_grads, grad_ids=grad_ids)
    anchor, logp, ent = _HeadSequenceGradsInForward.apply(hidden, inputs.weight, inputs.bias, ids, params)
    logp, ent = rows.scatter(logp, ent)
    with torch.no_grad():
        loss, metrics = loss_from_logps(logp.view(B, T), batch.advantages, batch.mask, old_logps=batch.old_logps,
                                        ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=ent.view(B, T),
                                        num_items_in_batch=batch.num_items_in_batch,
                                        sampling_logps=batch.sampling_logps, config=cfg)
    return loss.float() + anchor, metrics
