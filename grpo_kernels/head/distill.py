"""The two-head divergence's paths behind two autograd Functions and their registered ops (docs/DESIGN.md,
"Distillation"; ``planner.distill`` chooses):

- per token (``linear_token_divergence``, and the loss on the recompute paths): ``divergence_forward`` then, in
  the backward, ``divergence_backward``: ``distill.light`` (Triton tiles, recomputed), ``distill.no_grad`` (no
  backward), ``distill.torch`` (PyTorch row chunks, recomputed);
- the loss with its gradient made in the forward (``fused_linear_distill_loss``): ``fast_loss`` on ``distill.fast``
  (Triton) or ``distill.torch_fast`` (PyTorch); the backward only scales the stored gradients.

The bodies are called by the eager Functions and, under torch.compile, by the registered ops (``ops.py``), whose
non-tensor inputs are ``DistillOptions`` encoded by ``ops.encode``. The heads run in their compute dtypes (autocast's,
decided by ``distill_inputs``), cast here inside the Functions: an fp32 master weight's gradient accumulates
straight into fp32. The teacher's tensors come detached: it gets no gradient.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable
from torch.library import custom_op

from .. import ops
from .._checks import ROUND_LOGITS
from ..distill_config import DistillLossConfig
from ..paths import DISTILL_FAST, DISTILL_LIGHT, DISTILL_NO_GRAD, DISTILL_PATHS, DISTILL_TORCH, DISTILL_TORCH_FAST
from ..sequences import token_sums
from .distill_torch import torch_divergence
from .fast import hand_out

ops.options_type(DistillLossConfig, choices={"round_logits": (None,) + ROUND_LOGITS})


@ops.options_type(choices={"path": DISTILL_PATHS})
@dataclass(frozen=True)
class DistillOptions:
    """The non-tensor inputs of every distillation path: the plan's path, the options, each head's compute dtype,
    the rows per chunk, the vocabulary tile (0: the whole V) and the call's token grid (which the batch-invariant
    sums follow)."""

    path: str
    cfg: DistillLossConfig
    student_dtype: torch.dtype
    teacher_dtype: torch.dtype
    chunk_rows: int
    vocab_tile: int = 0
    grid_rows: int = 0
    grid_cols: int = 0


def _cast(dtype, hidden, weight, bias):
    """Hidden and weight in the compute dtype; the bias as it is: it is added in fp32 to the fp32 GEMM's output (an
    fp32 bias under bf16 autocast is not rounded to bf16 first, as TRL's ``_project`` adds ``bias.float()``)."""
    return hidden.to(dtype), weight.to(dtype), bias


def _heads(tensors: tuple, o: DistillOptions):
    """((student hidden, weight, bias), (teacher ...)): hidden and weight in their compute dtypes (copies only where
    needed), each bias in its own dtype."""
    return _cast(o.student_dtype, *tensors[:3]), _cast(o.teacher_dtype, *tensors[3:])


def divergence_forward(tensors: tuple, o: DistillOptions):
    """(divergence, entropy, lse_s, lse_t, aux) (N,) of the per-token paths (fp32; the accumulation dtype on the
    PyTorch one): tensors = (student hidden, weight, bias, teacher hidden, weight, bias)."""
    student, teacher = _heads(tensors, o)
    with torch.autocast(student[0].device.type, enabled=False):
        if o.path in (DISTILL_TORCH, DISTILL_TORCH_FAST):
            return torch_divergence(student, teacher, o.cfg, o.chunk_rows, fixed_rows=o.cfg.batch_invariant)[:5]
        from ..kernels.distill_kernels import distill_row_chunks, distill_tile_forward  # lazy: creates the kernels
        if o.vocab_tile and o.vocab_tile < student[1].shape[0]:
            return distill_tile_forward(student, teacher, o.cfg, o.chunk_rows, o.vocab_tile)
        return distill_row_chunks(student, teacher, o.cfg, o.chunk_rows, fixed_rows=o.cfg.batch_invariant)[:5]


def divergence_backward(tensors: tuple, stats: tuple, grad, needs: tuple, o: DistillOptions):
    """(d student hidden, d weight, d bias) in the given tensors' dtypes (None where not wanted) of the recompute
    paths; stats: the forward's (lse_s, lse_t, aux); grad: (N,) d loss / d divergence."""
    student, teacher = _heads(tensors, o)
    with torch.autocast(student[0].device.type, enabled=False):
        if o.path in (DISTILL_TORCH, DISTILL_TORCH_FAST):
            grads = torch_divergence(student, teacher, o.cfg, o.chunk_rows, grad, needs, o.cfg.batch_invariant)[5:]
        elif o.path == DISTILL_LIGHT:
            from ..kernels.distill_kernels import distill_tile_backward
            grads = distill_tile_backward(student, teacher, o.cfg, stats, grad, o.chunk_rows,
                                          o.vocab_tile or student[1].shape[0], needs, o.cfg.batch_invariant)
        else:
            raise RuntimeError("linear_token_divergence ran its no-gradient path (no student tensor required grad, "
                               "or it ran under torch.no_grad): it has no backward")
    return tuple(None if g is None else g.to(t.dtype) for g, t in zip(grads, tensors[:3]))


