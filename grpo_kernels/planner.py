"""The one place that decides how a call runs: ``plan(...) -> Plan`` (docs/DESIGN.md, "The planner").

Every public entry point validates its arguments (``inputs.py``), asks for a plan, and dispatches on ``Plan.path``;
no other module chooses a path. A plan says which path runs, why, how it is chunked, and the transient memory it
will allocate beyond its inputs and the gradients it returns, item by item (docs/memory.md gives the formulas).

``memory_budget`` (``GRPOLossConfig``) has one meaning on every path: bytes of transient memory the call may
allocate beyond its inputs and returned gradients. Its default (``None``) is ``DEFAULT_WORKING_BYTES`` of working
memory, plus, on the fused head's fast path, the fp32 weight-gradient accumulator that path needs (4 V H bytes for
a trainable head whose gradient is not itself fp32): the price of 6NHV instead of 8NHV, stated by ``explain``.
A path whose smallest configuration does not fit the budget is not taken; when none fits, the call raises a
ValueError naming ``memory_budget`` and the bytes it would need.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ._testing import knobs
from .invariance import INVARIANT_LIGHT_ROOM, block_rows
from .config import GRPOLossConfig, TokenExtras
from .head.torch_tiles import TORCH_HEAD_TEMPS, TORCH_HEAD_TILE_VOCAB
from .inputs import HeadInputs, LogitsInputs
from .logits.logprobs import TORCH_LOGITS_TEMPS
from .loss_types import per_token_gradient_known
from .paths import (HEAD_FAST, HEAD_FAST_SEQUENCE, HEAD_FAST_VOCAB_PARALLEL, HEAD_LIGHT, HEAD_NO_GRAD, HEAD_TORCH,
                    LOGITS_FAST, LOGITS_SWEEP, LOGITS_TORCH, PATHS)

# Working memory (chunks, tiles) of every path when memory_budget is None.
DEFAULT_WORKING_BYTES = 1 << 30
# Fewest rows per chunk worth the fused head's fast path: below ~256 rows the per-chunk read + write of the fp32 dW
# accumulator (8 V H bytes) costs more than the chunk's GEMMs (6 R V H FLOPs) on an H100 / H200.
FAST_PATH_MIN_ROWS = 256
# The no-grad head pass gains nothing from chunks above this (the GEMM is at full speed from ~400 rows at V = 152k).
NO_GRAD_CHUNK_CAP = 256 << 20


@dataclass(frozen=True)
class Budget:
    """``memory_budget`` resolved once, at the entry point: ``given`` bytes of transient memory beyond the inputs
    and returned gradients, or None for the default (``DEFAULT_WORKING_BYTES`` of working memory, plus on the fast
    head paths the fp32 accumulators they need: ``working(extra)``)."""

    given: int | None = None

    @classmethod
    def of(cls, memory_budget) -> "Budget":
        """The budget of a call's ``memory_budget`` (validated as ``GRPOLossConfig.memory_budget`` is)."""
        if memory_budget is not None:
            GRPOLossConfig(memory_budget=memory_budget)  # the one validation of the option
        return cls(memory_budget)

    def working(self, default_extra: int = 0) -> int:
        """The bytes a path may allocate: the given budget, or the default plus ``default_extra``."""
        return DEFAULT_WORKING_BYTES + default_extra if self.given is None else self.given

    def error(self, op: str, path: str, need: int) -> ValueError:
        return ValueError(f"memory_budget={self.given} bytes is below the {need} bytes the smallest configuration "
                          f"of {op}'s only applicable path ({path}) allocates; raise memory_budget (or leave it "
                          "None)")


@dataclass(frozen=True)
class LogitsCall:
    """What the planner needs of a logits call: the validated inputs, the loss options (None: log-probs only), the
    budget, whether a gradient is wanted and whether d logits may overwrite the logits."""

    op: str
    inputs: LogitsInputs
    cfg: GRPOLossConfig | None
    budget: Budget
    wants_grad: bool
    inplace: bool
    batch_invariant: bool = False


