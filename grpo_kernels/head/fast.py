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

The logits transform (the inputs' temperature and soft cap, Gemma 2's ``final_logit_softcapping``) is applied by the
epilogue kernels themselves, the cap before the temperature, in the fold and in the d-logits sweep (which multiplies
by the cap's derivative): the GEMMs see raw logits and raw-logit gradients.

``fast_loss`` and ``hand_out`` are ``head.fast``'s one body (``ops.py``): the eager Function keeps the gradients
and scales them in place when it hands them out; the registered op (torch.compile) returns them as outputs and
scales copies. ``head.fast_sequence`` runs Python per chunk of sequences and is eager only.

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
from ..config import GRPOLossConfig, LogitTransform
from ..inputs import HeadInputs, HeadTokens, LossInputs, ValidRows
from ..loss_types import LOSS_TABLE, reduction_weights
from ..metrics import metrics_from_sums
from ..reference import loss_from_logps
from ..sequences import token_sums


@ops.options_type
@dataclass(frozen=True)
class FastOptions:
    """The non-tensor inputs of ``head.fast``: the compute dtype, the loss options, the logits transform, the rows
    per chunk, and the call's (B, T) token grid (which the batch-invariant term sums follow)."""

    dtype: torch.dtype
    cfg: GRPOLossConfig
    transform: LogitTransform
    rows: int
    grid_rows: int = 0
    grid_cols: int = 0


def _in_compute_dtype(dtype, *tensors):
    """The tensors in the compute dtype (copies only where needed; None stays None)."""
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def fast_loss(hidden, weight, bias, ids, tokens: HeadTokens, entropy_scale, needs: tuple, o: FastOptions,
              positions=None):
    """(loss fp32 0-dim, term sums fp64, d hidden in hidden's dtype | None, d weight fp32 | None, d bias fp32 | None)
    of ``head.fast`` at an incoming gradient of 1: the path's one body (``ops.py``). hidden / weight / bias are cast
    to ``o.dtype`` here, so that an fp32 (master) weight's gradient is the fp32 accumulator itself; the copies are
    freed before this returns. positions: the flat grid positions of the (compacted) rows, None when they are the
    whole grid (the batch-invariant sums place each row's terms back on the grid)."""
    from ..kernels.linear_epilogue_kernels import head_loss_and_grads  # lazy: creates the Triton kernels
    h, w, b = _in_compute_dtype(o.dtype, hidden, weight, bias)
    with torch.autocast(hidden.device.type, enabled=False):  # fp32 accumulation is the kernels' own
        _logp, ent, terms, dh, dw32, db32 = head_loss_and_grads(
            h, w, b, ids, tokens, o.cfg, o.transform, LOSS_TABLE[o.cfg.loss_type].policy_kind, o.rows, needs)
    del h, w, b  # the compute-dtype copies (an fp32 master weight's bf16 copy) go before the backward
    # Fixed-order fp64 sums of the per-token terms: deterministic, and no precision lost over many tokens;
    # batch-invariant: the per-sequence trees over the call's grid (sequences.token_sums)
    per_token = torch.cat([terms, ent.reshape(-1, 1)], 1)
    if o.cfg.batch_invariant:
        grid = (o.grid_rows, o.grid_cols)
        if positions is not None:
            per_token = per_token.new_zeros((grid[0] * grid[1], per_token.shape[1])).index_copy(0, positions,
                                                                                               per_token)
        sums = token_sums(per_token, grid, tokens.cu_seqlens, True)
    else:
        sums = per_token.double().sum(0)
    loss = sums[0] - o.cfg.entropy_coef * sums[-1] * entropy_scale
    return loss.float(), sums, None if dh is None else dh.to(hidden.dtype), dw32, db32


def hand_out(grads, grad_loss, dtypes, in_place: bool) -> list:
    """The gradients a gradient-in-forward pass stored at a loss gradient of 1, scaled by the incoming gradient of
    the loss and cast to their tensors' dtypes with one rounding from the fp32 accumulators.

    in_place (eager): one pass of the scale kernel, the scale read on the device (``kernels/scale_kernels.py``): a
    gradient already in its tensor's dtype is scaled in its own buffer, and not touched at all for a scale of 1 (an
    fp32 master weight's gradient is the accumulator: no second V x H buffer, no pass); a half-precision one is
    scaled and cast in one read of the accumulator. Otherwise (the registered op's backward, which AOTAutograd
    traces) torch ops into new buffers."""
    out = []
    for grad, dtype in zip(grads, dtypes):
        if grad is None or dtype is None:
            out.append(None)
        elif not in_place:
            out.append((grad * grad_loss).to(dtype))
        else:
            from ..kernels.scale_kernels import scaled_gradient  # lazy: creates the Triton kernel
            out.append(scaled_gradient(grad, grad_loss.to(grad.device), dtype))
    return out


def _needs(ctx, bias) -> tuple:
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return bool(need_h), bool(need_w), bool(need_b) and bias is not None


def _dtypes(hidden, weight, bias) -> tuple:
    return hidden.dtype, weight.dtype, None if bias is None else bias.dtype


def _stored_grads(ctx):
    """The gradients a forward stored, once: a second backward through the same graph finds none."""
    if ctx.grads is None:
        raise RuntimeError("fused_linear_grpo_loss computed its gradients in the forward and has already handed "
                           "them out (a second backward through the same graph, e.g. retain_graph=True): pass "
                           "grad_in_forward=False for repeated backward passes")
    grads, ctx.grads = ctx.grads, None  # handed out (and partly scaled in place): released with this backward
    return grads


class _HeadLossInForward(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids) -> (loss, term sums); the gradients are made in the forward."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, tokens: HeadTokens, entropy_scale, o: FastOptions, positions):
        loss, sums, *grads = fast_loss(hidden, weight, bias, ids, tokens, entropy_scale, _needs(ctx, bias), o,
                                       positions)
        ctx.grads, ctx.dtypes = grads, _dtypes(hidden, weight, bias)
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        return (*hand_out(_stored_grads(ctx), grad_loss, ctx.dtypes, in_place=True), None, None, None, None, None)


@custom_op("grpo_kernels::head_loss_fast", mutates_args=())
def _head_loss_fast(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                    row_mask: Optional[torch.Tensor], tokens: list[Optional[torch.Tensor]], entropy_scale: torch.Tensor,
                    needs: list[bool], floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                      torch.Tensor, torch.Tensor]:
    """(loss, term sums, d hidden, d weight fp32, d bias fp32) of ``fast_loss`` on the rows ``row_mask`` keeps
    (``ValidRows.deferred``); tokens: ``HeadTokens.as_list()`` on all rows; floats, ints: ``ops.encode(FastOptions)``. A
    gradient not wanted is an empty (0,) tensor."""
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    hidden_rows, ids = ops.take_rows(index, hidden, ids)
    loss, sums, dh, dw32, db32 = fast_loss(hidden_rows, weight, bias, ids, HeadTokens(*tokens).rows(index),
                                           entropy_scale, tuple(needs), ops.decode(FastOptions, floats, ints), index)
    return (loss, sums, ops.or_empty(ops.put_rows(index, N, dh), hidden), ops.or_empty(dw32, hidden),
            ops.or_empty(db32, hidden))


@_head_loss_fast.register_fake
def _(hidden, weight, bias, ids, row_mask, tokens, entropy_scale, needs, floats, ints):
    from ..kernels.linear_epilogue_kernels import N_ROW_TERMS
    empty = hidden.new_empty((0,))
    f32 = torch.float32
    return (hidden.new_empty((), dtype=f32), hidden.new_empty((N_ROW_TERMS + 1,), dtype=torch.float64),
            torch.empty_like(hidden) if needs[0] else empty,
            weight.new_empty(weight.shape, dtype=f32) if needs[1] else empty,
            bias.new_empty(bias.shape, dtype=f32) if needs[2] else empty)


def _head_fast_setup(ctx, inputs, output):
    ctx.n_inputs = len(inputs)
    ctx.dtypes = _dtypes(*inputs[:3])
    ctx.save_for_backward(*output[2:])
    ctx.mark_non_differentiable(*output[1:])


def _head_fast_backward(ctx, grad_loss, *_unused):
    grads = [g if need else None for g, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:3])]
    return ops.grads_for_inputs(ctx, *hand_out(grads, grad_loss, ctx.dtypes, in_place=False))


