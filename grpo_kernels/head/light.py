"""Per-token log-prob and entropy straight from hidden states and the lm_head weight: the fused head's
``head.light``, ``head.no_grad`` and ``head.torch`` paths behind one autograd Function (docs/kernels.md, "Fused
head").

logits = hidden @ weight.T (+ bias) are never written whole:
- ``head.light`` (Triton): an O(N) forward (``kernels/linear_forward_kernels.py``, logit tiles stay on chip), then a
  recompute backward over vocab chunks and row blocks sized by the plan (``kernels/linear_backward_kernels.py``);
- ``head.no_grad`` (Triton): per row chunk, cuBLAS fp32 logits + one fold kernel; no backward;
- ``head.torch``: tiles with an online logsumexp, recomputed in the backward (``torch_tiles.py``).

Each path can add the extra per-token statistics of ``config.TokenExtras`` (log sum p^2, the mean logit, is_top1) to
its forward sweep, never differentiable (docs/kernels.md, "Extra outputs").

``light_forward`` / ``light_backward`` are the paths' one body (``ops.py``), called by the eager Function and by the
registered ops. Eager-only: a context the caller gives (a ZeRO-3 head's gather, ``backward_context``) is entered again
around the backward, and the valid rows are compacted before the call (differentiably); the ops compact inside,
when they run.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from ..config import EXTRA_OUTPUTS, LogitTransform, TokenExtras
from ..inputs import HeadInputs, LogprobGrads, ValidRows
from ..invariance import INVARIANT_LIGHT_ROOM, block_rows
from ..paths import HEAD_LIGHT, HEAD_LOGPROB_PATHS, HEAD_NO_GRAD, HEAD_TORCH
from .torch_tiles import torch_linear_logprobs_backward, torch_linear_logprobs_forward


@ops.options_type(choices={"path": HEAD_LOGPROB_PATHS})
@dataclass(frozen=True)
class LightOptions:
    """The non-tensor inputs of the paths: the plan's path and layout, and the logits transform. chunk_rows: rows
    per chunk (``head.no_grad``, ``head.torch``); chunk_bytes / row_block: the light backward's layout (0: chosen
    when the op runs, within ``working_bytes``: a plan made under torch.compile leaves it to run time); extras: the
    extra statistics the forward adds; batch_invariant: fixed row blocks (the last one padded) and vocabulary
    splits and chunks that do not depend on N (``invariance.py``)."""

    path: str
    transform: LogitTransform
    deterministic: bool = True
    chunk_rows: int = 0
    chunk_bytes: int = 0
    row_block: int = 0
    working_bytes: int = 0
    extras: TokenExtras = TokenExtras()
    batch_invariant: bool = False


NO_EXTRAS = (None, None, None)


def light_forward(hidden, weight, bias, ids, o: LightOptions):
    """(logp, lse, entropy, extras) (N,) in the accumulation dtype of ``o.path``; extras: (log_sum_sq_probs,
    mean_logits, is_top1 bool), None for each that ``o.extras`` does not ask for."""
    t, extras = o.transform, o.extras or None
    with torch.autocast(hidden.device.type, enabled=False):  # the tiles keep their fp32 accumulation
        # Why the no-gradient forward under batch invariance: it is the one head.fast's epilogue agrees with bit
        # for bit (the same fixed-row cuBLAS blocks, the same per-row fold), so old / reference log-probs computed
        # without gradients equal the loss's on every Triton head path
        if o.path == HEAD_NO_GRAD or (o.path == HEAD_LIGHT and o.batch_invariant):
            from ..kernels.linear_epilogue_kernels import head_logprobs_chunked  # lazy: creates the Triton kernels
            out = head_logprobs_chunked(hidden, weight, bias, ids, t.temperature, o.chunk_rows * 4 * weight.shape[0],
                                        softcap=t.softcap, extras=extras,
                                        fixed_rows=(o.chunk_rows or block_rows(hidden.device)) if o.batch_invariant
                                        else 0, round_logits=t.round_logits)
        elif o.path == HEAD_LIGHT:
            from ..kernels.linear_forward_kernels import linear_logprobs_forward
            out = linear_logprobs_forward(hidden, weight, bias, ids, t.temperature, softcap=t.softcap, extras=extras,
                                          round_logits=t.round_logits)
        else:
            out = torch_linear_logprobs_forward(hidden, weight, bias, ids, t, o.chunk_rows, extras,
                                                fixed_rows=o.batch_invariant)
    return out if extras is not None else (*out, NO_EXTRAS)


def light_backward(hidden, weight, bias, ids, stats: LogprobGrads, needs: tuple, o: LightOptions):
    """(d hidden, d weight, d bias), None where not wanted (``needs``)."""
    with torch.autocast(hidden.device.type, enabled=False):
        if o.path == HEAD_LIGHT:
            from ..kernels.linear_backward_kernels import linear_logprobs_backward
            o = _layout_at_run_time(o, hidden, weight, needs)
            return linear_logprobs_backward(hidden, weight, bias, ids, stats, o.transform, needs, o.deterministic,
                                            chunk_bytes=o.chunk_bytes or None, row_block=o.row_block or None,
                                            fixed_rows=o.batch_invariant)
        if o.path == HEAD_TORCH:
            return torch_linear_logprobs_backward(hidden, weight, bias, ids, stats, o.transform, needs,
                                                  o.chunk_rows, fixed_rows=o.batch_invariant)
    raise RuntimeError("linear_token_logprobs ran its no-gradient path (the call had no input requiring grad, or ran "
                       "under torch.no_grad): it has no backward")


def _layout_at_run_time(o: LightOptions, hidden, weight, needs) -> LightOptions:
    """``o`` with the light backward's layout for ``hidden``'s rows within ``o.working_bytes`` when the plan left it
    to run time (``planner``: a plan made under torch.compile)."""
    if o.chunk_bytes or o.working_bytes <= 0:
        return o
    from ..kernels.linear_backward_kernels import backward_layout
    V, H = weight.shape
    rows, room = hidden.shape[0], o.working_bytes
    if o.batch_invariant:  # the fixed blocks' layout, as the planner would make it (never the budget's)
        rows, room = o.chunk_rows or block_rows(hidden.device), INVARIANT_LIGHT_ROOM
    layout = backward_layout(rows, V, H, hidden.dtype, hidden.device, room, *needs, o.deterministic)
    if layout is None:
        raise ValueError(f"memory_budget leaves {o.working_bytes} bytes, below the smallest backward layout of the "
                         "memory-light head path; raise memory_budget (or leave it None)")
    return replace(o, chunk_bytes=layout.chunk_bytes, row_block=layout.row_block)


def _needs(ctx, bias) -> tuple:
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return bool(need_h), bool(need_w), bool(need_b) and bias is not None


class _HeadLogprobs(torch.autograd.Function):
    """(hidden (N, H), weight, bias, ids) -> (logp, entropy, lse, log_sum_sq_probs, mean_logits, is_top1), the last
    three None unless ``o.extras`` asks for them (not differentiable, like lse); saves inputs plus two fp32 values
    per token."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, ids, o: LightOptions, backward_context):
        logp, lse, entropy, extras = light_forward(hidden, weight, bias, ids, o)
        if o.path != HEAD_NO_GRAD:
            ctx.save_for_backward(hidden, weight, bias, ids, lse, entropy)
        ctx.options, ctx.backward_context = o, backward_context
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(lse, *(t for t in extras if t is not None))
        return logp, entropy, lse, *extras

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp, grad_entropy, _grad_lse, *_grad_extras):
        hidden, weight, bias, ids, lse, entropy = ctx.saved_tensors
        needs = _needs(ctx, bias)
        if (grad_logp is None and grad_entropy is None) or not any(needs):
            return None, None, None, None, None, None
        stats = LogprobGrads.incoming(lse, entropy, grad_logp, grad_entropy)
        # Why enter again: a ZeRO-3 partition was emptied when the forward's gather context exited.
        with contextlib.nullcontext() if ctx.backward_context is None else ctx.backward_context():
            d_hidden, d_weight, d_bias = light_backward(hidden, weight, bias, ids, stats, needs, ctx.options)
        return d_hidden, d_weight, d_bias, None, None, None


