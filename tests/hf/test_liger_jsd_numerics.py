"""The numbers of ``grpo_kernels.liger``'s JSD entry points against float64, on awkward shapes (V not a power of two,
one token, every token ignored, a teacher of another width, a larger teacher vocabulary): the three-way rule
(tests/support/tolerances.py) with Liger's own torch maths (tests/support/liger_jsd.py) in float64 as the truth and
in the inputs' dtype as the middle term. Also: Liger's beta is TRL's (both peers' code), the hard loss is computed
exactly when Liger computes it, and ours keeps fp32 logits where Liger 0.8.5's CPU path rounds them to bf16.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("liger_kernel.chunked_loss.jsd_loss", reason="needs liger-kernel (test extra)")
from tests.support import liger_jsd as lj  # noqa: E402
from tests.support.liger_jsd import JSDCase  # noqa: E402
from tests.support.tolerances import ATOL, K, assert_same_maths, assert_three_way, grad_scale, max_err  # noqa: E402

from grpo_kernels import liger as ours  # noqa: E402
from grpo_kernels import liger_jsd  # noqa: E402

DTYPES = [torch.float32, torch.bfloat16]
FUSED_CASES = [
    JSDCase("v37-jsd0.3", 6, 8, 12, 37, 0.3, 1.0),
    JSDCase("one-token-forward-kl-t2", 1, 16, 8, 129, 0.0, 2.0, ignored="none"),
    JSDCase("v300-reverse-kl-t0.5", 13, 8, 8, 300, 1.0, 0.5),
    JSDCase("all-ignored", 5, 8, 12, 37, 0.5, 1.0, ignored="all"),
    JSDCase("spread10-jsd0.9-ii42", 9, 12, 16, 100, 0.9, 1.5, spread=10.0, ignore_index=42),
]
CHUNKED_CASES = [
    JSDCase("v37-jsd0.3-bias", 6, 8, 12, 37, 0.3, 1.0, bias=True),
    JSDCase("one-token-t2-hard-only", 1, 16, 8, 129, 0.0, 2.0, ignored="none", weights=(1.0, 0.0)),
    JSDCase("reverse-kl-t0.5-soft-only-bias", 13, 8, 8, 300, 1.0, 0.5, weights=(0.0, 1.0), bias=True),
    JSDCase("all-ignored-bias", 5, 8, 12, 37, 0.5, 1.0, ignored="all", bias=True),
    JSDCase("padded-student-vocab97-t2-bias", 7, 8, 12, 130, 0.5, 2.0, v_student=97, bias=True),
    JSDCase("spread10-jsd0.8-ii42", 9, 12, 16, 100, 0.8, 1.0, spread=10.0, ignore_index=42, weights=(0.3, 0.9)),
]


def _grads(loss, leaves):
    return torch.autograd.grad(loss, leaves)


def _assert_grads(ours_g, mid_g, truth_g, dtype, what):
    for name, g, m, t in zip(("d student_input", "d student_weight", "d student_bias"), ours_g, mid_g, truth_g):
        assert_three_way(g, m, t, dtype, f"{what} {name}", scale=grad_scale(t))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", FUSED_CASES, ids=lambda c: c.name)
def test_fused_jsd_against_float64(case, dtype):
    """``LigerFusedLinearJSD`` (and ``liger_fused_linear_jsd``, the same call): loss and student gradients."""
    inputs = lj.make_inputs(case, dtype)
    truth = lj.student_leaves(inputs, torch.float64)
    loss64 = lj.fused_loss(truth, inputs, case, torch.float64)
    mid = lj.student_leaves(inputs, dtype)
    loss_d = lj.fused_loss(mid, inputs, case, dtype)
    mine = lj.student_leaves(inputs, dtype)
    loss = ours.LigerFusedLinearJSD(case.beta, case.ignore_index, case.temperature)(
        mine[0], mine[1], inputs["ti"], inputs["tw"], inputs["labels"])
    assert_three_way(loss.detach(), loss_d.detach(), loss64.detach(), dtype, f"{case.name} loss")
    grads = _grads(loss, mine)
    _assert_grads(grads, _grads(loss_d, mid), _grads(loss64, truth), dtype, case.name)
    if case.ignored == "all":  # Liger's test_correctness_all_ignored: exactly 0, and no gradient
        assert loss.item() == 0.0 and all(not g.any() for g in grads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_jsd_without_labels_averages_every_token(dtype):
    case = FUSED_CASES[0]
    inputs = lj.make_inputs(case, dtype)
    truth = lj.student_leaves(inputs, torch.float64)
    loss64 = lj.fused_loss(truth, inputs, case, torch.float64, with_labels=False)
    mid = lj.student_leaves(inputs, dtype)
    loss_d = lj.fused_loss(mid, inputs, case, dtype, with_labels=False)
    mine = lj.student_leaves(inputs, dtype)
    loss = ours.liger_fused_linear_jsd(mine[0], mine[1], inputs["ti"], inputs["tw"], None, case.beta,
                                       temperature=case.temperature)
    assert_three_way(loss.detach(), loss_d.detach(), loss64.detach(), dtype, "no labels loss")
    _assert_grads(_grads(loss, mine), _grads(loss_d, mid), _grads(loss64, truth), dtype, "no labels")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CHUNKED_CASES, ids=lambda c: c.name)
def test_chunked_jsd_loss_against_float64(case, dtype):
    """``LigerFusedLinearJSDLoss``: loss, soft and hard parts, and the student's gradients (input, weight, bias), the
    middle term Liger's own chunked loss in the same dtype."""
    inputs = lj.make_inputs(case, dtype)
    truth = lj.student_leaves(inputs, torch.float64)
    parts64 = lj.chunked_loss_float64(truth, inputs, case)
    mid = lj.student_leaves(inputs, dtype)
    parts_d = lj.chunked_loss_in_dtype(mid, inputs, case)
    mine = lj.student_leaves(inputs, dtype)
    module = ours.LigerFusedLinearJSDLoss(*case.weights, beta=case.beta, ignore_index=case.ignore_index,
                                          temperature=case.temperature, return_soft_hard_loss=True)
    bias = mine[2] if case.bias else None
    parts = module(mine[0], mine[1], inputs["ti"], inputs["tw"], inputs["labels"], bias, inputs["tb"])
    for name, p, m, t in zip(("loss", "soft loss", "hard loss"), parts, parts_d, parts64):
        assert_three_way(p.detach(), m.detach(), t.detach(), dtype, f"{case.name} {name}")
    _assert_grads(_grads(parts[0], mine), _grads(parts_d[0], mid), _grads(parts64[0], truth), dtype, case.name)