def fast_loss(tensors: tuple, w, needs: tuple, o: DistillOptions, positions=None, cu_seqlens=None):
    """(loss fp32 0-dim, sums fp64 (divergence, entropy) over the rows, d hidden in hidden's dtype | None, d weight
    | None, d bias | None, the last two in the accumulation dtype) of the gradient-in-forward paths at an incoming
    gradient of 1: ``loss = sum(w D)``. w: (N,) fp32 reduction weights of the rows. positions: the rows' flat
    places on the (grid_rows, grid_cols) grid when they are compacted (the batch-invariant sums put them back)."""
    student, teacher = _heads(tensors, o)
    with torch.autocast(student[0].device.type, enabled=False):
        if o.path == DISTILL_TORCH_FAST:
            g = w.to(torch.float64) if student[0].dtype == torch.float64 else w
            div, ent, *_stats, dh, dw, db = torch_divergence(student, teacher, o.cfg, o.chunk_rows, g, needs,
                                                             o.cfg.batch_invariant)
        else:
            from ..kernels.distill_kernels import distill_row_chunks  # lazy: creates the Triton kernels
            div, ent, *_stats, dh, dw, db = distill_row_chunks(student, teacher, o.cfg, o.chunk_rows, w.float(),
                                                               needs, o.cfg.batch_invariant)
    del student, teacher  # the compute-dtype copies go before the backward
    per_token = torch.stack([w.to(div.dtype) * div, div, ent], 1)
    if o.cfg.batch_invariant:
        grid = (o.grid_rows, o.grid_cols)
        if positions is not None:
            per_token = per_token.new_zeros((grid[0] * grid[1], 3)).index_copy(0, positions, per_token)
        sums = token_sums(per_token, grid, cu_seqlens, True)
    else:
        sums = per_token.double().sum(0)
    # Why copies: an op's outputs may not be views of one another
    loss = sums[0].to(torch.float64 if div.dtype == torch.float64 else torch.float32, copy=True)
    return loss, sums[1:].clone(), None if dh is None else dh.to(tensors[0].dtype), dw, db


def _needs(ctx, bias) -> tuple:
    need_h, need_w, need_b = ctx.needs_input_grad[:3]
    return bool(need_h), bool(need_w), bool(need_b) and bias is not None


def _dtypes(hidden, weight, bias) -> tuple:
    return hidden.dtype, weight.dtype, None if bias is None else bias.dtype


class _TokenDivergence(torch.autograd.Function):
    """(student hidden, weight, bias, teacher hidden, weight, bias) -> (divergence, entropy) (N,); the entropy is
    not differentiable (TRL's); the backward recomputes both heads' logits. contexts: None or a zero-argument
    callable whose context is entered around the backward (a ZeRO-3 head gathered again)."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, o: DistillOptions, contexts):
        tensors = (sh, sw, sb, th, tw, tb)
        div, ent, lse_s, lse_t, aux = divergence_forward(tensors, o)
        if o.path != DISTILL_NO_GRAD:
            ctx.save_for_backward(*tensors, lse_s, lse_t, aux)
        ctx.options, ctx.contexts = o, contexts
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(ent)
        return div, ent

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_div, _grad_ent):
        sh, sw, sb, th, tw, tb, lse_s, lse_t, aux = ctx.saved_tensors
        needs = _needs(ctx, sb)
        if grad_div is None or not any(needs):
            return (None,) * 8
        with contextlib.nullcontext() if ctx.contexts is None else ctx.contexts():
            grads = divergence_backward((sh, sw, sb, th, tw, tb), (lse_s, lse_t, aux),
                                        grad_div.reshape(-1).contiguous(), needs, ctx.options)
        return (*grads, None, None, None, None, None)


def _hand_out(grads, grad_loss, dtypes, path: str, in_place: bool) -> list:
    """The stored gradients scaled by the incoming gradient, in their tensors' dtypes: the Triton path's hand-out
    (``head.fast.hand_out``: one scale-and-cast kernel, in place where the dtype is the gradient's own); the PyTorch
    path's in torch ops (in place for a gradient already in its dtype)."""
    if path == DISTILL_FAST:
        return hand_out(grads, grad_loss, dtypes, in_place)
    out = []
    for grad, dtype in zip(grads, dtypes):
        if grad is None or dtype is None:
            out.append(None)
        elif in_place and grad.dtype == dtype:
            out.append(grad.mul_(grad_loss.to(grad.dtype)))
        else:
            out.append((grad * grad_loss).to(dtype))
    return out


class _DistillLossInForward(torch.autograd.Function):
    """(student hidden, weight, bias, teacher hidden, weight, bias, w) -> (loss, sums); the student's gradients are
    made in the forward and handed out, scaled, by the backward (once: a second backward finds none)."""

    @staticmethod
    def forward(ctx, sh, sw, sb, th, tw, tb, w, o: DistillOptions, positions, cu_seqlens):
        loss, sums, *grads = fast_loss((sh, sw, sb, th, tw, tb), w, _needs(ctx, sb), o, positions, cu_seqlens)
        ctx.grads, ctx.dtypes, ctx.path = grads, _dtypes(sh, sw, sb), o.path
        ctx.mark_non_differentiable(sums)
        return loss, sums

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss, _grad_sums):
        if ctx.grads is None:
            raise RuntimeError("fused_linear_distill_loss computed its gradients in the forward and has already "
                               "handed them out (a second backward through the same graph): pass "
                               "grad_in_forward=False for repeated backward passes")
        grads, ctx.grads = ctx.grads, None
        return (*_hand_out(grads, grad_loss, ctx.dtypes, ctx.path, in_place=True),) + (None,) * 7