@custom_op("grpo_kernels::head_logprobs", mutates_args=())
def _head_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], ids: torch.Tensor,
                   row_mask: Optional[torch.Tensor], floats: torch.Tensor,
                   ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                             torch.Tensor]:
    """(logp, entropy, lse, log_sum_sq_probs, mean_logits, is_top1) (N,) of ``light_forward``, 0 (False) at the rows
    ``row_mask`` drops (``ValidRows.deferred``), an empty (0,) tensor for an extra not asked for; floats, ints:
    ``ops.encode(LightOptions)``."""
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    h, i = ops.take_rows(index, hidden, ids)
    logp, lse, entropy, extras = light_forward(h, weight, bias, i, ops.decode(LightOptions, floats, ints))
    extras = tuple(hidden.new_empty((0,), dtype=dtype) if t is None else ops.put_rows(index, N, t)
                   for t, dtype in zip(extras, (lse.dtype, lse.dtype, torch.bool)))
    return ops.put_rows(index, N, logp), ops.put_rows(index, N, entropy), ops.put_rows(index, N, lse), *extras


@_head_logprobs.register_fake
def _(hidden, weight, bias, ids, row_mask, floats, ints):
    o = ops.decode_for_fake(LightOptions, ints)
    dtype = ops.acc_dtype(hidden) if o.path == HEAD_TORCH else torch.float32
    N = hidden.shape[0]
    extras = tuple(hidden.new_empty((N if getattr(o.extras, name) else 0,), dtype=ty)
                   for name, ty in zip(EXTRA_OUTPUTS, (dtype, dtype, torch.bool)))
    return (*(hidden.new_empty((N,), dtype=dtype) for _ in range(3)), *extras)


