"""torch.compile: a distillation step calling ``fused_linear_distill_loss`` and ``linear_token_divergence`` compiles
with ``fullgraph=True`` (the paths' registered ops, ``head/distill.py``), gives eager's loss, gradients and metrics
(bitwise with aot_eager: the ops run the same code), a varying T does not recompile every step, and the ops pass
``torch.library.opcheck``. The torch impl's case runs in the fast set, the Triton impl's (the interpreter) slow.

Dynamic float options (docs/api.md, "torch.compile"), as tests/api/test_compile_dynamic.py for the GRPO functions:
the two functions, ``FusedLinearDistillLoss`` and Liger's JSD wrappers (``liger_fused_linear_jsd``,
``LigerFusedLinearJSD``, the chunked ``LigerFusedLinearJSDLoss``) with beta, temperature (and a soft cap, a logit
scale) changing at every call, compiled with ``dynamic=True`` and the automatic dynamic: eager's numbers exactly
(aot_eager; the floats reach the ops as the same float64 values) and no recompile per value; a beta crossing 0 or 1
(another divergence mode: a guard) compiles once per mode; a bad value arriving symbolic raises the ValueError naming
the argument (quoted by Dynamo's Unsupported).
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig
from grpo_kernels.liger import LigerFusedLinearJSD, LigerFusedLinearJSDLoss, liger_fused_linear_jsd

from ..support.compiling import CountingBackend
from ..support.distill_cases import ALL_OPTIONS

pytestmark = pytest.mark.usefixtures("fresh_dynamo")
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


@pytest.mark.parametrize("impl,grad_in_forward", [
    ("torch", True), pytest.param("torch", False, marks=pytest.mark.slow),
    *(pytest.param("triton", g, marks=[pytest.mark.interpreter, pytest.mark.slow]) for g in (True, False))],
    ids=["torch-fast", "torch-recompute", "triton-fast", "triton-recompute"])
def test_compiled_step_equals_eager(impl, grad_in_forward):
    backend = CountingBackend()
    step = _step(impl, grad_in_forward)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for T in (5, 7, 9):
        args = _batch(T)
        for a, b in zip(_run(step, args), _run(compiled, args)):
            assert torch.equal(a, b), (a - b).abs().max()
    assert backend.graphs <= 2, f"{backend.graphs} compiles for 3 values of T"


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


# ------------------------------------------------------------------------------------------ dynamic float options

# per call: T, beta, temperature, student_softcap, teacher_logit_scale (the last two: the distillation functions
# only; the last one also the chunked JSD loss's weight_hard_loss), each distinct from call to call; beta inside
# (0, 1), the JSD mode throughout (crossing it: below)
CALLS = ((5, 0.3, 0.7, 3.0, 0.6), (7, 0.4, 0.9, 2.5, 0.8), (9, 0.6, 1.1, 4.0, 1.2), (6, 0.45, 1.3, 3.5, 0.9))
ENTRY_POINTS = ("fused_linear_distill_loss", "linear_token_divergence", "FusedLinearDistillLoss",
                "liger_fused_linear_jsd", "LigerFusedLinearJSD", "LigerFusedLinearJSDLoss")


def _entry(name: str, impl: str):
    """(step, set_options) of one entry point: step(sh, sw, th, tw, mask, beta, temperature, cap, scale) -> (loss,
    outputs); set_options(beta, temperature, cap, scale) runs before each call, outside the step: a module's options
    replaced between steps, as a trainer would (a function takes them as the step's arguments)."""
    distill = gk.FusedLinearDistillLoss(impl=impl)
    jsd = LigerFusedLinearJSD()
    jsd.impl = impl
    chunked = LigerFusedLinearJSDLoss()
    chunked.impl = impl

    def labels(mask):  # Liger's shift_labels: ignore_index where the mask drops the token
        return torch.where(mask.reshape(-1) != 0, 1, -100)

    def flat(sh, th):
        return sh.reshape(-1, HS), th.reshape(-1, HT)

    def fused_linear_distill_loss(sh, sw, th, tw, mask, beta, temperature, cap, scale):
        return gk.fused_linear_distill_loss(sh, sw, th, tw, mask, impl=impl, beta=beta, temperature=temperature,
                                            student_softcap=cap, teacher_logit_scale=scale)

    def linear_token_divergence(sh, sw, th, tw, mask, beta, temperature, cap, scale):
        div, ent = gk.linear_token_divergence(sh, sw, th, tw, mask=mask, impl=impl, beta=beta,
                                              temperature=temperature, student_softcap=cap, teacher_logit_scale=scale)
        return (div * mask).sum() / 7.0, {"divergence": div.detach(), "entropy": ent}

    def FusedLinearDistillLoss(sh, sw, th, tw, mask, *floats):
        return distill(sh, sw, th, tw, mask)

    def liger_fused_linear_jsd_(sh, sw, th, tw, mask, beta, temperature, cap, scale):
        s_in, t_in = flat(sh, th)
        return liger_fused_linear_jsd(s_in, sw, t_in, tw, labels(mask), beta, -100, temperature, impl=impl), {}

    def LigerFusedLinearJSD_(sh, sw, th, tw, mask, *floats):
        s_in, t_in = flat(sh, th)
        return jsd(s_in, sw, t_in, tw, labels(mask)), {}

    def LigerFusedLinearJSDLoss_(sh, sw, th, tw, mask, *floats):
        s_in, t_in = flat(sh, th)
        return chunked(s_in, sw, t_in, tw, labels(mask)), {}

    def set_distill(beta, temperature, cap, scale):
        distill.config = DistillLossConfig(beta=beta, temperature=temperature, student_softcap=cap,
                                           teacher_logit_scale=scale)

    def set_jsd(beta, temperature, cap, scale):
        jsd.jsd_beta, jsd.temperature = beta, temperature

    def set_chunked(beta, temperature, cap, scale):
        chunked.beta, chunked.temperature, chunked.weight_hard_loss = beta, temperature, scale

    def nothing(*floats):
        pass

    return {"fused_linear_distill_loss": (fused_linear_distill_loss, nothing),
            "linear_token_divergence": (linear_token_divergence, nothing),
            "FusedLinearDistillLoss": (FusedLinearDistillLoss, set_distill),
            "liger_fused_linear_jsd": (liger_fused_linear_jsd_, nothing),
            "LigerFusedLinearJSD": (LigerFusedLinearJSD_, set_jsd),
            "LigerFusedLinearJSDLoss": (LigerFusedLinearJSDLoss_, set_chunked)}[name]


def _call(step, set_options, args, floats) -> dict:
    set_options(*floats)
    sh, sw = (args[i].clone().requires_grad_(True) for i in (0, 1))
    loss, outputs = step(sh, sw, *args[2:5], *floats)
    loss.backward()
    return {"loss": loss.detach(), "d student_hidden": sh.grad, "d student_weight": sw.grad, **outputs}


# fast: the torch impl under both dynamic modes; the Triton impl (the interpreter) slow, as above
FLOAT_CASES = [pytest.param(name, impl, dynamic, id=f"{name}-{impl}-dynamic={dynamic}",
                            marks=[] if impl == "torch" else [pytest.mark.interpreter, pytest.mark.slow])
               for name in ENTRY_POINTS for impl in ("torch", "triton") for dynamic in (None, True)]


@pytest.mark.parametrize("name, impl, dynamic", FLOAT_CASES)
def test_changing_float_options_match_eager_without_a_recompile_per_value(name, impl, dynamic):
    backend = CountingBackend()
    step, set_options = _entry(name, impl)
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=backend)
    warm_up = 1 if dynamic else 2  # the calls after which the graph has T and the floats symbolic
    for i, (T, *floats) in enumerate(CALLS):
        if i == warm_up:
            graphs = backend.graphs
        args = _batch(T)
        eager, ours = _call(step, set_options, args, floats), _call(compiled, set_options, args, floats)
        assert ours.keys() == eager.keys()
        for what in eager:  # exact: aot_eager runs the same ops on the same float64 values (module docstring)
            assert torch.equal(ours[what], eager[what]), \
                f"T={T} floats={floats}: compiled {what} differs from eager by " \
                f"{(ours[what].double() - eager[what].double()).abs().max().item():.3e}"
    # a float specialized into the graph would recompile at every call (dynamic=True's first compile may be traced
    # twice: tests/api/test_compile_dynamic.py)
    assert backend.graphs == graphs, \
        f"{backend.graphs - graphs} recompiles for the {len(CALLS) - warm_up} calls after the first dynamic graph"