_head_loss_fast.register_autograd(_head_fast_backward, setup_context=_head_fast_setup)


def head_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, plan, rows: ValidRows):
    """(loss, metrics) of ``fused_linear_grpo_loss`` on ``head.fast``: chunks of ``plan.chunk_rows`` valid tokens."""
    B, T = inputs.shape
    weights = batch.token_weights(cfg, B, T, inputs.hidden.device)
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    # d loss / d entropy of every valid token: loss = ... - entropy_coef * sum(entropy) / n_valid
    ge = None if cfg.entropy_coef == 0.0 else (-cfg.entropy_coef / weights.count).reshape(1).float()
    # each sequence's advantage (and per-sequence is_ratio) reaches its tokens here (packed: a gather)
    tokens = HeadTokens(adv=_per_token(batch.per_token(batch.advantages), B, T, rows),
                        w=_per_token(weights.weights, B, T, rows), old=_per_token(batch.old_logps, B, T, rows),
                        ref=_per_token(batch.ref_logps, B, T, rows),
                        isr=_per_token(batch.per_token(batch.is_ratio), B, T, rows), ge=ge,
                        cu_seqlens=batch.seqs.cu_seqlens)
    o = FastOptions(inputs.dtype, cfg, inputs.transform, plan.chunk_rows, B, T)
    entropy_scale = 1.0 / weights.count.double()
    if ops.compiling():  # the Function does not trace: its registered op does
        wants = torch.is_grad_enabled()
        needs = [wants and t is not None and t.requires_grad for t in (hidden, inputs.weight, inputs.bias)]
        loss, sums, *_ = _head_loss_fast(hidden, inputs.weight, inputs.bias, ids, rows.deferred, tokens.as_list(),
                                         entropy_scale, needs, *ops.encode(o))
    else:
        loss, sums = _HeadLossInForward.apply(hidden, inputs.weight, inputs.bias, ids, tokens, entropy_scale, o,
                                              rows.index)
    return loss, metrics_from_sums(sums, sums[-1], weights.count, batch.ref_logps is not None, cfg.loss_type)