# ---------------------------------------------------------------------------------------------- registered ops


@custom_op("grpo_kernels::distill_divergence", mutates_args=())
def _distill_divergence(sh: torch.Tensor, sw: torch.Tensor, sb: Optional[torch.Tensor], th: torch.Tensor,
                        tw: torch.Tensor, tb: Optional[torch.Tensor], row_mask: Optional[torch.Tensor],
                        floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                       torch.Tensor, torch.Tensor]:
    """(divergence, entropy, lse_s, lse_t, aux) (N,) of ``divergence_forward`` on the rows ``row_mask`` keeps (0
    elsewhere); floats, ints: ``ops.encode(DistillOptions)``."""
    N = sh.shape[0]
    index = ops.valid_index(row_mask, N)
    sh_r, th_r = ops.take_rows(index, sh, th)
    out = divergence_forward((sh_r, sw, sb, th_r, tw, tb), ops.decode(DistillOptions, floats, ints))
    return tuple(ops.put_rows(index, N, t) for t in out)


@_distill_divergence.register_fake
def _(sh, sw, sb, th, tw, tb, row_mask, floats, ints):
    o = ops.decode_for_fake(DistillOptions, ints)
    dtype = ops.acc_dtype(sh) if o.path in (DISTILL_TORCH, DISTILL_TORCH_FAST) else torch.float32
    return tuple(sh.new_empty((sh.shape[0],), dtype=dtype) for _ in range(5))


@custom_op("grpo_kernels::distill_divergence_backward", mutates_args=())
def _distill_divergence_backward(sh: torch.Tensor, sw: torch.Tensor, sb: Optional[torch.Tensor], th: torch.Tensor,
                                 tw: torch.Tensor, tb: Optional[torch.Tensor], row_mask: Optional[torch.Tensor],
                                 stats: list[torch.Tensor], grad: torch.Tensor, needs: list[bool],
                                 floats: torch.Tensor, ints: list[int]) -> tuple[torch.Tensor, torch.Tensor,
                                                                                torch.Tensor]:
    """(d hidden, d weight, d bias) of ``divergence_backward``; an empty (0,) tensor stands for one not wanted."""
    N = sh.shape[0]
    index = ops.valid_index(row_mask, N)
    sh_r, th_r, g = ops.take_rows(index, sh, th, grad.reshape(-1))
    stats = ops.take_rows(index, *stats)
    grads = divergence_backward((sh_r, sw, sb, th_r, tw, tb), stats, g.contiguous(), tuple(needs),
                                ops.decode(DistillOptions, floats, ints))
    grads = (ops.put_rows(index, N, grads[0]), grads[1], grads[2])
    return tuple(ops.or_empty(t, sh) for t in grads)


@_distill_divergence_backward.register_fake
def _(sh, sw, sb, th, tw, tb, row_mask, stats, grad, needs, floats, ints):
    return tuple(torch.empty_like(t) if need else sh.new_empty((0,)) for t, need in zip((sh, sw, sb), needs))


