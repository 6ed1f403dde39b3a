"""What an integration's patch reports, shared by ``trl.py`` and ``verl.py``: the kinds of calls it routes
(``Route``), the grpo_kernels path they take on this machine (``backend``) and the short table ``print(report)``
shows (``route_table``)."""
from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class Route:
    """One kind of call a patched library makes through its fused LM head: where it runs after the patch and why."""

    calls: str
    runs_on: str  # "grpo_kernels", or the library's own kernel ("TRL", "verl")
    why: str


def backend() -> str:
    """Which grpo_kernels path the routed calls take on this machine (``resolve_impl``'s rule for impl="auto")."""
    forced = os.environ.get("GRPO_KERNELS_IMPL", "")
    if forced in ("triton", "torch"):
        return f"impl={forced} (GRPO_KERNELS_IMPL)"
    here = "CUDA available here" if torch.cuda.is_available() else "no CUDA here"
    return f"Triton kernels on CUDA tensors, chunked PyTorch on CPU ({here})"


def route_table(head: str, routes: tuple[Route, ...]) -> str:
    """``head``, then one aligned line per route: what calls, where it runs, why."""
    w1 = max(len("calls"), *(len(r.calls) for r in routes))
    w2 = max(len("runs on"), *(len(r.runs_on) for r in routes))
    lines = [head, f"  {'calls':<{w1}}  {'runs on':<{w2}}  why", f"  {'-' * w1}  {'-' * w2}  ---"]
    lines += [f"  {r.calls:<{w1}}  {r.runs_on:<{w2}}  {r.why}" for r in routes]
    return "\n".join(lines)
