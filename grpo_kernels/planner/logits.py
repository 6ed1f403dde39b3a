"""The logits plans: ``plan_logits(LogitsCall) -> Plan`` for ``grpo_loss`` / ``token_logprobs`` over given (B, T, V)
or (N, V) logits, and one small function per logits path (logits.torch, logits.fast, logits.sweep; docs/DESIGN.md,
"The planner and the paths")."""
from __future__ import annotations

from dataclasses import replace

import torch

from ..invariance import block_rows
from ..logits.logprobs import TORCH_LOGITS_TEMPS
from ..loss_types import per_token_gradient_known
from ..paths import LOGITS_FAST, LOGITS_SWEEP, LOGITS_TORCH
from .common import LogitsCall, Plan, per_token_bytes, size_text, with_cap_note


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
    return with_cap_note(plan, call.inputs.transform)


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
    small = per_token_bytes(N, 4)
    budget = call.budget.working()
    if budget < need_row + small:
        raise call.budget.error(call.op, LOGITS_TORCH, need_row + small)
    rows = max(1, min(N, (budget - small) // need_row))
    if call.batch_invariant:  # every chunk exactly this many rows, whatever N and the budget (invariance.py)
        rows = block_rows(logits.device, call.invariant_rows)
        if budget < rows * need_row + small:
            raise call.budget.error(call.op, LOGITS_TORCH + " (batch_invariant)", rows * need_row + small)
    items = (("fp32 temporaries of one row chunk", rows * need_row), ("per-token values", per_token_bytes(N, 4)))
    return _logits_plan(call, LOGITS_TORCH, "impl torch (CPU tensors, or impl='torch')", items, chunk_rows=rows,
                        token_stage=None if call.cfg is None else "reference")


def _logits_fast(call: LogitsCall) -> Plan:
    """The float mask and reduction weights (2), the kernel's 7 per-token terms and their fp64 sum (14); the rows in
    flight of the persistent kernel sized against the device's L2 (``rows_in_flight``)."""
    from ..kernels.logits_loss_kernels import rows_in_flight  # lazy: the Triton path's geometry
    logits = call.inputs.logits
    V, N = logits.shape[-1], _logits_rows(call)
    flight = rows_in_flight(N, V, logits.dtype, logits.device)
    grad_copy = 0 if call.inplace else logits.numel() * logits.element_size()
    notes = ()
    if not torch.compiler.is_compiling():  # (no note while compiling: a symbolic size has no printed value)
        notes = (_flight_note(flight),)
        if not call.inplace:
            notes += (f"d logits ({size_text(grad_copy)}) is the returned gradient; inplace_backward=True writes it "
                      "into the logits buffer",)
    items = (("per-token terms and weights", per_token_bytes(N, 23)),)
    return _logits_plan(call, LOGITS_FAST, "Triton, a token-level configuration (each token's gradient is known "
                        "once its row is swept) and a gradient wanted", items, token_stage="in the row kernel",
                        notes=notes, rows_in_flight=flight.programs, l2_bytes=flight.l2_bytes)


def _flight_note(flight) -> str:
    """What the persistent kernel's grid expects of L2 and DRAM, in words."""
    held = flight.programs * flight.row_bytes
    where = ("within L2: each row's second sweep reads L2" if flight.fits else
             "more than L2 holds with margin: the second sweep re-reads DRAM")
    return (f"rows in flight: {flight.programs} x {size_text(flight.row_bytes)} = {size_text(held)} of a "
            f"{size_text(flight.l2_bytes)} L2, {where}; expected DRAM traffic {size_text(flight.dram_bytes_per_row)} "
            "per row (the row read, its d logits written" + ("" if flight.fits else ", the row read again") + ")")


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
    items = (("per-token values", per_token_bytes(N, 7)),)
    return _logits_plan(call, LOGITS_SWEEP, f"Triton; {why}", items, token_stage=stage)