def test_a_beta_crossing_0_or_1_compiles_each_divergence_mode_once():
    """beta selects the divergence mode the paths compile (``divergence_mode``: beta == 0 forward KL, == 1 reverse
    KL, else the JSD); with beta symbolic that comparison is a guard: the first beta = 0 and the first beta = 1 each
    compile their mode's graph (PyTorch may trace it twice: a restart that specializes beta there), which later
    values of that mode reuse; no graph break, eager's numbers throughout."""
    backend = CountingBackend()
    step, set_options = _entry("fused_linear_distill_loss", "torch")
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    args = _batch(5)
    counts = []
    for beta in (0.3, 0.4, 0.0, 1.0, 0.0, 0.6, 1.0, 0.5):
        floats = (beta, 0.8, 3.0, 0.6)
        eager, ours = _call(step, set_options, args, floats), _call(compiled, set_options, args, floats)
        for what in eager:
            assert torch.equal(ours[what], eager[what]), (beta, what)
        counts.append(backend.graphs)
    # the static graph (0.3), the symbolic JSD one (0.4), forward KL (0.0), reverse KL (1.0); then none
    assert counts[0] < counts[1] < counts[2] < counts[3] == counts[-1], counts


# per bad value: the entry point, the float it replaces (index into beta, temperature, cap, scale), the value, the
# message's start (the value is not shown under compile: _checks.shown)
BAD_FLOATS = [("fused_linear_distill_loss", 1, 0.0, "temperature must be a finite number > 0, got "),
              ("fused_linear_distill_loss", 0, 1.5, r"beta must be in \[0, 1\] .*got "),
              ("linear_token_divergence", 2, -2.0, "student_softcap must be > 0, got "),
              ("linear_token_divergence", 3, float("inf"), "teacher_logit_scale must be a finite number, got "),
              ("liger_fused_linear_jsd", 0, 1.5, r"jsd_beta must be in \[0, 1\] .*got "),
              ("LigerFusedLinearJSD", 1, -1.0, "temperature must be a finite number > 0, got ")]


