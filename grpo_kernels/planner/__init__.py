"""The one place that decides how a call runs: ``plan_logits(LogitsCall)`` / ``plan_head(HeadCall) -> Plan``
(docs/DESIGN.md, "The planner and the paths"): ``common.py`` the calls, the plan, the budget and what both families
share; ``logits.py`` the plans over given logits; ``head.py`` the fused head's.

Every public entry point validates its arguments (``inputs.py``), asks for a plan, and dispatches on ``Plan.path``;
no other module chooses a path. A plan says which path runs, why, how it is chunked, and the transient memory it
will allocate beyond its inputs and the gradients it returns, item by item (docs/memory.md gives the formulas).

``memory_budget`` (``GRPOLossConfig``) has one meaning on every path: bytes of transient memory the call may
allocate beyond its inputs and returned gradients. Its default (``None``) is ``DEFAULT_WORKING_BYTES`` of working
memory, plus, on the fused head's fast path, the fp32 weight-gradient accumulator that path needs (4 V H bytes for
a trainable head whose gradient is not itself fp32): the price of 6NHV instead of 8NHV, stated by ``explain``.
A path whose smallest configuration does not fit the budget is not taken; when none fits, the call raises a
ValueError naming ``memory_budget`` and the bytes it would need.

Callers look the entry points up here (``planner.plan_head(...)``), so a test that records the plans patches them
on this package.
"""
from .common import Budget, HeadCall, LogitsCall, Plan, head_accumulator_bytes, with_sequences_note
from .head import plan_head, sequence_chunks
from .logits import plan_logits

# The two-head distillation divergence's plans (a third family: imports only common)
from .distill import DistillCall, plan_distill  # noqa: E402

__all__ = ["Budget", "HeadCall", "LogitsCall", "Plan", "head_accumulator_bytes", "plan_head", "plan_logits",
           "sequence_chunks", "with_sequences_note", "DistillCall", "plan_distill"]
