"""The fused head's plans: ``plan_head(HeadCall) -> Plan`` for ``fused_linear_grpo_loss`` / ``linear_token_logprobs``,
one small function per head path (head.torch, head.no_grad, head.fast, head.fast_sequence, head.fast_vocab_parallel,
head.light; docs/DESIGN.md, "The planner and the paths"), and the head's own sizing: its chunks of whole sequences
(``sequence_chunks``), its extra outputs' bytes (the fp32 accumulators, ``head_accumulator_bytes``, are in
``common``: the distillation plans size them too)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .._testing import knobs
from ..head.torch_tiles import TORCH_HEAD_TEMPS, TORCH_HEAD_TILE_VOCAB
from ..invariance import INVARIANT_LIGHT_ROOM, block_rows
from ..loss_types import per_token_gradient_known
from ..paths import HEAD_FAST, HEAD_FAST_SEQUENCE, HEAD_FAST_VOCAB_PARALLEL, HEAD_LIGHT, HEAD_NO_GRAD, HEAD_TORCH
from .common import HeadCall, Plan, head_accumulator_bytes, per_token_bytes, shown, with_cap_note

# Fewest rows per chunk worth the fused head's fast path: below ~256 rows the per-chunk read + write of the fp32 dW
# accumulator (8 V H bytes) costs more than the chunk's GEMMs (6 R V H FLOPs) on an H100 / H200.
FAST_PATH_MIN_ROWS = 256
# The no-grad head pass gains nothing from chunks above this (the GEMM is at full speed from ~400 rows at V = 152k).
NO_GRAD_CHUNK_CAP = 256 << 20


@dataclass(frozen=True)
class _HeadCosts:
    """What every head path of a call allocates besides its own working memory: ``copies`` (compute-dtype casts,
    compacted rows and their d hidden), ``cast_grads`` (gradients in the compute dtype before autograd's cast, on
    the paths behind autograd's casts), ``weight_cast`` (the weight / bias cast's bytes) and the per-token stage."""

    copies: tuple
    cast_grads: tuple
    weight_cast: int
    stage: str | None

    @property
    def fixed(self) -> int:
        return sum(b for _, b in self.copies)


def _head_costs(call: HeadCall) -> _HeadCosts:
    inputs, (V, H) = call.inputs, call.inputs.weight.shape
    need_h, need_w, _ = call.needs
    N, it = call.n_valid, inputs.dtype.itemsize
    copies = []
    if inputs.cast_bytes(weight=False):
        copies.append(("hidden in the compute dtype (autocast)", inputs.cast_bytes(weight=False)))
    if N < inputs.ids.numel():
        copies.append(("compacted valid rows of hidden", N * H * it))
        if need_h:
            copies.append(("d hidden of the compacted rows", N * H * it))
    weight_cast = inputs.cast_bytes(hidden=False)
    if weight_cast:
        copies.append(("weight / bias in the compute dtype (autocast)", weight_cast))
    # The paths behind autograd's casts hand back gradients in the compute dtype, cast by autograd afterwards: those
    # compute-dtype gradients are transient (the fast paths cast inside and return the given dtypes directly).
    cast_grads = []
    if need_w and inputs.weight.dtype != inputs.dtype:
        cast_grads.append(("d weight in the compute dtype, before autograd's cast", V * H * it))
    if need_h and inputs.hidden.dtype != inputs.dtype:
        cast_grads.append(("d hidden in the compute dtype, before autograd's cast", inputs.ids.numel() * H * it))
    cfg = call.cfg
    stage = None if cfg is None else ("triton" if inputs.impl == "triton" and per_token_gradient_known(cfg)
                                      and inputs.ids.numel() > 0 else "reference")
    return _HeadCosts(tuple(copies), tuple(cast_grads), weight_cast, stage)


def _head_plan(call: HeadCall, costs: _HeadCosts, path: str, reason: str, budget: int, items, **kw) -> Plan:
    return Plan(op=call.op, path=path, reason=reason, impl=call.inputs.impl, budget=budget, rows=call.n_valid,
                vocab=call.inputs.weight.shape[0], transient=costs.copies + tuple(items),
                token_stage=kw.pop("token_stage", costs.stage), deterministic=call.deterministic, **kw)


def _flops(call: HeadCall, grad_nhv: int) -> int:
    return grad_nhv if call.n_valid else 0


def plan_head(call: HeadCall) -> Plan:
    """The path of ``fused_linear_grpo_loss`` (``call.cfg`` given) or ``linear_token_logprobs`` (None)."""
    costs = _head_costs(call)
    if call.batch_invariant and not call.deterministic:
        raise ValueError("batch_invariant=True needs deterministic=True (float atomics add in an order that changes "
                         "from run to run)")
    if call.inputs.impl == "torch":
        plan = _head_torch(call, costs)
    elif not any(call.needs[:2]) and not (call.needs[2] and call.inputs.bias is not None):
        plan = _head_no_grad(call, costs)
    else:
        plan, why = _head_fast_family(call, costs)
        plan = plan or _head_light(call, costs, why)
    if call.batch_invariant:
        plan = replace(plan, batch_invariant=True)
    return with_cap_note(plan, call.inputs.transform)


def _fixed_rows(call: HeadCall) -> int:
    """The batch-invariant paths' rows per block on the call's device (``invariance.block_rows``)."""
    return block_rows(call.inputs.hidden.device, call.invariant_rows)


def _head_torch(call: HeadCall, costs: _HeadCosts) -> Plan:
    """Tiles of rows x ``TORCH_HEAD_TILE_VOCAB`` whose temporaries (and, for half inputs, fp32 accumulators) fit."""
    inputs, (V, H), N = call.inputs, call.inputs.weight.shape, call.n_valid
    need_h, need_w, _ = call.needs
    grad = any(call.needs[:2]) or (call.needs[2] and inputs.bias is not None)
    budget = call.budget.working()
    acc = 8 if inputs.dtype == torch.float64 else 4
    half = inputs.dtype not in (torch.float32, torch.float64)
    vt = min(V, TORCH_HEAD_TILE_VOCAB)
    accum = []
    if grad and half:
        if need_h:
            accum.append(("fp32 d hidden accumulator", 4 * N * H))
        if need_w:
            accum.append(("fp32 d weight accumulator", 4 * V * H))
    loop_fixed = 4 * vt * H if half else 0  # the weight tile in fp32, alive with the logits tiles
    per_row = TORCH_HEAD_TEMPS * acc * vt + (acc * H if half else 0)
    small = per_token_bytes(N, 4) + _extra_bytes(call, acc)
    need = costs.fixed + sum(b for _, b in accum) + small + loop_fixed + per_row
    if budget < need:
        raise call.budget.error(call.op, HEAD_TORCH, need)
    rows = max(1, min(max(N, 1), (budget - need + per_row) // per_row))
    if call.batch_invariant:  # every tile exactly this many rows, whatever N and the budget
        rows = _fixed_rows(call)
        if budget < need + (rows - 1) * per_row:
            raise call.budget.error(call.op, HEAD_TORCH + " (batch_invariant)", need + (rows - 1) * per_row)
    loop = [("weight tile in fp32", loop_fixed), ("logits tiles", rows * TORCH_HEAD_TEMPS * acc * vt),
            ("hidden rows in fp32", rows * acc * H if half else 0)]
    items = accum + _larger_phase(loop, costs.cast_grads) + [("per-token values", small)]
    return _head_plan(call, costs, HEAD_TORCH, "impl torch (CPU tensors, or impl='torch')", budget, items,
                      chunk_rows=rows, flops_nhv=_flops(call, 8 if grad else 2))


def _head_no_grad(call: HeadCall, costs: _HeadCosts) -> Plan:
    """Row chunks of fp32 logits for the GEMM + fold, at most ``NO_GRAD_CHUNK_CAP`` bytes each."""
    V, N = call.inputs.weight.shape[0], call.n_valid
    budget = call.budget.working()
    small = per_token_bytes(N, 3) + _extra_bytes(call)
    room = min(budget - costs.fixed - small, knobs().no_grad_chunk_cap or NO_GRAD_CHUNK_CAP)
    if room < 4 * V:
        raise call.budget.error(call.op, HEAD_NO_GRAD, costs.fixed + small + 4 * V)
    rows = _even_rows(N, room // (4 * V))
    chunk = min(rows, max(N, 1)) * 4 * V
    if call.batch_invariant:  # every GEMM of exactly this many rows (the last chunk padded)
        rows = _fixed_rows(call)
        chunk = rows * 4 * V
        if budget < costs.fixed + small + chunk:
            raise call.budget.error(call.op, HEAD_NO_GRAD + " (batch_invariant)", costs.fixed + small + chunk)
    items = [("fp32 logits chunk", chunk), ("per-token values", small)]
    return _head_plan(call, costs, HEAD_NO_GRAD, "no gradient wanted", budget, items, chunk_rows=rows,
                      flops_nhv=_flops(call, 2))


def _head_fast_family(call: HeadCall, costs: _HeadCosts):
    """(the gradient-in-forward plan, or None, and why not): the room beside the fp32 accumulators decides the
    rows per chunk; token-level configurations take ``head.fast``, sequence-level ones chunks of whole sequences."""
    cfg = call.cfg
    if cfg is None:
        return None, "log-probs only (the gradient of later code is not known in the forward)"
    if not cfg.grad_in_forward:
        return None, "grad_in_forward=False"
    if cfg.top_entropy_quantile < 1.0:
        return None, "the top-entropy mask is a quantile over the whole batch"
    (V, H), bias = call.inputs.weight.shape, call.inputs.bias
    accum = head_accumulator_bytes(V, H, call.inputs.weight.dtype, None if bias is None else bias.dtype,
                                   call.needs[1], call.needs[2] and bias is not None)
    small = per_token_bytes(call.n_valid, 18)
    budget = call.budget.working(accum + costs.fixed + small)
    max_rows = max(0, budget - accum - costs.fixed - small) // (4 * V)
    items = [("fp32 d weight / d bias accumulators", accum)] if accum else []
    if call.batch_invariant and (call.shard is not None or not per_token_gradient_known(cfg)):
        # Why: their chunks are whole sequences, whose sizes are the batch's (the GEMMs' shapes would follow them)
        return None, "batch_invariant: chunks of whole sequences would take the batch's shapes"
    if call.shard is not None:
        return _head_fast_vocab_parallel(call, costs, budget, items, accum)
    if per_token_gradient_known(cfg):
        return _head_fast(call, costs, budget, items, max_rows)
    return _head_fast_sequence(call, costs, budget, items, max_rows)


def _head_fast(call: HeadCall, costs: _HeadCosts, budget: int, items: list, max_rows: int):
    N = call.n_valid
    least = min(N, _fast_min_rows())
    if N and max_rows < least:
        return None, (f"the budget leaves room for {shown(max_rows)} rows per chunk beside the accumulators, fewer "
                      f"than {shown(least)}")
    V = call.inputs.weight.shape[0]
    rows = _even_rows(N, max(max_rows, 1))
    chunk = min(rows, max(N, 1)) * 4 * V
    if call.batch_invariant:  # every chunk exactly this many rows (the last one padded)
        rows = _fixed_rows(call)
        chunk = rows * 4 * V
        if max_rows < rows:
            return None, f"batch_invariant: the budget leaves room for fewer rows per chunk than its {rows}-row blocks"
    items = items + [("fp32 logits chunk (d logits written in place)", chunk),
                     ("per-token values and terms", per_token_bytes(N, 18))]
    return _head_plan(call, costs, HEAD_FAST, "Triton, a token-level configuration, a gradient wanted, and the "
                      f"accumulators plus a chunk of at least {shown(least)} rows fit the budget", budget, items,
                      chunk_rows=rows, flops_nhv=_flops(call, 6 if call.needs[1] else 4),
                      token_stage="in the epilogue kernel"), ""


def _head_fast_sequence(call: HeadCall, costs: _HeadCosts, budget: int, items: list, max_rows: int):
    counts, offsets = (call.sequence_counts() if call.sequence_counts else None) or (None, None)
    if not counts:
        return None, "the sequence-level path needs a mask it can count"
    if max_rows < min(call.n_valid, _fast_min_rows()) or max(counts) > max_rows:
        return None, "a sequence longer than the rows the budget allows per chunk"
    chunks = sequence_chunks(counts, max_rows, offsets, call.inputs.shape[-1])
    rows = max(c[3] - c[2] for c in chunks)
    items = items + [("fp32 logits chunk (d logits written in place)", rows * 4 * call.inputs.weight.shape[0]),
                     ("per-token values", per_token_bytes(call.n_valid, 18))]
    return _head_plan(call, costs, HEAD_FAST_SEQUENCE, "Triton, a gradient wanted, and every sequence's valid "
                      "tokens fit one chunk beside the accumulators", budget, items, chunk_rows=rows,
                      sequence_chunks=tuple(chunks), flops_nhv=_flops(call, 6 if call.needs[1] else 4)), ""


def _head_fast_vocab_parallel(call: HeadCall, costs: _HeadCosts, budget: int, items: list, accum: int):
    """Why the whole vocabulary's V for the rows: every rank must cut the same chunks (each chunk is a collective),
    and the shards' sizes may differ; the chunk itself is R x V_shard."""
    V, N = call.inputs.weight.shape[0], call.n_valid
    total, world = call.shard.total or V, max(call.shard.world, 1)
    small = per_token_bytes(N, 18)
    if call.budget.given is None:
        working = call.budget.working()
    else:  # the shard-sized items as if the shard were the whole vocabulary: the same rows on every rank
        working = budget - (accum + costs.weight_cast) * total // V - (costs.fixed - costs.weight_cast) - small
    rows_all = max(0, working) // (4 * total + 12 * world)
    counts, offsets = (call.sequence_counts() if call.sequence_counts else None) or (None, None)
    if not counts:
        return None, "vocab-parallel: the fast path needs a mask it can count"
    if rows_all < min(N, _fast_min_rows()) or max(counts) > rows_all:
        return None, "vocab-parallel: a sequence longer than the rows the budget allows per chunk"
    chunks = sequence_chunks(counts, rows_all, offsets, call.inputs.shape[-1])
    rows = max(c[3] - c[2] for c in chunks)
    items = items + [("fp32 logits chunk of the shard (d logits written in place)", rows * 4 * V),
                     ("gathered row statistics of a chunk", rows * 12 * world), ("per-token values", small)]
    return _head_plan(call, costs, HEAD_FAST_VOCAB_PARALLEL, "Triton, a loss with gradients, every sequence's valid "
                      "tokens fit one chunk beside the accumulators", budget, items, chunk_rows=rows,
                      sequence_chunks=tuple(chunks), flops_nhv=_flops(call, 6 if call.needs[1] else 4)), ""