@dataclass(frozen=True)
class HeadCall:
    """What the planner needs of a fused-head call: the validated inputs, the loss options (None: log-probs only),
    the budget, the gradients wanted (hidden, weight, bias), the rows computed after compaction, the backward's
    determinism, the valid tokens per sequence (a zero-argument callable: a host sync, asked only when a
    sequence-level fast path is possible), the vocabulary shard (``distributed.vocab_parallel.VocabShard``) and the
    extra per-token statistics asked of the forward (``config.TokenExtras``; None: log-probs only)."""

    op: str
    inputs: HeadInputs
    cfg: GRPOLossConfig | None
    budget: Budget
    needs: tuple
    n_valid: int
    deterministic: bool = True
    sequence_counts: object = None
    shard: object = None
    batch_invariant: bool = False
    extras: TokenExtras | None = None


@dataclass(frozen=True)
class Plan:
    """How one call runs. ``transient`` lists what the call allocates beyond its inputs and returned gradients at
    its peak, as (what, bytes); ``transient_bytes`` is their sum and never exceeds ``budget``."""

    op: str
    path: str
    reason: str
    impl: str
    budget: int
    rows: int
    vocab: int
    chunk_rows: int | None = None
    row_block: int | None = None
    chunk_bytes: int | None = None
    sequence_chunks: tuple | None = None
    token_stage: str | None = None
    transient: tuple = field(default_factory=tuple)
    flops_nhv: int | None = None
    notes: tuple = field(default_factory=tuple)
    # head.light under torch.compile: the bytes within which the op picks its backward layout when it runs
    working_bytes: int | None = None
    # the light head path's backward: fixed-order GEMMs (True) or fp32 atomics
    deterministic: bool = True
    # logits.fast: the persistent kernel's rows in flight, and the L2 they are sized against
    rows_in_flight: int | None = None
    l2_bytes: int | None = None
    # batch invariance: fixed row blocks (the last one padded) and fixed vocabulary chunks (invariance.py)
    batch_invariant: bool = False

    @property
    def transient_bytes(self) -> int:
        return sum(b for _, b in self.transient)

    def __str__(self) -> str:
        lines = [f"{self.op}: path {self.path} (impl {self.impl}) -- {PATHS[self.path]}",
                 f"  why: {self.reason}",
                 f"  rows computed: {self.rows} of vocabulary {self.vocab}"]
        if self.chunk_rows:
            lines.append(f"  rows per chunk: {self.chunk_rows}")
        if self.row_block:
            lines.append(f"  rows per backward block: {self.row_block}")
        if self.sequence_chunks:
            lines.append(f"  chunks of whole sequences: {len(self.sequence_chunks)}")
        if self.token_stage:
            lines.append(f"  per-token stage: {self.token_stage}")
        if self.flops_nhv is not None:
            lines.append(f"  matmul FLOPs: {self.flops_nhv} N H V")
        lines.append(f"  transient memory: {_size(self.transient_bytes)} of a {_size(self.budget)} budget")
        lines += [f"    {what}: {_size(n)}" for what, n in self.transient if n]
        if self.batch_invariant:
            lines.append(f"  batch-invariant: every block has {self.chunk_rows or 'a fixed number of'} rows (the last "
                         "one padded), vocabulary chunks fixed by V; each row's numbers are the same in any batch")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def _shown(n):
    """n for a plan's text; under torch.compile a size-dependent count stays symbolic (printing it would make the
    compiler specialize on the size, recompiling for every T)."""
    return "a size-dependent number of" if torch.compiler.is_compiling() else n


def _fast_min_rows() -> int:
    return knobs().fast_path_min_rows or FAST_PATH_MIN_ROWS


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _even_rows(n: int, max_rows: int) -> int:
    """Rows per chunk for n rows at most max_rows each, spread evenly (no small last chunk)."""
    if n <= 0:
        return max(1, min(max_rows, 1))
    return _cdiv(n, _cdiv(n, max_rows))


