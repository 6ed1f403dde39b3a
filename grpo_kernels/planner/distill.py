"""The two-head divergence's plans: ``plan_distill(DistillCall) -> Plan`` for ``linear_token_divergence`` and
``fused_linear_distill_loss``, one small function per path (docs/DESIGN.md, "Distillation"; docs/memory.md,
"Distillation"):

| path | when |
|---|---|
| ``distill.torch_fast`` | impl torch, the loss, a gradient wanted, ``grad_in_forward`` |
| ``distill.torch`` | impl torch otherwise (the per-token function, no gradient, ``grad_in_forward=False``) |
| ``distill.no_grad`` | Triton, no student tensor needs a gradient |
| ``distill.fast`` | Triton, the loss, ``grad_in_forward``, the accumulators and two chunks of min(N, 256) rows fit |
| ``distill.light`` | Triton otherwise (the per-token function with a gradient, small budgets) |

``memory_budget`` keeps its one meaning (``planner.Budget``): the transient bytes beyond the inputs and returned
gradients, with the fast path's fp32 accumulators added to the default.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._testing import knobs
from ..distill_config import JSD
from ..head.distill_torch import TORCH_DISTILL_TEMPS, TORCH_WEIGHT_TILE
from ..invariance import block_rows
from ..paths import DISTILL_FAST, DISTILL_LIGHT, DISTILL_NO_GRAD, DISTILL_TORCH, DISTILL_TORCH_FAST
from .common import Budget, Plan, head_accumulator_bytes, per_token_bytes, shown

# Fewest rows per chunk worth the fast path: the per-chunk read + write of the fp32 dW accumulator (8 V H_s bytes)
# against the chunk's 8 R V H FLOPs, as for ``head.fast`` (planner.head.FAST_PATH_MIN_ROWS).
DISTILL_FAST_MIN_ROWS = 256
# Rows a tile of the light / no-grad paths aims for before it narrows the vocabulary; the widest narrowed tile
# (TRL's ``VOCAB_CHUNK_SIZE``) and the narrowest.
TILE_ROWS = 256
VOCAB_TILE = 32768
MIN_VOCAB_TILE = 16
# The no-grad pass gains nothing from chunks above this (two fp32 chunks of 256 MiB).
NO_GRAD_CHUNK_CAP = 512 << 20
# Per-token fp32 values of the Triton paths: the divergence, entropy, both logsumexps, aux, the weight / incoming
# gradient, and the light forward's online state (m, s, a for the student, m, s for the teacher, the gap sum, the
# JSD's two sums).
TRITON_TOKEN_VALUES = 14


@dataclass(frozen=True)
class DistillCall:
    """What the planner needs of a distillation call: the validated inputs (``distill_inputs.DistillInputs``, with
    the options), whether the per-token gradient is known before the sweep (the loss: its reduction weights), the
    budget, the student's gradients wanted (hidden, weight, bias) and the rows computed after compaction."""

    op: str
    inputs: object
    loss: bool
    budget: Budget
    needs: tuple
    n_valid: int


def plan_distill(call: DistillCall) -> Plan:
    """The path of one distillation call and its layout (rows per chunk, vocabulary tile), FLOPs and transient
    memory."""
    inputs = call.inputs
    grad = call.needs[0] or call.needs[1] or (call.needs[2] and inputs.student.bias is not None)
    fixed = _fixed_items(call)
    if inputs.impl == "torch":
        plan = _torch(call, fixed, grad)
    elif not grad:
        plan = _no_grad(call, fixed)
    else:
        plan, why = _fast(call, fixed)
        plan = plan or _light(call, fixed, why)
    return _with_notes(plan, call)


def _fixed_items(call: DistillCall) -> tuple:
    """What every path allocates besides its own working memory: the compacted valid rows of both hiddens and the
    student's d hidden of them, and the copies in the compute dtype (autocast)."""
    s, t = call.inputs.student, call.inputs.teacher
    N, total = call.n_valid, call.inputs.n_tokens
    items = []
    if N < total:
        items.append(("compacted valid rows of both hiddens", N * (s.hidden.shape[1] * s.hidden.dtype.itemsize
                                                                   + t.hidden.shape[1] * t.hidden.dtype.itemsize)))
        if call.needs[0]:
            items.append(("d student hidden of the compacted rows", N * s.hidden.shape[1] * s.hidden.dtype.itemsize))
    for name, head in (("student", s), ("teacher", t)):
        rows = head.cast_bytes(weight=False) * N // max(total, 1)
        if rows:
            items.append((f"{name} hidden in the compute dtype (autocast)", rows))
        if head.cast_bytes(hidden=False):
            items.append((f"{name} weight in the compute dtype (autocast)", head.cast_bytes(hidden=False)))
    if call.needs[0] and s.hidden.dtype != s.dtype:
        items.append(("d student hidden in the compute dtype", N * s.hidden.shape[1] * s.dtype.itemsize))
    return tuple(items)


