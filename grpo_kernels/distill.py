"""On-policy distillation on the fused head: the per-token two-head divergence ``linear_token_divergence``, the
loss ``fused_linear_distill_loss`` and its ``nn.Module`` ``FusedLinearDistillLoss`` (docs/api.md, "Distillation";
the maths: docs/DESIGN.md, "Distillation"). TRL 1.16's ``ChunkedDivergenceFunction`` / ``_chunked_divergence_loss``
semantics, neither model's N x V logits ever held.

Each validates once (``distill_inputs``), asks ``planner.plan_distill`` for a plan and dispatches on its path; the
reduction is ``distill_reference``'s (one definition), applied by the gradient-in-forward paths as per-token weights.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from . import _checks, invariance, ops, planner
from .distill_config import DistillLossConfig, resolve_distill_config
from .distill_inputs import DistillInputs
from .distill_reference import distill_weights, loss_from_divergence
from .distributed import sharded_head
from .head.distill import DistillOptions, loss_in_forward_call, token_divergence_call
from .inputs import ValidRows, check_num_items
from .paths import DISTILL_FAST, DISTILL_TORCH_FAST
from .sequences import Sequences

TOKEN_OP, LOSS_OP = "linear_token_divergence", "fused_linear_distill_loss"


def _num_items(n) -> None:
    """num_items_in_batch: None, a number > 0 or a one-element tensor (``inputs.check_num_items``), a tensor's value
    checked on the device."""
    check_num_items(n)
    if isinstance(n, torch.Tensor):
        _checks.holds((n > 0).all(), "num_items_in_batch must be > 0 (the token count that normalizes the loss)",
                      lambda: f", got {float(n)!r}")


def _sequences(inputs: DistillInputs, cu_seqlens, invariant: bool) -> Sequences:
    """The tokens' grid: (B, T) rows for a (B, T, H) hidden, one row of N tokens for (N, H), packed sequences with
    ``cu_seqlens`` (hidden (N, H))."""
    shape = inputs.shape
    if cu_seqlens is None:
        return Sequences.rows(*shape, invariant=invariant) if len(shape) == 2 else \
            Sequences.rows(1, shape[0], invariant=invariant)
    if len(shape) != 1:
        raise ValueError(f"student_hidden must have shape (N, H) with cu_seqlens (packed rows), got "
                         f"{tuple(shape) + (inputs.student.hidden.shape[1],)}")
    _checks.tensor("cu_seqlens", cu_seqlens)
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must have shape (S + 1,), got {tuple(cu_seqlens.shape)}")
    N = shape[0]
    _checks.cu_seqlens(cu_seqlens, N, cu_seqlens.shape[0] - 1, inputs.student.hidden.device)
    return Sequences.packed(cu_seqlens, N, invariant)


def validate_distill(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias, teacher_bias,
                     mask, cfg: DistillLossConfig, impl="auto", num_items_in_batch=None, cu_seqlens=None):
    """(inputs, sequences, valid rows) of one distillation call (also what ``explain`` shows); ``inputs.cfg`` is the
    config as it runs (``invariance.as_run``: ``batch_invariant`` through ``invariance.requested``)."""
    cfg = invariance.as_run(cfg)
    inputs = DistillInputs.validate(student_hidden, student_weight, teacher_hidden, teacher_weight, student_bias,
                                    teacher_bias, cfg, impl)
    _checks.mask_like(mask, tuple(inputs.shape), " (student_hidden's leading dims)")
    _num_items(num_items_in_batch)
    seqs = _sequences(inputs, cu_seqlens, cfg.batch_invariant)
    rows = ValidRows.of(mask, inputs.n_tokens, seqs=seqs if seqs.is_packed else None)
    return inputs, seqs, rows


def plan_distill_call(op: str, inputs: DistillInputs, rows: ValidRows) -> planner.Plan:
    """The plan of a call (``op``: ``TOKEN_OP`` or ``LOSS_OP``)."""
    wants = torch.is_grad_enabled()
    s = inputs.student
    needs = tuple(wants and t is not None and t.requires_grad for t in (s.hidden, s.weight, s.bias))
    return planner.plan_distill(planner.DistillCall(op, inputs, op == LOSS_OP,
                                                    planner.Budget.of(inputs.cfg.memory_budget), needs, rows.count))


def _options(plan: planner.Plan, inputs: DistillInputs, seqs: Sequences) -> DistillOptions:
    return DistillOptions(plan.path, inputs.cfg, inputs.student.dtype, inputs.teacher.dtype, plan.chunk_rows or 1,
                          plan.vocab_tile or 0, seqs.grid[0], seqs.grid[1])


def _contexts(gather_head, teacher_gather_head):
    """What a recompute backward enters again: both heads' ZeRO-3 gathers (None without either)."""
    if gather_head is None and teacher_gather_head is None:
        return None

    def enter():
        stack = contextlib.ExitStack()
        stack.enter_context(sharded_head.gathered(gather_head))
        stack.enter_context(sharded_head.gathered(teacher_gather_head))
        return stack
    return enter


