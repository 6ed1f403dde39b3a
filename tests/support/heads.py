"""Calls of the fused head (``fused_linear_grpo_loss``) and their truths, shared by the api, paths and hf layers."""
from __future__ import annotations

import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call
from grpo_kernels.reference import reference_grpo_loss

from .cases import optional_inputs
from .oracles import trl_compute_loss
from .tolerances import assert_three_way, grad_scale, naive_logprobs_entropy

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


def linear_truth(inputs, config, bias=None, dtype=torch.float64, oracle="reference"):
    """Loss, (d hidden, d weight[, d bias]) and metrics through full logits, by TRL or the reference, in ``dtype``
    (every floating input taken in ``dtype``): in float64 the ground truth, in fp32 (fp32 inputs) the middle term of
    the three-way rule."""
    h = inputs["hidden"].to(dtype).requires_grad_(True)
    w = inputs["weight"].to(dtype).requires_grad_(True)
    b = None if bias is None else bias.to(dtype).requires_grad_(True)
    logits = h @ w.T + (0 if b is None else b)
    rest = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in optional_inputs(inputs).items()}
    fn = trl_compute_loss if oracle == "trl" else reference_grpo_loss
    loss, metrics = fn(logits, inputs["ids"], inputs["advantages"].to(dtype), inputs["mask"], config=config, **rest)
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


def head_same_dtype(inputs, config, bias=None):
    """The middle term for a head whose hidden and weight are in a low precision D: plain PyTorch logits in D
    (``h @ W.T + b``), naive log-softmax in D, the reference loss stage on those log-probs with the per-token inputs as
    given; (loss, (d hidden, d weight[, d bias]))."""
    from grpo_kernels.reference import loss_from_logps

    leaves = [t.clone().requires_grad_(True) for t in (inputs["hidden"], inputs["weight"], bias) if t is not None]
    logits = leaves[0] @ leaves[1].T + (leaves[2] if bias is not None else 0)
    logp, ent = naive_logprobs_entropy(logits, inputs["ids"], config.temperature, config.softcap)
    loss, _ = loss_from_logps(logp, inputs["advantages"], inputs["mask"], entropy=ent, config=config,
                              **optional_inputs(inputs))
    return loss.detach(), torch.autograd.grad(loss, leaves)


def assert_head_three_way(ours, same_dtype, truth, dtype, what="", metrics=()):
    """(loss, grads[, metrics]) of ours against truth by the three-way rule, the middle term ``same_dtype``; each
    gradient relative to its own largest value; ``metrics``: the names to check (those the truth has)."""
    assert_three_way(ours[0], same_dtype[0], truth[0], dtype, f"{what} loss")
    for name, g, n, t in zip(("d hidden", "d weight", "d bias"), ours[1], same_dtype[1], truth[1]):
        assert_three_way(g, n, t, dtype, f"{what} {name}", scale=grad_scale(t))
    for name in metrics:
        if name in truth[2]:
            assert_three_way(ours[2][name], same_dtype[2][name], truth[2][name], dtype, f"{what} metric {name}")