def _plan(call: DistillCall, fixed: tuple, path: str, reason: str, budget: int, items, flops: tuple, **kw) -> Plan:
    """flops: (multiple of N V H_student, multiple of N V H_teacher)."""
    H_s, H_t = call.inputs.student.weight.shape[1], call.inputs.teacher.weight.shape[1]
    nhv = flops[0] + flops[1] if call.n_valid else 0
    note = f"matmul FLOPs: {flops[0]} N V H_student + {flops[1]} N V H_teacher (H_student {H_s}, H_teacher {H_t})"
    return Plan(op=call.op, path=path, reason=reason, impl=call.inputs.impl, budget=budget, rows=call.n_valid,
                vocab=call.inputs.vocab, transient=fixed + tuple(i for i in items if i[1]), flops_nhv=nhv,
                deterministic=True, batch_invariant=call.inputs.cfg.batch_invariant, notes=(note,), **kw)


def _sum(items) -> int:
    return sum(b for _, b in items)


def _grad_flops(call: DistillCall) -> int:
    """The student's gradient GEMMs per N V H_student: dH (2) and dW (2), each when wanted."""
    return 2 * bool(call.needs[0]) + 2 * bool(call.needs[1])


def _even_rows(n: int, max_rows: int) -> int:
    """Rows per chunk for n rows at most max_rows each, spread evenly (no small last chunk)."""
    if n <= 0:
        return max(1, min(max_rows, 1))
    chunks = -(-n // max(max_rows, 1))
    return -(-n // chunks)


def _fixed_rows(call: DistillCall) -> int:
    """The rows per block of ``batch_invariant``: the caller's ``invariant_block_rows``, else the device's."""
    return block_rows(call.inputs.student.hidden.device, call.inputs.cfg.invariant_block_rows)


def _torch(call: DistillCall, fixed: tuple, grad: bool) -> Plan:
    """Row chunks over the whole vocabulary: two logits buffers and ``TORCH_DISTILL_TEMPS`` temporaries of their
    size, in the accumulation dtype; the student's gradients accumulate in it too (transient when it is not the
    tensors' own dtype)."""
    inputs, N, V = call.inputs, call.n_valid, call.inputs.vocab
    s, t = inputs.student, inputs.teacher
    acc = 8 if s.hidden.dtype == torch.float64 else 4
    acc_dtype = torch.float64 if acc == 8 else torch.float32
    budget = call.budget.working()
    accum = []
    if grad:
        if call.needs[0] and s.hidden.dtype != acc_dtype:
            accum.append(("d student hidden accumulator", acc * N * s.hidden.shape[1]))
        if call.needs[1] and s.weight.dtype != acc_dtype:
            accum.append(("d student weight accumulator", acc * V * s.weight.shape[1]))
        if call.needs[2] and s.bias is not None and s.bias.dtype != acc_dtype:
            accum.append(("d student bias accumulator", acc * V))
    half = [h for h in (s, t) if h.weight.dtype != acc_dtype]
    weight_tile = max([acc * min(V, TORCH_WEIGHT_TILE) * h.weight.shape[1] for h in half] or [0])
    temps = TORCH_DISTILL_TEMPS[inputs.cfg.mode]
    rows_acc = acc * (s.hidden.shape[1] + t.hidden.shape[1]) if s.hidden.dtype != acc_dtype else 0
    per_row = int((2 + temps) * acc * V) + rows_acc
    small = acc * 6 * N
    need = _sum(fixed) + _sum(accum) + small + weight_tile + per_row
    if budget < need:
        raise call.budget.error(call.op, DISTILL_TORCH, need)
    rows = _even_rows(N, min(max(N, 1), (budget - need + per_row) // per_row))
    if inputs.cfg.batch_invariant:
        rows = _fixed_rows(call)
        if budget < need + (rows - 1) * per_row:
            raise call.budget.error(call.op, DISTILL_TORCH + " (batch_invariant)", need + (rows - 1) * per_row)
    n = min(rows, max(N, 1))
    # Why the larger of two phases: the weight tile lives while the GEMMs run, the temporaries after them.
    maths = [("both heads' logits chunks and their temporaries", int(n * (2 + temps) * acc * V))]
    gemms = [("both heads' logits chunks", 2 * n * acc * V), ("weight tile in the accumulation dtype", weight_tile)]
    items = accum + (maths if _sum(maths) >= _sum(gemms) else gemms) + \
        [("hidden rows in the accumulation dtype", n * rows_acc), ("per-token values", small)]
    fast = grad and call.loss and inputs.cfg.grad_in_forward
    g = _grad_flops(call)
    if fast:
        return _plan(call, fixed, DISTILL_TORCH_FAST, "impl torch (CPU tensors, or impl='torch'), the loss with a "
                     "gradient: the student's gradients made in the forward", budget, items, (2 + g, 2),
                     chunk_rows=rows)
    why = "impl torch (CPU tensors, or impl='torch')" + ("" if not grad else (
        ", grad_in_forward=False" if call.loss else ", the per-token divergence: the gradient of what follows is "
                                                    "not known in the forward: recomputed in the backward"))
    flops = (4 + g, 4) if grad else (2, 2)
    return _plan(call, fixed, DISTILL_TORCH, why, budget, items, flops, chunk_rows=rows)


def _tiles(N: int, V: int, room: int, min_rows: int, col_extra: int = 0):
    """(rows, vocabulary tile) of two fp32 (rows, tile) buffers, plus ``col_extra`` bytes per tile column, within
    ``room`` bytes: the whole V when min(N, min_rows) rows fit, else ``TILE_ROWS`` rows (fewer when N is) over the
    widest tile that fits (at most ``VOCAB_TILE``, a multiple of 16 columns so that rows stay 64-byte aligned, at
    least ``MIN_VOCAB_TILE``), then fewer rows; None when not even one row of the narrowest tile fits."""
    want = max(1, min(N, min_rows))
    if room >= V * (8 * want + col_extra):
        return _even_rows(N, (room - V * col_extra) // (8 * V)), V
    rows = max(1, min(N, TILE_ROWS))
    while rows >= 1:
        widest = min(V, VOCAB_TILE, room // (8 * rows + col_extra))
        if widest >= MIN_VOCAB_TILE:
            tiles = -(-V // widest)  # the fewest tiles, then their width evenly split, rounded up to 16
            tile = min(V, -(-(-(-V // tiles)) // 16) * 16)
            tile = tile if tile <= widest else widest // 16 * 16
            return rows, tile
        rows //= 2
    return None


def _no_grad(call: DistillCall, fixed: tuple) -> Plan:
    """Tiles of both heads' fp32 logits (the whole vocabulary when it fits), at most ``NO_GRAD_CHUNK_CAP``."""
    N, V = call.n_valid, call.inputs.vocab
    budget = call.budget.working()
    small = per_token_bytes(N, TRITON_TOKEN_VALUES)
    room = min(budget - _sum(fixed) - small, knobs().no_grad_chunk_cap or NO_GRAD_CHUNK_CAP)
    layout = (_fixed_rows(call), V) if call.inputs.cfg.batch_invariant else _tiles(N, V, room, 1)
    if layout is None or 8 * layout[0] * layout[1] > budget - _sum(fixed) - small:
        raise call.budget.error(call.op, DISTILL_NO_GRAD, _sum(fixed) + small + 8 * MIN_VOCAB_TILE)
    rows, tile = layout
    items = [("both heads' fp32 logits tiles", 8 * min(rows, max(N, 1)) * tile), ("per-token values", small)]
    return _plan(call, fixed, DISTILL_NO_GRAD, "no gradient wanted", budget, items,
                 _forward_flops(call, tile), chunk_rows=rows, vocab_tile=tile if tile < V else None)


def _forward_flops(call: DistillCall, tile: int) -> tuple:
    """Both heads' forward GEMMs per N V H: once, twice for the JSD over tiles narrower than V."""
    passes = 2 if call.inputs.cfg.mode == JSD and tile < call.inputs.vocab else 1
    return 2 * passes, 2 * passes


def _fast(call: DistillCall, fixed: tuple):
    """(the gradient-in-forward plan, or None, and why not)."""
    inputs, N, V = call.inputs, call.n_valid, call.inputs.vocab
    if not call.loss:
        return None, "the per-token divergence: the gradient of what follows is not known in the forward"
    if not inputs.cfg.grad_in_forward:
        return None, "grad_in_forward=False"
    s = inputs.student
    accum = head_accumulator_bytes(V, s.weight.shape[1], s.weight.dtype, None if s.bias is None else s.bias.dtype,
                                   call.needs[1], call.needs[2] and s.bias is not None)
    small = per_token_bytes(N, TRITON_TOKEN_VALUES)
    budget = call.budget.working(accum + _sum(fixed) + small)
    max_rows = max(0, budget - accum - _sum(fixed) - small) // (8 * V)
    least = min(N, knobs().fast_path_min_rows or DISTILL_FAST_MIN_ROWS)
    if inputs.cfg.batch_invariant:
        least = _fixed_rows(call)
    if N and max_rows < least:
        return None, (f"the budget leaves room for {shown(max_rows)} rows per chunk of both heads' logits beside "
                      f"the accumulators, fewer than {shown(least)}")
    rows = least if inputs.cfg.batch_invariant else _even_rows(N, max(max_rows, 1))
    items = [("fp32 d student weight / d bias accumulators", accum),
             ("both heads' fp32 logits chunks (d student logits written in place)", 8 * min(rows, max(N, 1)) * V),
             ("per-token values", small)]
    return _plan(call, fixed, DISTILL_FAST, "Triton, the loss with a gradient, and the accumulators plus two "
                 f"chunks of at least {shown(least)} rows fit the budget", budget, items, (2 + _grad_flops(call), 2),
                 chunk_rows=rows), ""


def _light(call: DistillCall, fixed: tuple, why: str) -> Plan:
    """Tiles of both heads' fp32 logits, recomputed in the backward, vocabulary tiles outermost: the student's
    d hidden accumulates in fp32 over the tiles (an (N, H_s) accumulator, transient when the hidden is not fp32),
    d weight in an fp32 (tile, H_s) one per tile (when the weight is not fp32), d bias in fp32."""
    inputs, N, V = call.inputs, call.n_valid, call.inputs.vocab
    s = inputs.student
    accum = []
    if call.needs[0] and s.dtype != torch.float32:
        accum.append(("fp32 d student hidden accumulator", 4 * N * s.hidden.shape[1]))
    if call.needs[2] and s.bias is not None:
        accum.append(("fp32 d student bias accumulator", 4 * V))
    col_extra = 4 * s.weight.shape[1] if call.needs[1] and s.dtype != torch.float32 else 0
    small = per_token_bytes(N, TRITON_TOKEN_VALUES)
    # Why the default budget adds the accumulators of a whole-vocabulary layout (as distill.fast's does): with
    # them the JSD needs no second forward pass over vocabulary tiles (12NHV instead of 16NHV)
    budget = call.budget.working(_sum(fixed) + _sum(accum) + small + col_extra * V)
    room = budget - _sum(fixed) - _sum(accum) - small
    layout = (_fixed_rows(call), V) if inputs.cfg.batch_invariant else _tiles(N, V, room, TILE_ROWS, col_extra)
    if layout is None or layout[1] * (8 * layout[0] + col_extra) > room:
        raise call.budget.error(call.op, DISTILL_LIGHT, _sum(fixed) + _sum(accum) + small
                                + MIN_VOCAB_TILE * (8 + col_extra))
    rows, tile = layout
    items = accum + [("fp32 d student weight accumulator" + (" of a vocabulary tile" if tile < V else ""),
                      col_extra * tile),
                     ("both heads' fp32 logits tiles (d student logits written in place)",
                      8 * min(rows, max(N, 1)) * tile), ("per-token values", small)]
    fwd = _forward_flops(call, tile)
    return _plan(call, fixed, DISTILL_LIGHT, why, budget, items, (fwd[0] + 2 + _grad_flops(call), fwd[1] + 2),
                 chunk_rows=rows, vocab_tile=tile if tile < V else None)


def _with_notes(plan: Plan, call: DistillCall) -> Plan:
    """The plan with lines for the divergence beta selects and the transforms (they change no chunk or byte)."""
    from dataclasses import replace

    if torch.compiler.is_compiling():  # no notes while compiling: a symbolic beta / temperature has no printed value
        return plan
    cfg = call.inputs.cfg
    kind = {0: "forward KL(teacher || student) (beta = 0)", 1: "reverse KL(student || teacher) (beta = 1)"}.get(
        cfg.mode, f"generalized JSD, mixture (1 - {cfg.beta:g}) p_student + {cfg.beta:g} p_teacher")
    notes = [f"divergence: {kind}; temperature {cfg.temperature:g}"]
    for name, t in (("student", cfg.student), ("teacher", cfg.teacher)):
        if t.scale != 1.0 or t.softcap is not None:
            cap = "" if t.softcap is None else f", soft cap {t.softcap:g}"
            notes.append(f"{name} logits: scale {t.scale:g}{cap}, then the temperature")
    if cfg.round_logits is not None:
        notes.append(f"round_logits {cfg.round_logits}: both heads' raw logits rounded before the scale; "
                     "straight-through in the backward")
    return replace(plan, notes=plan.notes + tuple(notes))