@contextlib.contextmanager
def _gathered_heads(student_weight, student_bias, teacher_weight, teacher_bias, gather_head, teacher_gather_head):
    """Both heads whole for the call: DTensor (FSDP2) heads all-gathered (the student's gradient reduce-scattered
    back; the teacher's without gradient), ZeRO-3 partitions gathered by their ``gather_head`` callables. Yields
    (student weight, bias, teacher weight, bias)."""
    sharded_head.check_gather_head(gather_head)
    sharded_head.check_gather_head(teacher_gather_head)
    ops.check_head_compilable(None, gather_head)
    ops.check_head_compilable(None, teacher_gather_head)
    student_weight, student_bias = sharded_head.gathered_dtensor_head(student_weight, student_bias)
    with torch.no_grad():
        teacher_weight, teacher_bias = sharded_head.gathered_dtensor_head(teacher_weight, teacher_bias)
    with sharded_head.gathered(gather_head), sharded_head.gathered(teacher_gather_head):
        yield student_weight, student_bias, teacher_weight, teacher_bias


def _tensors(inputs: DistillInputs, rows: ValidRows) -> tuple:
    """The six head tensors with the valid rows compacted (differentiably for the student's hidden)."""
    s, t = inputs.student, inputs.teacher
    sh, th = rows.compact(s.hidden, t.hidden)
    return sh, s.weight, s.bias, th, t.weight, t.bias


def linear_token_divergence(student_hidden, student_weight, teacher_hidden, teacher_weight, *, student_bias=None,
                            teacher_bias=None, mask=None, config: DistillLossConfig | None = None,
                            impl: str = "auto", gather_head=None, teacher_gather_head=None, **config_overrides):
    """Per-token (divergence, student entropy) between the student's and the teacher's next-token distributions,
    from both models' hidden states and lm_heads, never holding either model's N x V logits: TRL 1.16's
    ``ChunkedDivergenceFunction``.

    student_hidden (B, T, H_s) or (N, H_s), student_weight (V, H_s), student_bias (V,) | None; teacher_hidden with
    the same leading dims and its own width H_t, teacher_weight (V, H_t), teacher_bias. Each model's logits
    ``x = h W^T + b`` become ``z = cap * tanh(scale * x / cap) / temperature`` (``config``: a ``DistillLossConfig``,
    keyword overrides on top: beta, temperature, student_logit_scale, student_softcap, teacher_logit_scale,
    teacher_softcap, round_logits, batch_invariant, invariant_block_rows, deterministic, memory_budget). beta 0:
    KL(teacher || student), 1: KL(student || teacher), else the generalized JSD with mixture (1 - beta) p_student +
    beta p_teacher.

    Returns fp32 (fp64 for fp64 inputs on the PyTorch path) tensors shaped like the hiddens' leading dims; positions
    ``mask`` drops are 0 and are not computed. The divergence is differentiable with respect to the student's
    hidden, weight and bias (each when it requires grad); the entropy is not, and the teacher gets no gradient even
    when its tensors require one (TRL's). DTensor (FSDP2) heads are gathered for the call; ZeRO-3 partitions take
    ``gather_head`` / ``teacher_gather_head`` (``zero3_gather_head``), entered around the forward and the backward.
    """
    cfg = resolve_distill_config(config, config_overrides)
    with _gathered_heads(student_weight, student_bias, teacher_weight, teacher_bias, gather_head,
                         teacher_gather_head) as (sw, sb, tw, tb):
        inputs, seqs, rows = validate_distill(student_hidden, sw, teacher_hidden, tw, sb, tb, mask, cfg, impl)
        plan = plan_distill_call(TOKEN_OP, inputs, rows)
        div, ent = token_divergence_call(_tensors(inputs, rows), _options(plan, inputs, seqs), rows.deferred,
                                         _contexts(gather_head, teacher_gather_head))
        div, ent = rows.scatter(div, ent)
    return div.view(inputs.shape), ent.view(inputs.shape)