def _divergence_setup(ctx, inputs, output):
    sh, sw, sb, th, tw, tb, row_mask, floats, ints = inputs
    ctx.save_for_backward(sh, sw, sb, th, tw, tb, row_mask, *output[2:])
    ctx.mark_non_differentiable(*output[1:])
    ctx.options = (floats, ints)


def _divergence_backward_formula(ctx, grad_div, *_unused):
    sh, sw, sb, th, tw, tb, row_mask, lse_s, lse_t, aux = ctx.saved_tensors
    needs = _needs(ctx, sb)
    grads = _distill_divergence_backward(sh, sw, sb, th, tw, tb, row_mask, [lse_s, lse_t, aux], grad_div,
                                         list(needs), *ctx.options)
    return (*(g if need else None for g, need in zip(grads, needs)), None, None, None, None, None, None)


_distill_divergence.register_autograd(_divergence_backward_formula, setup_context=_divergence_setup)


@custom_op("grpo_kernels::distill_loss_fast", mutates_args=())
def _distill_loss_fast(sh: torch.Tensor, sw: torch.Tensor, sb: Optional[torch.Tensor], th: torch.Tensor,
                       tw: torch.Tensor, tb: Optional[torch.Tensor], row_mask: Optional[torch.Tensor],
                       w: torch.Tensor, cu_seqlens: Optional[torch.Tensor], needs: list[bool], floats: torch.Tensor,
                       ints: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                 torch.Tensor]:
    """(loss, sums, d hidden, d weight, d bias) of ``fast_loss`` on the rows ``row_mask`` keeps; w on all rows."""
    N = sh.shape[0]
    index = ops.valid_index(row_mask, N)
    sh_r, th_r, w_r = ops.take_rows(index, sh, th, w)
    loss, sums, dh, dw, db = fast_loss((sh_r, sw, sb, th_r, tw, tb), w_r.contiguous(), tuple(needs),
                                       ops.decode(DistillOptions, floats, ints), index, cu_seqlens)
    return loss, sums, ops.or_empty(ops.put_rows(index, N, dh), sh), ops.or_empty(dw, sh), ops.or_empty(db, sh)


@_distill_loss_fast.register_fake
def _(sh, sw, sb, th, tw, tb, row_mask, w, cu_seqlens, needs, floats, ints):
    o = ops.decode_for_fake(DistillOptions, ints)
    acc = ops.acc_dtype(sh) if o.path == DISTILL_TORCH_FAST else torch.float32
    empty = sh.new_empty((0,))
    return (sh.new_empty((), dtype=torch.float64 if acc == torch.float64 else torch.float32),
            sh.new_empty((2,), dtype=torch.float64), torch.empty_like(sh) if needs[0] else empty,
            sw.new_empty(sw.shape, dtype=acc) if needs[1] else empty,
            sb.new_empty(sb.shape, dtype=acc) if needs[2] else empty)


def _loss_setup(ctx, inputs, output):
    ctx.n_inputs = len(inputs)
    ctx.dtypes = _dtypes(*inputs[:3])
    ctx.path = ops.decode_for_fake(DistillOptions, inputs[-1]).path
    ctx.save_for_backward(*output[2:])
    ctx.mark_non_differentiable(*output[1:])


def _loss_backward_formula(ctx, grad_loss, *_unused):
    grads = [g if need else None for g, need in zip(ctx.saved_tensors, ctx.needs_input_grad[:3])]
    return ops.grads_for_inputs(ctx, *_hand_out(grads, grad_loss, ctx.dtypes, ctx.path, in_place=False))


_distill_loss_fast.register_autograd(_loss_backward_formula, setup_context=_loss_setup)


def token_divergence_call(tensors: tuple, o: DistillOptions, row_mask=None, contexts=None):
    """(divergence, entropy) (N,) of the per-token paths: the Function eagerly, its registered op under
    torch.compile (rows compacted inside, from ``row_mask``)."""
    if ops.compiling():
        div, ent, *_ = _distill_divergence(*tensors, row_mask, *ops.encode(o))
        return div, ent
    return _TokenDivergence.apply(*tensors, o, contexts)


def loss_in_forward_call(tensors: tuple, w, o: DistillOptions, positions=None, cu_seqlens=None, row_mask=None):
    """(loss, sums) of the gradient-in-forward paths: the Function eagerly, its registered op under torch.compile
    (w then on all rows, compacted inside with the others from ``row_mask``)."""
    if ops.compiling():
        wants = torch.is_grad_enabled()
        needs = [wants and t is not None and t.requires_grad for t in tensors[:3]]
        loss, sums, *_ = _distill_loss_fast(*tensors, row_mask, w, cu_seqlens, needs, *ops.encode(o))
        return loss, sums
    return _DistillLossInForward.apply(*tensors, w, o, positions, cu_seqlens)