@custom_op("grpo_kernels::head_logprobs_backward", mutates_args=())
def _head_logprobs_backward(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                            ids: torch.Tensor, row_mask: Optional[torch.Tensor], stats: list[Optional[torch.Tensor]],
                            needs: list[bool], floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d hidden, d weight, d bias) of ``light_backward``; stats: ``LogprobGrads.as_list()``; an empty (0,) tensor
    stands for a gradient not wanted."""
    N = hidden.shape[0]
    index = ops.valid_index(row_mask, N)
    h, i = ops.take_rows(index, hidden, ids)
    grads = light_backward(h, weight, bias, i, LogprobGrads(*stats).rows(index), tuple(needs),
                           ops.decode(LightOptions, floats, ints))
    grads = (ops.put_rows(index, N, grads[0]), grads[1], grads[2])
    return tuple(ops.or_empty(None if g is None else g.to(t.dtype), hidden)
                 for g, t in zip(grads, (hidden, weight, hidden if bias is None else bias)))


@_head_logprobs_backward.register_fake
def _(hidden, weight, bias, ids, row_mask, stats, needs, floats, ints):
    return tuple(torch.empty_like(t) if need else hidden.new_empty((0,)) for t, need in zip((hidden, weight, bias),
                                                                                          needs))


def _head_setup(ctx, inputs, output):
    hidden, weight, bias, ids, row_mask, floats, ints = inputs
    _logp, entropy, lse, *extras = output
    ctx.save_for_backward(hidden, weight, bias, ids, row_mask, lse, entropy)
    ctx.mark_non_differentiable(lse, *extras)
    ctx.options = (floats, ints)


def _head_backward(ctx, grad_logp, grad_entropy, _grad_lse, *_grad_extras):
    hidden, weight, bias, ids, row_mask, lse, entropy = ctx.saved_tensors
    needs = _needs(ctx, bias)
    stats = LogprobGrads.incoming(lse, entropy, grad_logp, grad_entropy)
    grads = _head_logprobs_backward(hidden, weight, bias, ids, row_mask, stats.as_list(), list(needs), *ctx.options)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None)


_head_logprobs.register_autograd(_head_backward, setup_context=_head_setup)


def head_token_logprobs(inputs: HeadInputs, plan, rows: ValidRows, backward_context=None,
                        extras: TokenExtras | None = None):
    """(logp, entropy, lse, (log_sum_sq_probs, mean_logits, is_top1)) shaped like the caller's ids, from validated
    inputs and their plan; each extra None unless ``extras`` asks for it.

    Only the rows ``rows`` keeps are computed (the others get 0 / False and no gradient): padding costs neither the
    N x V x H matmuls nor their backward. backward_context: None, or a zero-argument callable returning a context
    manager entered around the backward (a ZeRO-3 head's gather; the caller holds it open around this call)."""
    extras = extras or TokenExtras()
    inputs = inputs.in_compute_dtype()
    hidden, ids = rows.compact(inputs.hidden, inputs.ids)
    o = LightOptions(plan.path, inputs.transform, plan.deterministic, plan.chunk_rows or 0, plan.chunk_bytes or 0,
                     plan.row_block or 0, plan.working_bytes or 0, extras, plan.batch_invariant)
    if ops.compiling():  # the Function does not trace: its registered op does
        logp, entropy, lse, *more = _head_logprobs(hidden, inputs.weight, inputs.bias, ids, rows.deferred,
                                                   *ops.encode(o))
        more = [t if getattr(extras, name) else None for t, name in zip(more, EXTRA_OUTPUTS)]
    else:
        logp, entropy, lse, *more = _HeadLogprobs.apply(hidden, inputs.weight, inputs.bias, ids, o, backward_context)
    logp, entropy, lse = rows.scatter(logp, entropy, lse)
    shape = inputs.shape
    more = tuple(None if t is None else rows.scatter(t)[0].view(shape) for t in more)
    return logp.view(shape), entropy.view(shape), lse.view(shape), more