@pytest.mark.parametrize("dynamic", [None, True], ids=["automatic-dynamic", "dynamic=True"])
@pytest.mark.parametrize("name, index, value, message", BAD_FLOATS,
                         ids=[f"{b[0]}-{('beta', 'temperature', 'cap', 'scale')[b[1]]}={b[2]}" for b in BAD_FLOATS])
def test_a_bad_float_arriving_symbolic_raises_the_value_error(name, index, value, message, dynamic):
    """Warmed up until the floats are symbolic, the step gets one bad value: its check (a guard of the graph) fails,
    the step is traced again and raises the ValueError naming the argument, which Dynamo's Unsupported quotes
    (``fullgraph=True``; docs/api.md "What bad input raises"); eager raises it with the value shown. A good value
    afterwards reuses the graph and gives eager's numbers."""
    backend = CountingBackend()
    step, set_options = _entry(name, "torch")
    compiled = torch.compile(step, fullgraph=True, dynamic=dynamic, backend=backend)
    for T, *floats in CALLS[:1 if dynamic else 2]:
        _call(compiled, set_options, _batch(T), floats)
    T, *floats = CALLS[2]
    floats[index] = value
    args = _batch(T)
    with pytest.raises(torch._dynamo.exc.Unsupported,
                       match=r"raised exception ValueError\(.*" + message + "a value traced by torch.compile"):
        _call(compiled, set_options, args, floats)
    with pytest.raises(ValueError, match=message + repr(value)):
        _call(step, set_options, args, floats)
    graphs = backend.graphs
    T, *floats = CALLS[3]
    args = _batch(T)
    eager, ours = _call(step, set_options, args, floats), _call(compiled, set_options, args, floats)
    for what in eager:
        assert torch.equal(ours[what], eager[what]), what
    assert backend.graphs == graphs, "a good value after the bad one recompiled: the floats were not symbolic"