def _larger_phase(during, after) -> list:
    """The items of whichever phase holds more bytes: the tiles / chunks of the sweep (``during``), or the gradients
    in the compute dtype that exist only once the sweep's buffers are freed (``after``)."""
    return list(during) if sum(b for _, b in during) >= sum(b for _, b in after) else list(after)


def sequence_chunks(counts: list, max_rows: int, offsets=None, row_length: int = 0) -> list:
    """Runs of whole sequences of at most max_rows valid tokens: (first seq, end seq, first row, end row, first
    token, end token): rows count the valid (compacted) tokens; tokens index the call's grid, from the sequences'
    offsets (packed) or ``row_length`` per sequence (padded rows)."""
    def token(b):
        return offsets[b] if offsets is not None else b * row_length

    chunks, b0, r0, rows = [], 0, 0, 0
    for b, n in enumerate(counts):
        if rows + n > max_rows:
            chunks.append((b0, b, r0, r0 + rows, token(b0), token(b)))
            b0, r0, rows = b, r0 + rows, 0
        rows += n
    chunks.append((b0, len(counts), r0, r0 + rows, token(b0), token(len(counts))))
    return chunks


def _head_light(call: HeadCall, costs: _HeadCosts, why: str) -> Plan:
    """The memory-light recompute path: an O(N) forward, then per block of rows a backward over vocab chunks whose
    d logits (and the fp32 d hidden of the block, for half-precision inputs over several chunks) fit the budget.
    Blocks of fewer rows than N only when the fp32 d hidden of every row does not fit (d weight is then summed over
    the blocks in the weight's dtype)."""
    from ..kernels.linear_backward_kernels import backward_layout  # lazy: the Triton path's geometry
    from ..kernels.linear_forward_kernels import forward_partial_bytes
    inputs, (V, H), N = call.inputs, call.inputs.weight.shape, call.n_valid
    budget, small = call.budget.working(), per_token_bytes(N, 8) + _extra_bytes(call)
    needs = (call.needs[0], call.needs[1], call.needs[2] and inputs.bias is not None)
    if torch.compiler.is_compiling():
        # Why deferred: the layout's geometry reads the device and torch's matmul precision, which the compiler
        # cannot trace; the head's registered op picks it within the same bytes when it runs
        return _head_plan(call, costs, HEAD_LIGHT, why, budget, [("per-token values", small)], flops_nhv=8,
                          working_bytes=budget - costs.fixed - small,
                          chunk_rows=_fixed_rows(call) if call.batch_invariant else None,
                          notes=("backward layout chosen when the op runs (torch.compile)",))
    forward = forward_partial_bytes(N, V, inputs.dtype, inputs.hidden.device,
                                    len(call.extras.names) if call.extras else 0)
    geometry = (N, V, H, inputs.dtype, inputs.hidden.device)
    room = budget - costs.fixed - small
    chunk_rows = 0
    if call.batch_invariant:
        # Why a fixed room: the layout (vocabulary chunks per block) must not follow the budget either; the forward
        # is head.no_grad's (fixed-row fp32 logits blocks + the fold), the one head.fast agrees with bit for bit
        geometry, room = (_fixed_rows(call),) + geometry[1:], INVARIANT_LIGHT_ROOM
        chunk_rows = _fixed_rows(call)
        forward = 4 * V * chunk_rows
    layout = backward_layout(*geometry, room, *needs, call.deterministic)
    if layout is None:
        smallest = backward_layout(*geometry, None, *needs, call.deterministic).transient_bytes
        raise call.budget.error(call.op, HEAD_LIGHT, costs.fixed + small + smallest)
    after = sum(b for _, b in costs.cast_grads)
    if call.batch_invariant and costs.fixed + small + layout.transient_bytes > budget:
        raise call.budget.error(call.op, HEAD_LIGHT + " (batch_invariant)", costs.fixed + small + layout.transient_bytes)
    if costs.fixed + small + max(forward, after) > budget:
        raise call.budget.error(call.op, HEAD_LIGHT, costs.fixed + small + max(forward, after,
                                                                                layout.transient_bytes))
    # The forward's partial statistics are freed before the backward's buffers exist: the peak is the larger phase.
    if forward > layout.transient_bytes:
        items = [("fp32 logits chunk" if chunk_rows else "forward partial statistics", forward),
                 ("per-token values", small)]
    else:
        items = _larger_phase(layout.items, costs.cast_grads) + [("per-token values", small)]
    notes = ()
    if layout.row_block < N and needs[1] and not call.batch_invariant:
        notes = (f"d weight is summed over {_cdiv(N, layout.row_block)} row blocks in the weight's dtype",)
    return _head_plan(call, costs, HEAD_LIGHT, why, budget, items, chunk_bytes=layout.chunk_bytes,
                      row_block=layout.row_block, chunk_rows=chunk_rows, flops_nhv=_flops(call, 8), notes=notes)


def _fast_min_rows() -> int:
    return knobs().fast_path_min_rows or FAST_PATH_MIN_ROWS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _even_rows(n: int, max_rows: int) -> int:
    """Rows per chunk for n rows at most max_rows each, spread evenly (no small last chunk)."""
    if n <= 0:
        return max(1, min(max_rows, 1))
    return _cdiv(n, _cdiv(n, max_rows))


def _extra_bytes(call, state_bytes: int = 0) -> int:
    """Bytes of a head call's extra outputs (``config.TokenExtras``: 4 per fp32 statistic, 1 for is_top1, per
    row), plus ``state_bytes`` per row and per statistic for a path that carries its own running sums (is_top1:
    one more bool)."""
    ex = call.extras
    if not ex:
        return 0
    return call.n_valid * ((4 + state_bytes) * (ex.log_sum_sq_probs + ex.mean_logits)
                           + (1 + (state_bytes + 1 if state_bytes else 0)) * ex.is_top1)