def _per_token_bytes(n: int, k: int) -> int:
    return 4 * k * n


def _extra_bytes(call, state_bytes: int = 0) -> int:
    """Bytes of a head call's extra outputs (``config.TokenExtras``: 4 per fp32 statistic, 1 for is_top1, per
    row), plus ``state_bytes`` per row and per statistic for a path that carries its own running sums (is_top1:
    one more bool)."""
    ex = call.extras
    if not ex:
        return 0
    return call.n_valid * ((4 + state_bytes) * (ex.log_sum_sq_probs + ex.mean_logits)
                           + (1 + (state_bytes + 1 if state_bytes else 0)) * ex.is_top1)


# ------------------------------------------------------------------------------------------------- logits inputs

def _with_cap_note(plan: Plan, transform) -> Plan:
    """The plan with a line each for the rounding of the raw logits and the soft cap, where they are applied (they
    change no path, chunk or byte count)."""
    where, r, c = ("in the Triton kernels" if plan.impl == "triton" else "in each PyTorch chunk, in place",
                   transform.round_logits, transform.softcap)
    notes = (() if r is None else (f"round_logits {r}: each raw logit rounded to {r} (to nearest even) before the "
                                   f"cap / temperature, {where}; straight-through in the backward",)) + \
            (() if c is None else (f"soft cap {c:g}: c tanh(x / c) before the temperature, recomputed in the "
                                   f"backward, {where}",))
    return replace(plan, notes=plan.notes + notes) if notes else plan


def with_sequences_note(plan: Plan, seqs) -> Plan:
    """The plan with a line saying that the tokens are packed sequences (``sequences.Sequences``), if they are."""
    if seqs is None or not seqs.is_packed:
        return plan
    return replace(plan, notes=plan.notes + (f"packed: {_shown(seqs.n_seq)} sequences over {_shown(seqs.grid[1])} "
                                             "tokens (cu_seqlens); no (S, Tmax) tensor is made",))


def plan_logits(call: LogitsCall) -> Plan:
    """The path of ``grpo_loss`` (``call.cfg`` given) or ``token_logprobs`` (None) over (B, T, V) / (N, V) logits."""
    cfg = call.cfg
    if call.inputs.impl == "torch":
        plan = _logits_torch(call)
    elif cfg is not None and cfg.grad_in_forward and per_token_gradient_known(cfg) and call.wants_grad \
            and _logits_rows(call) > 0:
        plan = _logits_fast(call)
    else:
        plan = _logits_sweep(call)
    if call.batch_invariant:
        # Why the Triton paths change nothing but the stage: one program per row with a block width chosen by V
        # alone is batch-invariant as it is; the Triton per-token stage's partial sums are not (the reference's
        # sums are the tree sums of sequences.py)
        plan = replace(plan, batch_invariant=True, token_stage=None if plan.token_stage is None else "reference")
    return _with_cap_note(plan, call.inputs.transform)


def _logits_rows(call: LogitsCall) -> int:
    V = call.inputs.logits.shape[-1]
    return call.inputs.logits.numel() // V if V else 0


def _logits_plan(call: LogitsCall, path: str, reason: str, items: tuple, **kw) -> Plan:
    """A logits plan whose transient items must fit the budget (else the budget's error)."""
    budget = call.budget.working()
    need = sum(b for _, b in items)
    if need > budget:
        raise call.budget.error(call.op, path, need)
    return Plan(op=call.op, path=path, reason=reason, impl=call.inputs.impl, budget=budget, rows=_logits_rows(call),
                vocab=call.inputs.logits.shape[-1], transient=items, **kw)