def fused_linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask=None, *,
                              student_bias=None, teacher_bias=None, num_items_in_batch=None, cu_seqlens=None,
                              config: DistillLossConfig | None = None, impl: str = "auto", gather_head=None,
                              teacher_gather_head=None, **config_overrides):
    """The distillation loss of TRL 1.16's ``_chunked_divergence_loss``: ``sum(D) / num_items_in_batch`` over the
    valid tokens when given, else their mean, with ``D`` ``linear_token_divergence``'s per-token divergence.
    Returns ``(loss, metrics)``: a 0-dim fp32 loss and the detached 0-dim metrics ``divergence`` and ``entropy``
    (masked means of the divergence and the student's entropy), ``entropy_sum`` and ``num_tokens`` (what TRL's
    trainer reduces across ranks).

    mask: shaped like the hiddens' leading dims (None: every token). cu_seqlens (S + 1,) int32 / int64 (packed
    sequences, flash-attn's convention): hiddens (N, H), mask (N,); the same numbers as the padded call on the same
    tokens (the sequences matter only to the order of the batch-invariant sums). On the Triton path the loss makes the
    student's gradients in its forward (``distill.fast``, 8NHV) when they fit ``memory_budget``; otherwise, and for
    ``grad_in_forward=False``, the recompute path. Other arguments as ``linear_token_divergence``.
    """
    cfg = resolve_distill_config(config, config_overrides)
    with _gathered_heads(student_weight, student_bias, teacher_weight, teacher_bias, gather_head,
                         teacher_gather_head) as (sw, sb, tw, tb):
        inputs, seqs, rows = validate_distill(student_hidden, sw, teacher_hidden, tw, sb, tb, mask, cfg, impl,
                                              num_items_in_batch, cu_seqlens)
        plan = plan_distill_call(LOSS_OP, inputs, rows)
        o = _options(plan, inputs, seqs)
        keep = torch.ones(seqs.grid, dtype=torch.bool, device=student_hidden.device) if mask is None else \
            mask.reshape(seqs.grid) != 0
        if plan.path in (DISTILL_FAST, DISTILL_TORCH_FAST):
            acc = ops.acc_dtype(inputs.student.hidden) if plan.path == DISTILL_TORCH_FAST else torch.float32
            mask_f = keep.to(acc)
            w = distill_weights(mask_f, num_items_in_batch, seqs).reshape(-1)
            w_rows = w.contiguous() if ops.compiling() else rows.compact(w)[0].contiguous()
            loss, sums = loss_in_forward_call(_tensors(inputs, rows), w_rows, o, rows.index, seqs.cu_seqlens,
                                              rows.deferred)
            return loss, _metrics(sums, seqs.total(mask_f), acc)
        div, ent = token_divergence_call(_tensors(inputs, rows), o, rows.deferred,
                                         _contexts(gather_head, teacher_gather_head))
        div, ent = rows.scatter(div, ent)
    return loss_from_divergence(div.view(seqs.grid), ent.view(seqs.grid), keep, num_items_in_batch, seqs)


def _metrics(sums: torch.Tensor, n: torch.Tensor, dtype) -> dict:
    """The loss's metrics from the fast path's fp64 sums (divergence, entropy) and the valid-token count."""
    div_sum, ent_sum = sums.to(dtype).unbind(0)
    n = n.to(dtype)
    return {"divergence": div_sum / n.clamp(min=1), "entropy": ent_sum / n.clamp(min=1), "entropy_sum": ent_sum,
            "num_tokens": n}


class FusedLinearDistillLoss(nn.Module):
    """``fused_linear_distill_loss`` with a fixed ``DistillLossConfig``:
    ``FusedLinearDistillLoss(beta=0.5)(student_hidden, student_weight, teacher_hidden, teacher_weight, mask)``."""

    def __init__(self, config: DistillLossConfig | None = None, impl: str = "auto", **overrides):
        super().__init__()
        self.config = resolve_distill_config(config, overrides)
        self.impl = impl

    def forward(self, student_hidden, student_weight, teacher_hidden, teacher_weight, mask=None, **kwargs):
        return fused_linear_distill_loss(student_hidden, student_weight, teacher_hidden, teacher_weight, mask,
                                         config=self.config, impl=self.impl, **kwargs)


def plan_of(fn, args: tuple, kwargs: dict) -> planner.Plan:
    """The ``Plan`` of ``fn(*args, **kwargs)`` for one of the two distillation functions, without running it
    (``explain``)."""
    import inspect

    bound = inspect.signature(fn).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    cfg = resolve_distill_config(a["config"], a.pop("config_overrides", {}) or {})
    tensors = (a["student_hidden"], a["student_weight"], a["teacher_hidden"], a["teacher_weight"],
               a["student_bias"], a["teacher_bias"], a["mask"], cfg, a["impl"])
    more = (a["num_items_in_batch"], a["cu_seqlens"]) if fn is fused_linear_distill_loss else ()
    inputs, seqs, rows = validate_distill(*tensors, *more)
    plan = plan_distill_call(LOSS_OP if fn is fused_linear_distill_loss else TOKEN_OP, inputs, rows)
    return planner.with_sequences_note(plan, seqs)


DISTILL_FUNCTIONS = {TOKEN_OP: linear_token_divergence, LOSS_OP: fused_linear_distill_loss}
