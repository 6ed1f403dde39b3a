"""What the logits and the head plans share (``planner.logits``, ``planner.head``): the calls they are asked about
(``LogitsCall``, ``HeadCall``), the ``Plan`` they answer with, the ``Budget`` (``memory_budget`` resolved once at the
entry point) and the sizing and note helpers of both families of paths."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from ..config import GRPOLossConfig, TokenExtras
from ..inputs import HeadInputs, LogitsInputs
from ..paths import PATHS

# Working memory (chunks, tiles) of every path when memory_budget is None.
DEFAULT_WORKING_BYTES = 1 << 30


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
    # the distillation paths' vocabulary tile (columns per GEMM and sweep; None: the whole vocabulary)
    vocab_tile: int | None = None

    @property
    def transient_bytes(self) -> int:
        return sum(b for _, b in self.transient)

    def __str__(self) -> str:
        lines = [f"{self.op}: path {self.path} (impl {self.impl}) -- {PATHS[self.path]}",
                 f"  why: {self.reason}",
                 f"  rows computed: {self.rows} of vocabulary {self.vocab}"]
        if self.chunk_rows:
            lines.append(f"  rows per chunk: {self.chunk_rows}")
        if self.vocab_tile:
            lines.append(f"  vocabulary columns per tile: {self.vocab_tile}")
        if self.row_block:
            lines.append(f"  rows per backward block: {self.row_block}")
        if self.sequence_chunks:
            lines.append(f"  chunks of whole sequences: {len(self.sequence_chunks)}")
        if self.token_stage:
            lines.append(f"  per-token stage: {self.token_stage}")
        if self.flops_nhv is not None:
            lines.append(f"  matmul FLOPs: {self.flops_nhv} N H V")
        lines.append(f"  transient memory: {size_text(self.transient_bytes)} of a {size_text(self.budget)} budget")
        lines += [f"    {what}: {size_text(n)}" for what, n in self.transient if n]
        if self.batch_invariant:
            lines.append(f"  batch-invariant: every block has {self.chunk_rows or 'a fixed number of'} rows (the last "
                         "one padded), vocabulary chunks fixed by V; each row's numbers are the same in any batch")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)


def head_accumulator_bytes(V: int, H: int, weight_dtype: torch.dtype, bias_dtype, need_weight: bool,
                           need_bias: bool) -> int:
    """The fp32 dW / dbias accumulators of a gradient-in-forward head path (``head.fast``, ``distill.fast``): none
    when the gradient is itself fp32."""
    acc = 4 * V * H if need_weight and weight_dtype != torch.float32 else 0
    return acc + (4 * V if need_bias and bias_dtype not in (None, torch.float32) else 0)


def size_text(n: int) -> str:
    """n bytes in words: GiB, MiB, KiB or B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def shown(n):
    """n for a plan's text; under torch.compile a size-dependent count stays symbolic (printing it would make the
    compiler specialize on the size, recompiling for every T)."""
    return "a size-dependent number of" if torch.compiler.is_compiling() else n


def per_token_bytes(n: int, k: int) -> int:
    """The bytes of k fp32 values per token for n tokens."""
    return 4 * k * n


def with_cap_note(plan: Plan, transform) -> Plan:
    """The plan with a line each for the rounding of the raw logits and the soft cap, where they are applied (they
    change no path, chunk or byte count)."""
    if torch.compiler.is_compiling():  # no notes while compiling: a symbolic soft cap has no printed value
        return plan
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
    return replace(plan, notes=plan.notes + (f"packed: {shown(seqs.n_seq)} sequences over {shown(seqs.grid[1])} "
                                             "tokens (cu_seqlens); no (S, Tmax) tensor is made",))