def _per_token(x, B: int, T: int, rows: ValidRows):
    """A (B,), (B, 1) or (B, T) tensor as fp32 contiguous values at the valid tokens."""
    if x is None:
        return None
    x = x.float()
    x = x.reshape(B, 1).expand(B, T) if x.dim() == 1 or x.shape[-1] == 1 else x
    (x,) = rows.compact(x.reshape(-1))
    return x.contiguous()


class _HeadSequenceGradsInForward(torch.autograd.Function):
    """(hidden, weight, bias, ids) -> (anchor, logp, entropy): the gradients are made in forward and handed out
    by the backward of ``anchor``, a 0 added to the loss (whose value comes from the reference on logp, entropy).
    Eager only: under torch.compile the planner takes ``head.light`` for sequence-level configurations."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, o: SequenceOptions):
        from ..kernels.linear_epilogue_kernels import head_sequence_grads  # lazy: creates the Triton kernels
        h, w, b = _in_compute_dtype(o.dtype, hidden, weight, bias)
        with torch.autocast(hidden.device.type, enabled=False):
            logp, ent, dh, dw32, db32 = head_sequence_grads(h, w, b, ids, list(o.bounds), o.token_grads,
                                                            o.transform, _needs(ctx, bias), grad_ids=o.grad_ids)
        del h, w, b
        ctx.grads = (None if dh is None else dh.to(hidden.dtype), dw32, db32)
        ctx.dtypes = _dtypes(hidden, weight, bias)
        ctx.mark_non_differentiable(logp, ent)
        return torch.zeros((), dtype=torch.float32, device=hidden.device), logp, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_anchor, _grad_logp, _grad_ent):
        return (*hand_out(_stored_grads(ctx), grad_anchor, ctx.dtypes, in_place=True), None, None)


@dataclass(frozen=True)
class SequenceOptions:
    """The non-tensor inputs of ``head.fast_sequence``: the compute dtype, the logits transform, the chunks' row
    bounds, the per-chunk gradient function and the one-hot ids of a vocabulary shard (None: ``ids``)."""

    dtype: torch.dtype
    transform: LogitTransform
    bounds: tuple
    token_grads: object
    grad_ids: torch.Tensor | None = None


def head_sequence_loss_in_forward(inputs: HeadInputs, batch: LossInputs, cfg: GRPOLossConfig, plan,
                                  rows: ValidRows, shard_view=None):
    """(loss, metrics) on ``head.fast_sequence`` (or, with ``shard_view``, ``head.fast_vocab_parallel``), chunks of
    whole sequences from the plan.

    shard_view (a vocabulary shard, ``distributed/vocab_parallel.py``): ``shard_view(hidden, ids)`` -> (hidden whose
    gradient is summed over the ranks, ids clamped into the shard, one-hot ids (-1 where another rank owns the id),
    ``combine(r0, r1, logp, lse, entropy)`` turning a chunk's shard statistics into whole-vocabulary ones in place).
    With a soft cap the fold kernel's (logp, lse, entropy) are already those of the capped logits, so the combine
    (which works on them alone) and the d-logits epilogue (which recomputes the cap) need nothing more."""
    B, T = inputs.shape
    weights = batch.token_weights(cfg, B, T, inputs.hidden.device)
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    grad_ids = combine = None
    if shard_view is not None:
        hidden, ids, grad_ids, combine = shard_view(hidden, ids)
    token_grads = _SequenceGrads(batch, cfg, weights, rows, plan, T, combine)
    bounds = (0,) + tuple(chunk[3] for chunk in plan.sequence_chunks)
    o = SequenceOptions(inputs.dtype, inputs.transform, bounds, token_grads, grad_ids)
    anchor, logp, ent = _HeadSequenceGradsInForward.apply(hidden, inputs.weight, inputs.bias, ids, o)
    logp, ent = rows.scatter(logp, ent)
    with torch.no_grad():
        loss, metrics = loss_from_logps(logp.view(B, T), batch.advantages, batch.mask, old_logps=batch.old_logps,
                                        ref_logps=batch.ref_logps, is_ratio=batch.is_ratio, entropy=ent.view(B, T),
                                        num_items_in_batch=batch.num_items_in_batch,
                                        sampling_logps=batch.sampling_logps, config=cfg, sequences=batch.seqs)
    return loss.float() + anchor, metrics


class _SequenceGrads:
    """``token_grads(r0, r1, logp, lse, entropy)`` of ``head_sequence_grads``: d loss / d logp and d loss / d entropy
    of the valid tokens r0 .. r1 (a chunk of whole sequences), from autograd through the reference loss on those
    sequences alone (one definition of the maths), rescaled from the sub-batch's reduction weights to the batch's:
    within a sequence every reduction weights its tokens alike, so the rescale is exact.

    Why flat positions and not a boolean mask: ``x[mask] = v`` is a host sync (its size depends on the data), made
    per chunk; the positions of a chunk's tokens in the chunk's own grid come from the valid-row index already
    made, so the loop never waits for the device. A chunk is the sequences b0 .. b1, which are the grid's tokens
    t0 .. t1 (rows of a padded grid, a stretch of the packed row)."""

    def __init__(self, batch: LossInputs, cfg: GRPOLossConfig, weights, rows: ValidRows, plan, T: int, combine):
        self.batch, self.cfg, self.weights, self.rows, self.T, self.combine = batch, cfg, weights, rows, T, combine
        self.chunk_of = {chunk[2]: chunk for chunk in plan.sequence_chunks}

    def _positions(self, r0: int, r1: int, t0: int):
        index = self.rows.index
        flat = torch.arange(r0, r1, device=self.weights.mask_b.device) if index is None else index[r0:r1]
        return flat - t0

    def __call__(self, r0, r1, logp, lse, ent):
        if self.combine is not None:
            self.combine(r0, r1, logp, lse, ent)
        b0, b1, _, _, t0, t1 = self.chunk_of[r0]
        cfg, batch, pos = self.cfg, self.batch, self._positions(r0, r1, t0)
        seqs = batch.seqs.slice(b0, b1, t0, t1)

        def tokens_of(x):  # a per-token tensor's stretch of the chunk, on the chunk's grid
            return None if x is None else x.reshape(-1)[t0:t1].reshape(seqs.grid)

        def of_chunk(x):  # a per-sequence tensor's sequences of the chunk, or a per-token one's stretch
            if x is None or (x.dim() == 2 and x.shape[-1] == batch.seqs.grid[1] and x.shape[-1] != 1):
                return tokens_of(x)
            return x[b0:b1]

        def on_grid(values):  # the chunk's values at its valid tokens, zeros elsewhere, on the chunk's grid
            grid = torch.zeros(t1 - t0, dtype=torch.float32, device=values.device)
            return grid.index_copy_(0, pos, values.float()).view(seqs.grid).requires_grad_(True)

        sub_mask = tokens_of(self.weights.mask_b)
        with torch.enable_grad():
            x = on_grid(logp)
            e = on_grid(ent) if cfg.entropy_coef != 0.0 else None
            sub_loss, _ = loss_from_logps(x, of_chunk(batch.advantages), sub_mask,
                                          old_logps=tokens_of(batch.old_logps), ref_logps=tokens_of(batch.ref_logps),
                                          is_ratio=of_chunk(batch.is_ratio), entropy=e, num_items_in_batch=None,
                                          sampling_logps=tokens_of(batch.sampling_logps), config=cfg,
                                          sequences=seqs)
            grads = torch.autograd.grad(sub_loss, [x] if e is None else [x, e])
        sub_w = reduction_weights(sub_mask.float(), cfg.loss_type, None, cfg.max_completion_length, seqs)
        at = lambda t: t.reshape(-1).index_select(0, pos)  # noqa: E731  (the chunk's valid tokens, in order)
        sub_w = at(sub_w)  # 0 at a padded token, which a ``capturable`` call computes too: its gradient is 0
        g = at(grads[0]) * torch.where(sub_w != 0, at(tokens_of(self.weights.weights)) / sub_w, 0.0)
        g_h = None if e is None else at(grads[1]) * (sub_mask.sum().clamp(min=1) / self.weights.count)
        return g.float(), None if g_h is None else g_h.float()
