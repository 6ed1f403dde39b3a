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
from .config import GRPOLossConfig
from .head.torch_tiles import TORCH_HEAD_TEMPS, TORCH_HEAD_TILE_VOCAB
from .logits.logprobs import TORCH_LOGITS_TEMPS
from .loss_types import per_token_gradient_known

# Working memory (chunks, tiles) of every path when memory_budget is None.
DEFAULT_WORKING_BYTES = 1 << 30
# Fewest rows per chunk worth the fused head's fast path: below ~256 rows the per-chunk read + write of the fp32 dW
# accumulator (8 V H bytes) costs more than the chunk's GEMMs (6 R V H FLOPs) on an H100 / H200.
FAST_PATH_MIN_ROWS = 256
# The no-grad head pass gains nothing from chunks above this (the GEMM is at full speed from ~400 rows at V = 152k).
NO_GRAD_CHUNK_CAP = 256 << 20

LOGITS_FAST = "logits.fast"
LOGITS_SWEEP = "logits.sweep"
LOGITS_TORCH = "logits.torch"
HEAD_FAST = "head.fast"
HEAD_FAST_SEQUENCE = "head.fast_sequence"
HEAD_LIGHT = "head.light"
HEAD_NO_GRAD = "head.no_grad"
HEAD_TORCH = "head.torch"
HEAD_FAST_VOCAB_PARALLEL = "head.fast_vocab_parallel"

PATHS = {
    LOGITS_FAST: "one Triton kernel per row: logsumexp, per-token loss and its gradient, d logits written in the "
                 "forward; the backward only scales them",
    LOGITS_SWEEP: "Triton log-prob sweep, the per-token stage, then a d-logits sweep in the backward",
    LOGITS_TORCH: "chunked eager PyTorch over rows of logits",
    HEAD_FAST: "per row chunk: cuBLAS fp32 logits, one Triton epilogue (loss, d logits), cuBLAS dH / dW: gradients "
               "made in the forward, 6NHV (4NHV frozen head)",
    HEAD_FAST_SEQUENCE: "the fast head path with chunks of whole sequences (sequence-level ratios, vespo, the "
                        "off-policy mask)",
    HEAD_LIGHT: "memory-light: an O(N) Triton forward, then a recompute backward over vocab chunks, 8NHV",
    HEAD_NO_GRAD: "no gradient wanted: per row chunk, cuBLAS fp32 logits + the fold kernel, 2NHV",
    HEAD_TORCH: "tiled eager PyTorch with an online logsumexp, tiles recomputed in the backward",
    HEAD_FAST_VOCAB_PARALLEL: "vocab-parallel fast path: per chunk of whole sequences, each rank's shard logits, "
                              "an all-gather of 3 numbers per row and rank for the global logsumexp, then the "
                              "epilogue and local dW: 6NHV / TP per rank",
}


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


def _budget_error(op: str, path: str, need: int, cfg: GRPOLossConfig) -> ValueError:
    return ValueError(f"memory_budget={cfg.memory_budget} bytes is below the {need} bytes the smallest configuration "
                      f"of {op}'s only applicable path ({path}) allocates; raise memory_budget (or leave it None)")


def _per_token_bytes(n: int, k: int) -> int:
    return 4 * k * n


def _given_budget(cfg: GRPOLossConfig | None, budget_config: GRPOLossConfig | None) -> GRPOLossConfig:
    """The config whose ``memory_budget`` applies: the loss's, else the log-prob function's, else the default."""
    return cfg or budget_config or GRPOLossConfig()


# ------------------------------------------------------------------------------------------------- logits inputs

def _with_cap_note(plan: Plan, softcap: float | None) -> Plan:
    """The plan with a line saying where a soft cap is applied (it changes no path, chunk or byte count)."""
    if softcap is None:
        return plan
    where = "in the Triton kernels" if plan.impl == "triton" else "in each PyTorch chunk, in place"
    return replace(plan, notes=plan.notes + (f"soft cap {softcap:g}: c tanh(x / c) before the temperature, "
                                             f"recomputed in the backward, {where}",))


