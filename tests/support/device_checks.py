"""The comparisons of tests/kernels/test_gpu_kernels.py, written for any device: each result against float64 ground
truth by the three-way rule (tolerances.py), the middle term plain PyTorch in the inputs' own dtype on the same
device and the same inputs, so that a GPU run meets no constant fitted to some machine. tests/kernels/
test_device_checks.py runs every helper on small CPU tensors (Triton interpreter), so they are tested without a GPU.

In fp32 the middle term is as accurate as ours and the checks are tight. In bf16 it is far less accurate: plain
PyTorch rounds the logits to bf16 (ours keeps them in fp32), and the clipped losses' gradients jump where such a
rounded ratio crosses a clip bound, so at small shapes its gradient errors reach tens of percent of the gradient's
size; there the checks catch gross errors only (a wrong sign, a missing term of the loss's size).
"""
from __future__ import annotations

import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy

from .cases import optional_inputs
from .heads import assert_head_three_way, head_same_dtype, linear_truth
from .tolerances import (assert_three_way, grad_scale, loss_truth_and_same_dtype, naive_logprobs_entropy,
                         token_truth_and_same_dtype)


def to_device(inputs: dict, device) -> dict:
    return {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.items()}


def check_token_logprobs(logits, ids, temperature, coef, rows=slice(None), impl="triton", what=""):
    """``token_logprobs`` with entropy on all of ``logits`` (B, T, V) and d logits of ``sum(coef logp + coef
    entropy)``, checked on the positions ``rows`` (a slice of T: float64 truth of the whole batch may not fit)."""
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl)
    (grad,) = torch.autograd.grad((coef * logp + coef * ent).sum(), x)
    truth, same = token_truth_and_same_dtype(logits[:, rows], ids[:, rows], temperature, coef[:, rows],
                                             coef[:, rows])
    ours = (logp[:, rows].detach(), ent[:, rows].detach(), grad[:, rows])
    for name, o, n, t in zip(("log-prob", "entropy"), ours, same, truth):
        assert_three_way(o, n, t, logits.dtype, f"{what} {name}")
    assert_three_way(ours[2], same[2], truth[2], logits.dtype, f"{what} d logits", scale=grad_scale(truth[2]))


def check_logprobs_rows(ours, logits_same_dtype, logits64, ids, temperature, softcap=None, what=""):
    """Log-probs (and entropies) ``ours = (logp[, entropy])`` of rows whose logits are ``logits64`` (float64 truth)
    and, as plain PyTorch would form them in the inputs' dtype, ``logits_same_dtype`` (e.g. ``h @ W.T`` in bf16)."""
    with torch.no_grad():
        truth = logprobs_and_entropy(logits64, ids, temperature, softcap)
        same = naive_logprobs_entropy(logits_same_dtype, ids, temperature, softcap)
    for name, o, n, t in zip(("log-prob", "entropy"), ours, same, truth):
        assert_three_way(o, n, t, logits_same_dtype.dtype, f"{what} {name}")


def logits_loss(inputs, config, impl="triton", upstream=1.0, **kw):
    """(loss, d logits of ``upstream * loss``, the logits tensor the call was given) of ``grpo_loss`` on
    ``make_inputs`` output; ``kw``: the call's own options (``inplace_backward``)."""
    x = inputs["logits"].clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=config, impl=impl,
                           **optional_inputs(inputs), **kw)
    (loss * upstream).backward()
    return loss.detach(), x.grad, x


def check_logits_loss(ours, truths, dtype, what="", upstream=1.0, fraction=1.0):
    """``ours = (loss, d logits)`` against ``truths = loss_truth_and_same_dtype(...)``; the gradient is that of
    ``upstream * loss`` and, where the truth was taken on a slice of the positions of a per-token loss, ``fraction``
    (the slice's share of the normalizer) turns the slice's gradient into the whole call's. Both factors multiply
    float64 values (the middle term after its own rounding), so they add no error of their own."""
    loss64, grad64, loss_d, grad_d = truths
    if fraction == 1.0:
        assert_three_way(ours[0], loss_d, loss64, dtype, f"{what} loss")
    t = grad64 * (upstream * fraction)
    assert_three_way(ours[1], grad_d.double() * (upstream * fraction), t, dtype, f"{what} d logits",
                     scale=grad_scale(t))


def check_logits_loss_call(inputs, config, what="", **kw):
    """``grpo_loss`` (Triton) on ``inputs`` against its float64 truth and plain PyTorch in the logits' dtype."""
    loss, grad, _ = logits_loss(inputs, config, **kw)
    check_logits_loss((loss, grad), loss_truth_and_same_dtype(inputs, config), inputs["logits"].dtype, what)


def head_loss(inputs, config, bias=None, frozen=False, impl="triton", **kw):
    """(loss, (d hidden[, d weight[, d bias]])) of ``fused_linear_grpo_loss``; frozen: only hidden is trained."""
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"].clone().requires_grad_(not frozen)
    b = None if bias is None else bias.clone().requires_grad_(not frozen)
    loss, _ = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"], bias=b,
                                        config=config, impl=impl, **optional_inputs(inputs), **kw)
    wrt = [h] if frozen else [t for t in (h, w, b) if t is not None]
    return loss.detach(), torch.autograd.grad(loss, wrt)


def head_truths(inputs, config, bias=None):
    """(float64 truth, plain PyTorch in the inputs' dtype) of a head call: each ``(loss, grads)``."""
    t_loss, t_grads, _ = linear_truth(inputs, config, bias)
    return (t_loss, t_grads), head_same_dtype(inputs, config, bias)


def check_head(ours, truths, dtype, what=""):
    """``ours = head_loss(...)`` against ``head_truths(...)``: loss and each gradient ours has (a frozen head's
    hidden only) by the three-way rule."""
    truth, same = truths
    assert_head_three_way(ours, same, truth, dtype, what)