def test_chunked_function_is_the_module():
    """``chunked_liger_fused_linear_jsd`` (Liger's chunked functional, positional) gives the module's numbers."""
    case = CHUNKED_CASES[0]
    inputs = lj.make_inputs(case, torch.float32)
    args = (inputs["si"], inputs["sw"], inputs["ti"], inputs["tw"], inputs["labels"], inputs["sb"], inputs["tb"])
    by_module = ours.LigerFusedLinearJSDLoss(0.3, 0.9, 0.2, -100, 2.0)(*args)
    by_function = ours.chunked_liger_fused_linear_jsd(*args, 0.3, 0.9, 0.2, -100, 2.0)
    assert torch.equal(by_module, by_function)


@pytest.mark.parametrize("weight_hard_loss, return_parts, calls", [(0.0, False, 0), (0.0, True, 1), (0.5, False, 1)])
def test_hard_loss_computed_only_when_used(monkeypatch, weight_hard_loss, return_parts, calls):
    """Liger's ``test_jsd_hard_loss_computed_only_when_used`` for ours: the student's label log-probs (one
    ``linear_token_logprobs`` sweep) are computed exactly when the hard loss is weighted or returned; returned,
    it is the cross-entropy (three-way against float64, Liger's fp32 ``F.cross_entropy`` as the middle term)."""
    seen = []
    real = liger_jsd.linear_token_logprobs
    monkeypatch.setattr(liger_jsd, "linear_token_logprobs", lambda *a, **k: seen.append(1) or real(*a, **k))
    case = JSDCase("hard", 16, 32, 32, 64, 0.5, 1.0, ignored="none")
    inputs = lj.make_inputs(case, torch.float32)
    inputs["labels"][3] = -100
    out = ours.LigerFusedLinearJSDLoss(weight_hard_loss, 1.0 - weight_hard_loss, beta=0.5, chunk_size=4,
                                       compiled=False, return_soft_hard_loss=return_parts)(
        inputs["si"], inputs["sw"], inputs["ti"], inputs["tw"], inputs["labels"])
    assert len(seen) == calls
    if return_parts:
        logits = inputs["si"] @ inputs["sw"].T
        ce = torch.nn.functional.cross_entropy
        truth = ce(logits.double(), inputs["labels"], ignore_index=-100)
        assert_three_way(out[2], ce(logits, inputs["labels"], ignore_index=-100), truth, torch.float32, "hard loss")


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.7, 1.0])
def test_ligers_beta_is_trls(beta):
    """Liger's beta (its chunked loss's torch definition) and TRL 1.16's (``ChunkedDivergenceFunction``) are one
    convention, ours: 0 KL(teacher || student), 1 KL(student || teacher), the mixture (1 - beta) p_s + beta p_t; and
    reading it backwards is a different number (the check can fail)."""
    trl_div = pytest.importorskip("trl.kernels.chunked_divergence", reason="needs trl (test extra)")
    case = JSDCase("beta", 11, 8, 12, 53, beta, 1.5, ignored="none", spread=4.0)
    inputs = lj.make_inputs(case, torch.float64)
    si, sw, ti, tw = (inputs[k] for k in ("si", "sw", "ti", "tw"))
    liger64 = lj.fused_loss([si, sw], inputs, case, torch.float64)
    mine = ours.liger_fused_linear_jsd(si, sw, ti, tw, jsd_beta=beta, temperature=1.5)
    assert_same_maths(mine, liger64, torch.float32, "ours vs Liger's definition")  # ours: an fp32 loss, as Liger's
    f32 = [t.float() for t in (si, sw, ti, tw)]
    trl, _ = trl_div.ChunkedDivergenceFunction.apply(f32[0], f32[1], None, f32[2], f32[3], None, beta, 1.5)
    assert_same_maths(trl.mean(), liger64, torch.float32, "TRL vs Liger's definition")
    if beta != 0.5:
        backwards = lj.fused_loss([si, sw], inputs, JSDCase("b", 11, 8, 12, 53, 1.0 - beta, 1.5, ignored="none"),
                                  torch.float64)
        assert abs(backwards.item() - liger64.item()) > 1e-3 * abs(liger64.item())  # bound: not a tolerance: the two sides of the JSD differ by O(10%) here