def plan_logits(op: str, inputs, cfg: GRPOLossConfig | None, *, wants_grad: bool, inplace: bool,
                budget_config: GRPOLossConfig | None = None) -> Plan:
    """The path of ``grpo_loss`` (cfg given) or ``token_logprobs`` (cfg None) over (B, T, V) / (N, V) logits."""
    plan = _plan_logits(op, inputs, cfg, wants_grad=wants_grad, inplace=inplace, budget_config=budget_config)
    return _with_cap_note(plan, inputs.softcap)


def _plan_logits(op: str, inputs, cfg: GRPOLossConfig | None, *, wants_grad: bool, inplace: bool,
                 budget_config: GRPOLossConfig | None = None) -> Plan:
    logits = inputs.logits
    V = logits.shape[-1]
    N = logits.numel() // V if V else 0
    budget_cfg = _given_budget(cfg, budget_config)
    budget = DEFAULT_WORKING_BYTES if budget_cfg.memory_budget is None else budget_cfg.memory_budget
    common = dict(op=op, impl=inputs.impl, budget=budget, rows=N, vocab=V)
    grad_copy = 0 if inplace else N * V * logits.element_size()
    if inputs.impl == "torch":
        try:  # rows of logits that cannot be viewed as (N, V) (e.g. logits[:, :-1]) are copied once per pass
            logits.view(-1, V)
            flat_copy = 0
        except RuntimeError:
            flat_copy = N * V * logits.element_size()
        acc = 8 if logits.dtype == torch.float64 else 4
        need_row = TORCH_LOGITS_TEMPS * acc * V
        small = _per_token_bytes(N, 4) + flat_copy
        if budget < need_row + small:
            raise _budget_error(op, LOGITS_TORCH, need_row + small, budget_cfg)
        rows = max(1, min(N, (budget - small) // need_row))
        items = (("fp32 temporaries of one row chunk", rows * need_row),
                 ("a contiguous copy of non-contiguous logits", flat_copy),
                 ("per-token values", _per_token_bytes(N, 4)))
        stage = None if cfg is None else "reference"
        return Plan(path=LOGITS_TORCH, reason="impl torch (CPU tensors, or impl='torch')", chunk_rows=rows,
                    token_stage=stage, transient=items, **common)
    if cfg is not None and cfg.grad_in_forward and per_token_gradient_known(cfg) and wants_grad and N > 0:
        # the float mask and reduction weights (2), the kernel's 7 per-token terms and their fp64 sum (14)
        items = (("per-token terms and weights", _per_token_bytes(N, 23)),)
        if _per_token_bytes(N, 23) > budget:
            raise _budget_error(op, LOGITS_FAST, _per_token_bytes(N, 23), budget_cfg)
        # (no note while compiling: a symbolic size has no printed value)
        notes = () if inplace or torch.compiler.is_compiling() else (
            f"d logits ({_size(grad_copy)}) is the returned gradient; "
            "inplace_backward=True writes it into the logits buffer",)
        return Plan(path=LOGITS_FAST, reason="Triton, a token-level configuration (each token's gradient is known "
                    "once its row is swept) and a gradient wanted", token_stage="in the row kernel",
                    transient=items, notes=notes, **common)
    if cfg is None:
        why = "log-probs only"
    elif not wants_grad:
        why = "no gradient wanted"
    elif not cfg.grad_in_forward:
        why = "grad_in_forward=False"
    else:
        why = "the loss needs a cross-token statistic before any token's gradient (sequence ratio, vespo, " \
              "off-policy or top-entropy mask)"
    stage = None if cfg is None else ("triton" if per_token_gradient_known(cfg) and N > 0 else "reference")
    # log-prob, logsumexp, entropy, and the per-token stage's mask, weights and gradient
    items = (("per-token values", _per_token_bytes(N, 7)),)
    if _per_token_bytes(N, 7) > budget:
        raise _budget_error(op, LOGITS_SWEEP, _per_token_bytes(N, 7), budget_cfg)
    return Plan(path=LOGITS_SWEEP, reason=f"Triton; {why}", token_stage=stage, transient=items, **common)


# --------------------------------------------------------------------------------------------------- fused head

def head_accumulator_bytes(V: int, H: int, weight_dtype: torch.dtype, bias_dtype, need_weight: bool,
                           need_bias: bool) -> int:
    """The fp32 dW / dbias accumulators of the fast head path: none when the gradient is itself fp32."""
    acc = 4 * V * H if need_weight and weight_dtype != torch.float32 else 0
    return acc + (4 * V if need_bias and bias_dtype not in (None, torch.float32) else 0)


def plan_head(op: str, inputs, cfg: GRPOLossConfig | None, *, needs: tuple, n_valid: int,
              sequence_counts=None, vocab_parallel: bool = False, budget_config: GRPOLossConfig | None = None,
              deterministic: bool | None = None, vocab_total: int | None = None, world: int = 1) -> Plan:
    """The path of ``fused_linear_grpo_loss`` (cfg given) or ``linear_token_logprobs`` (cfg None).

    needs: (hidden, weight, bias) gradient wanted; n_valid: rows computed after compaction; sequence_counts: a
    zero-argument callable giving the valid tokens per sequence (a host sync, asked only when a sequence-level
    fast path is possible)."""
    plan = _plan_head(op, inputs, cfg, needs=needs, n_valid=n_valid, sequence_counts=sequence_counts,
                      vocab_parallel=vocab_parallel, budget_config=budget_config, deterministic=deterministic,
                      vocab_total=vocab_total, world=world)
    return _with_cap_note(plan, inputs.softcap)


def _plan_head(op: str, inputs, cfg: GRPOLossConfig | None, *, needs: tuple, n_valid: int,
               sequence_counts=None, vocab_parallel: bool = False, budget_config: GRPOLossConfig | None = None,
               deterministic: bool | None = None, vocab_total: int | None = None, world: int = 1) -> Plan:
    weight, bias = inputs.weight, inputs.bias
    N, (V, H) = n_valid, weight.shape
    it = inputs.dtype.itemsize
    budget_cfg = _given_budget(cfg, budget_config)
    need_h, need_w, need_b = needs
    need_b = need_b and bias is not None
    grad = need_h or need_w or need_b
    compact = N < inputs.ids.numel()
    copies = []
    if inputs.cast_bytes(weight=False):
        copies.append(("hidden in the compute dtype (autocast)", inputs.cast_bytes(weight=False)))
    if compact:
        copies.append(("compacted valid rows of hidden", N * H * it))
        if need_h:
            copies.append(("d hidden of the compacted rows", N * H * it))
    stage = None if cfg is None else ("triton" if inputs.impl == "triton" and per_token_gradient_known(cfg)
                                      and inputs.ids.numel() > 0 else "reference")

    def make(path, reason, budget, items, **kw):
        items = tuple(copies) + tuple(items)
        return Plan(op=op, path=path, reason=reason, impl=inputs.impl, budget=budget, rows=N, vocab=V,
                    transient=items, token_stage=kw.pop("token_stage", stage), **kw)

    weight_cast = inputs.cast_bytes(hidden=False)
    if weight_cast:
        copies.append(("weight / bias in the compute dtype (autocast)", weight_cast))
    # The paths behind autograd's casts hand back gradients in the compute dtype, cast by autograd afterwards: those
    # compute-dtype gradients are transient (the fast paths cast inside and return the given dtypes directly).
    cast_grads = []
    if need_w and weight.dtype != inputs.dtype:
        cast_grads.append(("d weight in the compute dtype, before autograd's cast", V * H * it))
    if need_h and inputs.hidden.dtype != inputs.dtype:
        cast_grads.append(("d hidden in the compute dtype, before autograd's cast", inputs.ids.numel() * H * it))
    fixed = sum(b for _, b in copies)
    if inputs.impl == "torch":
        budget = DEFAULT_WORKING_BYTES if budget_cfg.memory_budget is None else budget_cfg.memory_budget
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
        small = _per_token_bytes(N, 4)
        need = fixed + sum(b for _, b in accum) + small + loop_fixed + per_row
        if budget < need:
            raise _budget_error(op, HEAD_TORCH, need, budget_cfg)
        rows = max(1, min(max(N, 1), (budget - need + per_row) // per_row))
        loop = [("weight tile in fp32", loop_fixed), ("logits tiles", rows * TORCH_HEAD_TEMPS * acc * vt),
                ("hidden rows in fp32", rows * acc * H if half else 0)]
        items = accum + _larger_phase(loop, cast_grads) + [("per-token values", small)]
        return make(HEAD_TORCH, "impl torch (CPU tensors, or impl='torch')", budget, items, chunk_rows=rows,
                    flops_nhv=(2 + (6 if grad else 0)) if N else 0)
    if not grad:
        budget = DEFAULT_WORKING_BYTES if budget_cfg.memory_budget is None else budget_cfg.memory_budget
        room = min(budget - fixed - _per_token_bytes(N, 3), knobs().no_grad_chunk_cap or NO_GRAD_CHUNK_CAP)
        if room < 4 * V:
            raise _budget_error(op, HEAD_NO_GRAD, fixed + _per_token_bytes(N, 3) + 4 * V, budget_cfg)
        rows = _even_rows(N, room // (4 * V))
        items = [("fp32 logits chunk", min(rows, max(N, 1)) * 4 * V), ("per-token values", _per_token_bytes(N, 3))]
        return make(HEAD_NO_GRAD, "no gradient wanted", budget, items, chunk_rows=rows, flops_nhv=2 if N else 0)

    reasons = []
    if cfg is None:
        reasons.append("log-probs only (the gradient of later code is not known in the forward)")
    elif not cfg.grad_in_forward:
        reasons.append("grad_in_forward=False")
    elif cfg.top_entropy_quantile < 1.0:
        reasons.append("the top-entropy mask is a quantile over the whole batch")
    else:
        accum = head_accumulator_bytes(V, H, weight.dtype, None if bias is None else bias.dtype, need_w, need_b)
        small = _per_token_bytes(N, 18)
        budget = (DEFAULT_WORKING_BYTES + accum + fixed + small) if budget_cfg.memory_budget is None \
            else budget_cfg.memory_budget
        room = budget - accum - fixed - small
        max_rows = max(0, room) // (4 * V)
        items = []
        if accum:
            items.append(("fp32 d weight / d bias accumulators", accum))
        if vocab_parallel:
            # Why the whole vocabulary's V for the rows: every rank must cut the same chunks (each chunk is a
            # collective), and the shards' sizes may differ; the chunk itself is R x V_shard.
            total = vocab_total or V
            if budget_cfg.memory_budget is None:
                working = DEFAULT_WORKING_BYTES
            else:  # the shard-sized items as if the shard were the whole vocabulary: the same rows on every rank
                working = budget - (accum + weight_cast) * total // V - (fixed - weight_cast) - small
            rows_all = max(0, working) // (4 * total + 12 * max(world, 1))
            counts = sequence_counts() if sequence_counts is not None else None
            if counts and rows_all >= min(N, _fast_min_rows()) and max(counts) <= rows_all:
                chunks = sequence_chunks(counts, rows_all)
                rows = max(r1 - r0 for _, _, r0, r1 in chunks)
                items += [("fp32 logits chunk of the shard (d logits written in place)", rows * 4 * V),
                          ("gathered row statistics of a chunk", rows * 12 * max(world, 1)),
                          ("per-token values", small)]
                return make(HEAD_FAST_VOCAB_PARALLEL, "Triton, a loss with gradients, every sequence's valid tokens "
                            "fit one chunk beside the accumulators", budget, items, chunk_rows=rows,
                            sequence_chunks=tuple(chunks), flops_nhv=(6 if need_w else 4) if N else 0)
            reasons.append("vocab-parallel: a sequence longer than the rows the budget allows per chunk" if counts
                           else "vocab-parallel: the fast path needs a mask it can count")
        elif per_token_gradient_known(cfg):
            if N == 0 or max_rows >= min(N, _fast_min_rows()):
                rows = _even_rows(N, max(max_rows, 1))
                items += [("fp32 logits chunk (d logits written in place)", min(rows, max(N, 1)) * 4 * V),
                          ("per-token values and terms", small)]
                return make(HEAD_FAST, "Triton, a token-level configuration, a gradient wanted, and the "
                            "accumulators plus a chunk of at least "
                            f"{_shown(min(N, _fast_min_rows()))} rows fit the budget", budget, items, chunk_rows=rows,
                            flops_nhv=(6 if need_w else 4) if N else 0, token_stage="in the epilogue kernel")
            reasons.append(f"the budget leaves room for {_shown(max_rows)} rows per chunk beside the accumulators, "
                           f"fewer than {_shown(min(N, _fast_min_rows()))}")
        else:
            counts = sequence_counts() if sequence_counts is not None else None
            if counts and max_rows >= min(N, _fast_min_rows()) and max(counts) <= max_rows:
                chunks = sequence_chunks(counts, max_rows)
                rows = max(r1 - r0 for _, _, r0, r1 in chunks)
                items += [("fp32 logits chunk (d logits written in place)", rows * 4 * V),
                          ("per-token values", small)]
                return make(HEAD_FAST_SEQUENCE, "Triton, a gradient wanted, and every sequence's valid tokens fit "
                            "one chunk beside the accumulators", budget, items, chunk_rows=rows,
                            sequence_chunks=tuple(chunks), flops_nhv=(6 if need_w else 4) if N else 0)
            reasons.append("a sequence longer than the rows the budget allows per chunk" if counts else
                           "the sequence-level path needs a mask it can count")
    return _plan_light(op, inputs, budget_cfg, needs, N, fixed, make, "; ".join(reasons),
                       budget_cfg.deterministic if deterministic is None else deterministic, cast_grads)


def _larger_phase(during, after) -> list:
    """The items of whichever phase holds more bytes: the tiles / chunks of the sweep (``during``), or the gradients
    in the compute dtype that exist only once the sweep's buffers are freed (``after``)."""
    return list(during) if sum(b for _, b in during) >= sum(b for _, b in after) else list(after)


def sequence_chunks(counts: list, max_rows: int) -> list:
    """Runs of whole sequences of at most max_rows valid tokens: (first seq, end seq, first row, end row)."""
    chunks, b0, r0, rows = [], 0, 0, 0
    for b, n in enumerate(counts):
        if rows + n > max_rows:
            chunks.append((b0, b, r0, r0 + rows))
            b0, r0, rows = b, r0 + rows, 0
        rows += n
    chunks.append((b0, len(counts), r0, r0 + rows))
    return chunks


def _plan_light(op, inputs, cfg, needs, N, fixed, make, why, deterministic, cast_grads=()) -> Plan:
    """The memory-light recompute path: an O(N) forward, then per block of rows a backward over vocab chunks whose
    d logits (and the fp32 d hidden of the block, for half-precision inputs over several chunks) fit the budget.
    Blocks of fewer rows than N only when the fp32 d hidden of every row does not fit (d weight is then summed over
    the blocks in the weight's dtype)."""
    from .kernels.linear_backward_kernels import backward_layout  # lazy: the Triton path's geometry
    from .kernels.linear_forward_kernels import forward_partial_bytes
    V, H = inputs.weight.shape
    budget = DEFAULT_WORKING_BYTES if cfg.memory_budget is None else cfg.memory_budget
    need_h, need_w, need_b = needs
    small = _per_token_bytes(N, 8)
    if torch.compiler.is_compiling():
        # Why deferred: the layout's geometry reads the device and torch's matmul precision, which the compiler
        # cannot trace; the head's registered op picks it within the same bytes when it runs
        return make(HEAD_LIGHT, why, budget, [("per-token values", small)], flops_nhv=8,
                    working_bytes=budget - fixed - small,
                    notes=("backward layout chosen when the op runs (torch.compile)",))
    forward = forward_partial_bytes(N, V, inputs.dtype, inputs.hidden.device)
    layout = backward_layout(N, V, H, inputs.dtype, inputs.hidden.device, budget - fixed - small, need_h, need_w,
                             need_b and inputs.bias is not None, deterministic)
    if layout is None:
        raise _budget_error(op, HEAD_LIGHT, fixed + small + backward_layout(
            N, V, H, inputs.dtype, inputs.hidden.device, None, need_h, need_w, need_b and inputs.bias is not None,
            deterministic).transient_bytes, cfg)
    after = sum(b for _, b in cast_grads)
    if fixed + small + max(forward, after) > budget:
        raise _budget_error(op, HEAD_LIGHT, fixed + small + max(forward, after, layout.transient_bytes), cfg)
    # The forward's partial statistics are freed before the backward's buffers exist: the peak is the larger phase.
    if forward > layout.transient_bytes:
        items = [("forward partial statistics", forward), ("per-token values", small)]
    else:
        items = _larger_phase(layout.items, cast_grads) + [("per-token values", small)]
    notes = ()
    if layout.row_block < N and need_w:
        notes = (f"d weight is summed over {_cdiv(N, layout.row_block)} row blocks in the weight's dtype",)
    return make(HEAD_LIGHT, why, budget, items, chunk_bytes=layout.chunk_bytes, row_block=layout.row_block,
                flops_nhv=8 if N else 0, notes=notes)
