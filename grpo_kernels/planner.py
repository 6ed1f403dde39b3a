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
from .invariance import block_rows
from .config import GRPOLossConfig, TokenExtras
from .inputs import HeadInputs, LogitsInputs
from .logits.logprobs import TORCH_LOGITS_TEMPS
from .loss_types import per_token_gradient_known
from .paths import LOGITS_FAST, LOGITS_SWEEP, LOGITS_TORCH, PATHS

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
    invariant_rows: int | None = None  # batch_invariant's rows per block (None: the device's, invariance.block_rows)


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
    invariant_rows: int | None = None  # batch_invariant's rows per block (None: the device's, invariance.block_rows)


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
        rows = block_rows(logits.device, call.invariant_rows)
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


# ------------------------------------------------------------------------------------------------ fused head
# The head's plans live in head_planner.py (imported last: it builds on the types above).
from .head_planner import head_accumulator_bytes, plan_head, sequence_chunks  # noqa: E402,F401