# The upstream test_logits_projection_is_not_rounded_to_input_dtype's logit spreads, per beta (its docstring: wide
# enough that rounding the logits to bf16 shows in the gradient)
PROJECTION_SPREAD = {0.0: 30.0, 1.0: 30.0}


@pytest.mark.interpreter  # Liger's own fused JSD kernel runs in Triton's interpreter on CPU tensors
@pytest.mark.parametrize("beta", sorted(PROJECTION_SPREAD))
def test_fp32_logits_where_liger_rounds(beta):
    """bf16 inputs at a realistic logit spread (Liger's own regression test of its issue #1432, which needs CUDA):
    ours computes the logits in fp32, so its gradients meet the three-way rule with the fp32 computation on the same
    bf16 inputs as the middle term; Liger 0.8.5's fused JSD off CUDA (``(x @ W.T).to(float32)``: the bf16 GEMM's
    rounded output) misses the same bound, which is the deviation docs/api.md states."""
    from liger_kernel.ops import LigerFusedLinearJSDFunction

    case = JSDCase("projection", 32, 128, 128, 1000, beta, 1.0, ignored="none", spread=PROJECTION_SPREAD[beta])
    inputs = lj.make_inputs(case, torch.bfloat16)
    truth = lj.student_leaves(inputs, torch.float64)
    truth_g = _grads(lj.fused_loss(truth, inputs, case, torch.float64), truth)
    fp32 = lj.student_leaves(inputs, torch.float32)
    fp32_g = [g.bfloat16() for g in _grads(lj.fused_loss(fp32, inputs, case, torch.float32), fp32)]
    mine = lj.student_leaves(inputs, torch.bfloat16)
    mine_g = _grads(ours.liger_fused_linear_jsd(mine[0], mine[1], inputs["ti"], inputs["tw"], jsd_beta=beta), mine)
    _assert_grads(mine_g, fp32_g, truth_g, torch.bfloat16, f"beta {beta}")
    theirs = lj.student_leaves(inputs, torch.bfloat16)
    loss = LigerFusedLinearJSDFunction.apply(theirs[0], theirs[1], inputs["ti"], inputs["tw"], None, beta, -100, 1.0,
                                             None, None, None)
    for g, f, t in zip(_grads(loss, theirs), fp32_g, truth_g):
        s = grad_scale(t)
        assert max_err(g, t) / s > K * max_err(f, t) / s + ATOL[torch.bfloat16]


