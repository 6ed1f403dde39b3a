"""Calls of the fused head (``fused_linear_grpo_loss``) and their truths, shared by the api, paths and hf layers."""
from __future__ import annotations

import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call
from grpo_kernels.reference import reference_grpo_loss

from .cases import optional_inputs
from .oracles import trl_compute_loss

HIDDEN = 24  # hidden size of the head cases (make_inputs(..., hidden_size=HIDDEN))


def head_call(inputs, case, impl, bias=None, dtype=None, **kw):
    """Our loss, (d hidden, d weight[, d bias]) and metrics on ``make_inputs(..., hidden_size=...)`` output."""
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"].clone().requires_grad_(True)
    b = None if bias is None else bias.clone().requires_grad_(True)
    loss, metrics = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"], bias=b,
                                              config=case.config, impl=impl, **optional_inputs(inputs), **kw)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return loss.detach(), grads, metrics


def linear_truth(inputs, case, bias=None, dtype=torch.float64, oracle="reference"):
    """Loss and (d hidden, d weight[, d bias]) through full logits, by TRL or the reference, in ``dtype``."""
    h = inputs["hidden"].to(dtype).requires_grad_(True)
    w = inputs["weight"].to(dtype).requires_grad_(True)
    b = None if bias is None else bias.to(dtype).requires_grad_(True)
    logits = h @ w.T + (0 if b is None else b)
    rest = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in optional_inputs(inputs).items()}
    fn = trl_compute_loss if oracle == "trl" else reference_grpo_loss
    loss, metrics = fn(logits, inputs["ids"], inputs["advantages"].to(dtype), inputs["mask"], config=case.config,
                       **rest)
    grads = torch.autograd.grad(loss, [t for t in (h, w, b) if t is not None])
    return loss.detach(), grads, metrics


def head_plan(inputs, case, bias=None, **overrides):
    """The plan of the Triton head call ``head_call(inputs, case, "triton", bias, **overrides)`` would run."""
    return plan_call(gk.fused_linear_grpo_loss, inputs["hidden"].clone().requires_grad_(True),
                     inputs["weight"].clone().requires_grad_(True), inputs["ids"], inputs["advantages"],
                     inputs["mask"], bias=None if bias is None else bias.clone().requires_grad_(True),
                     config=case.config, impl="triton", **optional_inputs(inputs), **overrides)


def fast_path_budget(inputs, case, rows, bias=None):
    """The memory_budget that leaves room for fp32 logits chunks of ``rows`` rows beside the fast path's fixed
    transients (accumulators, per-token values), from the planner's own figure."""
    plan = head_plan(inputs, case, bias)
    V = inputs["weight"].shape[0]
    chunk = dict(plan.transient)["fp32 logits chunk (d logits written in place)"]
    return plan.transient_bytes - chunk + rows * 4 * V
