"""torch.compile: a distillation step calling ``fused_linear_distill_loss`` and ``linear_token_divergence`` compiles
with ``fullgraph=True`` (the paths' registered ops, ``head/distill.py``), gives eager's loss, gradients and metrics
(bitwise with aot_eager: the ops run the same code), a varying T does not recompile every step, and the ops pass
``torch.library.opcheck``. The torch impl's case runs in the fast set, the Triton impl's (the interpreter) slow.
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig

from ..support.distill_cases import ALL_OPTIONS

B, V, HS, HT = 2, 37, 8, 12
CFG = DistillLossConfig(beta=0.4, **ALL_OPTIONS)


def _batch(T: int):
    g = torch.Generator().manual_seed(T)
    mask = torch.ones(B, T)
    mask[0, T - 2:] = 0  # padding: the ops compact the valid rows when they run
    return [torch.randn(B, T, HS, generator=g), torch.randn(V, HS, generator=g) * 0.5,
            torch.randn(B, T, HT, generator=g), torch.randn(V, HT, generator=g) * 0.5, mask,
            torch.randn(V, generator=g) * 0.3]


def _step(impl, grad_in_forward=True):
    def step(sh, sw, th, tw, mask, sb):
        loss, metrics = gk.fused_linear_distill_loss(sh, sw, th, tw, mask, student_bias=sb, config=CFG, impl=impl,
                                                     grad_in_forward=grad_in_forward)
        div, ent = gk.linear_token_divergence(sh, sw, th, tw, mask=mask, config=CFG, impl=impl)
        return loss + (div * mask).sum() / 7.0, metrics, ent
    return step


def _run(fn, args):
    sh, sw, sb = (args[i].clone().requires_grad_(True) for i in (0, 1, 5))
    loss, metrics, ent = fn(sh, sw, args[2], args[3], args[4], sb)
    loss.backward()
    return [loss.detach(), sh.grad, sw.grad, sb.grad, ent, *metrics.values()]


class CountingBackend:
    """aot_eager (AOTAutograd with the ops' fake kernels and autograd registrations, no code generation), counting
    the graphs it is given."""

    def __init__(self):
        self.inner = torch._dynamo.lookup_backend("aot_eager")
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.inner(gm, example_inputs)


@pytest.mark.parametrize("impl,grad_in_forward", [
    ("torch", True), pytest.param("torch", False, marks=pytest.mark.slow),
    *(pytest.param("triton", g, marks=[pytest.mark.interpreter, pytest.mark.slow]) for g in (True, False))],
    ids=["torch-fast", "torch-recompute", "triton-fast", "triton-recompute"])
def test_compiled_step_equals_eager(impl, grad_in_forward):
    torch._dynamo.reset()
    backend = CountingBackend()
    step = _step(impl, grad_in_forward)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for T in (5, 7, 9):
        args = _batch(T)
        for a, b in zip(_run(step, args), _run(compiled, args)):
            assert torch.equal(a, b), (a - b).abs().max()
    assert backend.graphs <= 2, f"{backend.graphs} compiles for 3 values of T"
    torch._dynamo.reset()


def test_ops_pass_opcheck():
    """Schema, fake kernels and autograd registrations of the three distillation ops, on the torch impl (the
    Triton ones run the same op code around other bodies)."""
    from grpo_kernels import ops
    from grpo_kernels.head.distill import DistillOptions

    sh, sw, th, tw, mask, sb = _batch(6)
    flat = [t.reshape(-1, t.shape[-1]) for t in (sh, th)]
    h = flat[0].clone().requires_grad_(True)
    w, b = sw.clone().requires_grad_(True), sb.clone().requires_grad_(True)
    o = DistillOptions("distill.torch", CFG, torch.float32, torch.float32, 4, 0, B, 6)
    rows = mask.reshape(-1)
    torch.library.opcheck(torch.ops.grpo_kernels.distill_divergence.default,
                          (h, w, b, flat[1], tw, None, rows, *ops.encode(o)))
    fast = DistillOptions("distill.torch_fast", CFG, torch.float32, torch.float32, 4, 0, B, 6)
    weights = (rows / rows.sum()).contiguous()
    torch.library.opcheck(torch.ops.grpo_kernels.distill_loss_fast.default,
                          (h, w, b, flat[1], tw, None, rows, weights, None, [True, True, True], *ops.encode(fast)))
    assert ops.decode(DistillOptions, *ops.encode(o)) == o