@pytest.mark.interpreter  # Liger's own fused JSD kernel runs in Triton's interpreter on CPU tensors
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_round_logits_bf16_is_ligers_cpu_path(beta):
    """The deviation above is the rounding and nothing else: with ``round_logits="bf16"`` (ours, keyword-only) both
    models' logits are rounded as Liger's bf16 GEMM output is, and the gradients are Liger's."""
    from liger_kernel.ops import LigerFusedLinearJSDFunction

    case = JSDCase("projection", 32, 128, 128, 1000, beta, 1.0, ignored="none", spread=PROJECTION_SPREAD[beta])
    inputs = lj.make_inputs(case, torch.bfloat16)
    theirs = lj.student_leaves(inputs, torch.bfloat16)
    loss = LigerFusedLinearJSDFunction.apply(theirs[0], theirs[1], inputs["ti"], inputs["tw"], None, beta, -100, 1.0,
                                             None, None, None)
    mine = lj.student_leaves(inputs, torch.bfloat16)
    rounded = ours.liger_fused_linear_jsd(mine[0], mine[1], inputs["ti"], inputs["tw"], jsd_beta=beta,
                                          round_logits="bf16")
    for g, t in zip(_grads(rounded, mine), _grads(loss, theirs)):
        # bound: each side rounds its d logits and its GEMM's output to bf16 once (2 u(bf16) of the largest
        # gradient each), and the two fp32 accumulations may round a logit on a bf16 midpoint apart: 4 u(bf16)
        assert max_err(g, t) / grad_scale(t.double()) <= 4 * 2.0 ** -8


@pytest.mark.interpreter
@pytest.mark.parametrize("entry", ["fused", "chunked"])
def test_triton_path_against_float64(entry):
    """The same calls on the Triton kernels (the interpreter on CPU): one case each."""
    case = (FUSED_CASES if entry == "fused" else CHUNKED_CASES)[0]
    dtype = torch.float32
    inputs = lj.make_inputs(case, dtype)
    truth = lj.student_leaves(inputs, torch.float64)
    mid = lj.student_leaves(inputs, dtype)
    mine = lj.student_leaves(inputs, dtype)
    if entry == "fused":
        loss64, loss_d = (lj.fused_loss(x, inputs, case, d) for x, d in ((truth, torch.float64), (mid, dtype)))
        module = ours.LigerFusedLinearJSD(case.beta, case.ignore_index, case.temperature)
        module.impl = "triton"
        loss = module(mine[0], mine[1], inputs["ti"], inputs["tw"], inputs["labels"])
    else:
        loss64, loss_d = lj.chunked_loss_float64(truth, inputs, case)[0], lj.chunked_loss_in_dtype(mid, inputs, case)[0]
        module = ours.LigerFusedLinearJSDLoss(*case.weights, beta=case.beta, temperature=case.temperature)
        module.impl = "triton"
        loss = module(mine[0], mine[1], inputs["ti"], inputs["tw"], inputs["labels"], mine[2], inputs["tb"])
    assert_three_way(loss.detach(), loss_d.detach(), loss64.detach(), dtype, f"{entry} triton loss")
    _assert_grads(_grads(loss, mine), _grads(loss_d, mid), _grads(loss64, truth), dtype, f"{entry} triton")


def test_temperature_is_not_squared():
    """Liger divides both models' logits by the temperature and does not multiply the soft loss by T^2 (Hinton's
    convention): at T = 2 ours is the divergence of the tempered distributions itself."""
    case = JSDCase("t2", 8, 8, 8, 41, 0.5, 2.0, ignored="none", spread=3.0)
    inputs = lj.make_inputs(case, torch.float64)
    mine = ours.liger_fused_linear_jsd(inputs["si"], inputs["sw"], inputs["ti"], inputs["tw"], temperature=2.0)
    plain = lj.fused_loss([inputs["si"], inputs["sw"]], inputs, case, torch.float64)
    assert_same_maths(mine, plain, torch.float32, "T = 2")  # ours: an fp32 loss, as Liger's
    assert not math.isclose(mine.item(), 4 * plain.item(), rel_tol=0.5)  # bound: not a tolerance: T^2 = 4 times larger is far from it