def _logits_torch(call: LogitsCall) -> Plan:
    """Chunks of rows whose two fp32 temporaries fit the budget beside the per-token values (any layout of the logits
    is read in place, a (B, T, V) view that does not flatten one batch row at a time, each chunk's temporary filled
    from the rows it spans: ``logits.logprobs.row_blocks``)."""
    logits = call.inputs.logits
    V, N = logits.shape[-1], _logits_rows(call)
    acc = 8 if logits.dtype == torch.float64 else 4
    need_row = TORCH_LOGITS_TEMPS * acc * V
    small = _per_token_bytes(N, 4)
    budget = call.budget.working()
    if budget < need_row + small:
        raise call.budget.error(call.op, LOGITS_TORCH, need_row + small)
    rows = max(1, min(N, (budget - small) // need_row))
    if call.batch_invariant:  # every chunk exactly this many rows, whatever N and the budget (invariance.py)
        rows = block_rows(logits.device)
        if budget < rows * need_row + small:
            raise call.budget.error(call.op, LOGITS_TORCH + " (batch_invariant)", rows * need_row + small)
    items = (("fp32 temporaries of one row chunk", rows * need_row), ("per-token values", _per_token_bytes(N, 4)))
    return _logits_plan(call, LOGITS_TORCH, "impl torch (CPU tensors, or impl='torch')", items, chunk_rows=rows,
                        token_stage=None if call.cfg is None else "reference")


def _logits_fast(call: LogitsCall) -> Plan:
    """The float mask and reduction weights (2), the kernel's 7 per-token terms and their fp64 sum (14); the rows in
    flight of the persistent kernel sized against the device's L2 (``rows_in_flight``)."""
    from .kernels.logits_loss_kernels import rows_in_flight  # lazy: the Triton path's geometry
    logits = call.inputs.logits
    V, N = logits.shape[-1], _logits_rows(call)
    flight = rows_in_flight(N, V, logits.dtype, logits.device)
    grad_copy = 0 if call.inplace else logits.numel() * logits.element_size()
    notes = ()
    if not torch.compiler.is_compiling():  # (no note while compiling: a symbolic size has no printed value)
        notes = (_flight_note(flight),)
        if not call.inplace:
            notes += (f"d logits ({_size(grad_copy)}) is the returned gradient; inplace_backward=True writes it into "
                      "the logits buffer",)
    items = (("per-token terms and weights", _per_token_bytes(N, 23)),)
    return _logits_plan(call, LOGITS_FAST, "Triton, a token-level configuration (each token's gradient is known "
                        "once its row is swept) and a gradient wanted", items, token_stage="in the row kernel",
                        notes=notes, rows_in_flight=flight.programs, l2_bytes=flight.l2_bytes)


def _flight_note(flight) -> str:
    """What the persistent kernel's grid expects of L2 and DRAM, in words."""
    held = flight.programs * flight.row_bytes
    where = ("within L2: each row's second sweep reads L2" if flight.fits else
             "more than L2 holds with margin: the second sweep re-reads DRAM")
    return (f"rows in flight: {flight.programs} x {_size(flight.row_bytes)} = {_size(held)} of a "
            f"{_size(flight.l2_bytes)} L2, {where}; expected DRAM traffic {_size(flight.dram_bytes_per_row)} per "
            "row (the row read, its d logits written" + ("" if flight.fits else ", the row read again") + ")")


def _logits_sweep(call: LogitsCall) -> Plan:
    """Log-prob, logsumexp, entropy, and the per-token stage's mask, weights and gradient per token."""
    cfg, N = call.cfg, _logits_rows(call)
    if cfg is None:
        why = "log-probs only"
    elif not call.wants_grad:
        why = "no gradient wanted"
    elif not cfg.grad_in_forward:
        why = "grad_in_forward=False"
    else:
        why = "the loss needs a cross-token statistic before any token's gradient (sequence ratio, vespo, " \
              "off-policy or top-entropy mask)"
    stage = None if cfg is None else ("triton" if per_token_gradient_known(cfg) and N > 0 else "reference")
    items = (("per-token values", _per_token_bytes(N, 7)),)
    return _logits_plan(call, LOGITS_SWEEP, f"Triton; {why}", items, token_stage=stage)


# --------------------------------------------------------------------------------------------------- fused head

def head_accumulator_bytes(V: int, H: int, weight_dtype: torch.dtype, bias_dtype, need_weight: bool,
                           need_bias: bool) -> int:
    """The fp32 dW / dbias accumulators of the fast head path: none when the gradient is itself fp32."""
    acc = 4 * V * H if need_weight and weight_dtype != torch.float32 else 0
    return acc + (4 * V if need_bias and bias_dtype not in (None, torch.float32) else 0)


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
    return _with_cap_note(plan, call.inputs.transform)


def _fixed_rows(call) -> int:
    """The batch-invariant paths' rows per block on the call's device (``invariance.block_rows``)."""
    return block_rows(call.inputs.hidden.device if isinstance(call, HeadCall) else call.inputs.logits.device)


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
    small = _per_token_bytes(N, 4) + _extra_bytes(call, acc)
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
    small = _per_token_bytes(N, 3) + _extra_bytes(call)
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
    small = _per_token_bytes(call.n_valid, 18)
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
        return None, (f"the budget leaves room for {_shown(max_rows)} rows per chunk beside the accumulators, fewer "
                      f"than {_shown(least)}")
    V = call.inputs.weight.shape[0]
    rows = _even_rows(N, max(max_rows, 1))
    chunk = min(rows, max(N, 1)) * 4 * V
    if call.batch_invariant:  # every chunk exactly this many rows (the last one padded)
        rows = _fixed_rows(call)
        chunk = rows * 4 * V
        if max_rows < rows:
            return None, f"batch_invariant: the budget leaves room for fewer rows per chunk than its {rows}-row blocks"
    items = items + [("fp32 logits chunk (d logits written in place)", chunk),
                     ("per-token values and terms", _per_token_bytes(N, 18))]
    return _head_plan(call, costs, HEAD_FAST, "Triton, a token-level configuration, a gradient wanted, and the "
                      f"accumulators plus a chunk of at least {_shown(least)} rows fit the budget", budget, items,
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
                     ("per-token values", _per_token_bytes(call.n_valid, 18))]
    return _head_plan(call, costs, HEAD_FAST_SEQUENCE, "Triton, a gradient wanted, and every sequence's valid "
                      "tokens fit one chunk beside the accumulators", budget, items, chunk_rows=rows,
                      sequence_chunks=tuple(chunks), flops_nhv=_flops(call, 6 if call.needs[1] else 4)), ""


def _head_fast_vocab_parallel(call: HeadCall, costs: _HeadCosts, budget: int, items: list, accum: int):
    """Why the whole vocabulary's V for the rows: every rank must cut the same chunks (each chunk is a collective),
    and the shards' sizes may differ; the chunk itself is R x V_shard."""
    V, N = call.inputs.weight.shape[0], call.n_valid
    total, world = call.shard.total or V, max(call.shard.world, 1)
    small = _per_token_bytes(N, 18)
    if call.budget.given is None:
        working = DEFAULT_WORKING_BYTES
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
    from .kernels.linear_backward_kernels import backward_layout  # lazy: the Triton path's geometry
    from .kernels.linear_forward_kernels import forward_partial_bytes
    inputs, (V, H), N = call.inputs, call.inputs.weight.shape, call.n_valid
    budget, small = call.budget.working(), _per_token_bytes(N, 8) + _extra_bytes(call)
    needs = (call.needs[0], call.needs[1], call.needs[2] and inputs.bias is not None)
    if torch.compiler.is_compiling():
        # Why deferred: the layout's geometry reads the device and torch's matmul precision, which the compiler
        # cannot trace; the head's registered op picks it within the same bytes when it runs
        return _head_plan(call, costs, HEAD_LIGHT, why, budget, [("per-token values", small)], flops_nhv=8,
                          working_bytes=budget - costs.fixed - small,
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
