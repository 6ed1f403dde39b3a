"""The distillation planner's transient-memory figure (``Plan.transient``) against the allocations the torch
profiler traces on CPU (tests/support/memory_trace.py), on every path: within 10%.

Why the recompute path is traced per phase (forward, then backward): Triton's interpreter keeps the last launch's
arguments alive until the next launch, so the forward's logits tiles would be counted into the backward's peak;
a CUDA run frees them when the forward returns. The plan's figure is the larger phase's. The PyTorch paths run
in fp32 and bf16 (the same code on every device), the Triton ones in fp32 (the CPU stand-ins of the fp32-output
GEMMs upcast bf16 operands: copies a CUDA run does not make).
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call

from ..support.memory_trace import transient_peak

HS, HT = 32, 48
# (B, T, V) by implementation: the interpreter's row programs cost ~1 ms a block, so its shape is smaller
SHAPES = {"torch": (4, 16, 1024), "triton": (2, 8, 512)}
LOSS, TOKEN = gk.fused_linear_distill_loss, gk.linear_token_divergence
# path: (function, impl, options); budgets in bytes
PATHS = {
    "distill.torch_fast": (LOSS, "torch", {}),
    "distill.torch": (TOKEN, "torch", {}),
    "distill.fast": (LOSS, "triton", {}),
    "distill.light": (LOSS, "triton", {"grad_in_forward": False}),
    "distill.light-tiles": (TOKEN, "triton", {"memory_budget": 40_000}),
    "distill.no_grad": (TOKEN, "triton", {}),
}
CASES = [pytest.param(p, b, d, marks=[] if (p, b, d) == ("distill.torch", 0.5, torch.float32) else pytest.mark.slow,
                      id=f"{p}-beta{b}-{str(d)[6:]}")
         for p in PATHS for b in (0.5, 1.0) for d in (torch.float32, torch.bfloat16)
         if PATHS[p][1] == "torch" or (d == torch.float32 and b == 0.5)]


def _inputs(dtype, B, T, V):
    g = torch.Generator().manual_seed(0)
    sh = torch.randn(B, T, HS, generator=g).to(dtype).requires_grad_(True)
    sw = (torch.randn(V, HS, generator=g) / 4).to(dtype).requires_grad_(True)
    th, tw = torch.randn(B, T, HT, generator=g).to(dtype), (torch.randn(V, HT, generator=g) / 4).to(dtype)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, T // 2:] = False
    return sh, sw, th, tw, mask


@pytest.mark.parametrize("path,beta,dtype", CASES)
def test_planned_transient_memory_matches_the_traced_allocations(path, beta, dtype):
    fn, impl, options = PATHS[path]
    if impl == "triton":
        pytest.importorskip("triton")
    sh, sw, th, tw, mask = _inputs(dtype, *SHAPES[impl])
    grad = path != "distill.no_grad"
    call = (sh, sw, th, tw, mask) if fn is LOSS else (sh, sw, th, tw)
    kw = dict(impl=impl, beta=beta, **options, **({} if fn is LOSS else {"mask": mask}))
    with torch.set_grad_enabled(grad):
        plan = plan_call(fn, *call, **kw)
    assert plan.path == path.split("-")[0]
    held = {}

    def forward():
        with torch.set_grad_enabled(grad):
            out = fn(*call, **kw)
        held["out"] = out[0] if fn is LOSS else out[0].sum() if grad else None
        return [*(out[1].values() if fn is LOSS else out), *([held["out"]] if grad else [])]

    def backward():
        held.pop("out").backward()
        return [sh.grad, sw.grad]

    if path.startswith("distill.light"):  # the interpreter's recompute path: per phase (module docstring)
        traced = max(transient_peak(forward), transient_peak(backward))
    else:
        traced = transient_peak(lambda: forward() + (backward() if grad else []))
    # bound: not a numerical tolerance: the planner's figure within 10% of the traced allocations (docs/contributing.md)
    assert traced > 0 and abs(traced - plan.transient_bytes) <= 0.10 * plan.transient_bytes, \
        f"planned {plan.transient_bytes} B ({plan.transient}), traced {traced} B"
