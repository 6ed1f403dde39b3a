"""The two-head divergence's maths (docs/DESIGN.md, "Distillation"): the closed-form gradients of each divergence
(forward KL, reverse KL, generalized JSD) chained through temperature, soft cap and scale, as the PyTorch path forms
them, against float64 autograd of the reference; the reference against independent formulas (torch's ``kl_div``, the
JSD's symmetry); beta exactly 0 and 1 as TRL treats them (not the JSD's limits)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from grpo_kernels.distill_config import DistillLossConfig
from grpo_kernels.distill_reference import divergence_from_logits, model_logits, token_divergence
from grpo_kernels.head.distill_torch import chunk_divergence

from ..support.distill_cases import ALL_OPTIONS, CASE_IDS, CASES
from ..support.tolerances import assert_same_maths, grad_scale

F64 = torch.float64


def _logits(R=6, V=37, seed=0, spread=3.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(R, V, generator=g, dtype=F64) * spread, torch.randn(R, V, generator=g, dtype=F64) * spread,
            torch.rand(R, generator=g, dtype=F64) + 0.5)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_closed_form_gradient_matches_float64_autograd(case):
    """d (sum_r g_r D_r) / d raw student logits in closed form (``chunk_divergence``: p - q, p (log p - log q - D),
    (1 - beta) p (log p - log m - KL(p || m)), times g / T, the cap's derivative and the scale) equals float64
    autograd through the reference; the divergence and entropy it returns equal the reference's."""
    xs, xt, g = _logits(seed=3)
    x = xs.clone().requires_grad_(True)
    div, ent = token_divergence(x, xt, case.cfg)
    (want,) = torch.autograd.grad((g * div).sum(), x)
    d_div, d_ent, _lse_s, _lse_t, _aux, got = chunk_divergence(xs.clone(), xt.clone(), case.cfg, g)
    assert_same_maths(d_div, div.detach(), F64, f"{case.id}: divergence")
    assert_same_maths(d_ent, ent, F64, f"{case.id}: entropy")
    assert_same_maths(got, want, F64, f"{case.id}: d raw student logits", scale=grad_scale(want))


@pytest.mark.parametrize("rounding", ["bf16", "fp16"])
def test_rounding_is_straight_through(rounding):
    """round_logits rounds both heads' raw logits before the scale; the gradient passes through the rounding
    unchanged (the closed form and autograd of the reference's straight-through agree)."""
    cfg = DistillLossConfig(beta=0.4, round_logits=rounding, **ALL_OPTIONS)
    xs, xt, g = _logits(seed=5)
    x = xs.clone().requires_grad_(True)
    div, _ = token_divergence(x, xt, cfg)
    (want,) = torch.autograd.grad((g * div).sum(), x)
    d_div, *_, got = chunk_divergence(xs.clone(), xt.clone(), cfg, g)
    assert_same_maths(d_div, div.detach(), F64, "divergence")
    assert_same_maths(got, want, F64, "d raw student logits", scale=grad_scale(want))
    plain, _ = token_divergence(xs, xt, cfg.replace(round_logits=None))
    assert (plain - div.detach()).abs().max() > 0  # bound: not a tolerance: the rounding changes the divergence


def test_reference_matches_torch_kl_div_and_the_jsd_symmetry():
    """beta 0 is torch's KL(q || p), beta 1 its KL(p || q); the generalized JSD with mixture (1 - beta) p + beta q
    is the one of beta' = 1 - beta with the models swapped, and lies between 0 and the mixture's bound
    -(beta log beta + (1 - beta) log (1 - beta))."""
    zs, zt, _ = _logits(seed=7)
    log_p, log_q = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
    fwd, _ = divergence_from_logits(zs, zt, 0.0)
    rev, _ = divergence_from_logits(zs, zt, 1.0)
    assert_same_maths(fwd, F.kl_div(log_p, log_q, reduction="none", log_target=True).sum(-1), F64, "forward KL")
    assert_same_maths(rev, F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1), F64, "reverse KL")
    for beta in (0.2, 0.5, 0.9):
        jsd, _ = divergence_from_logits(zs, zt, beta)
        swapped, _ = divergence_from_logits(zt, zs, 1.0 - beta)
        assert_same_maths(jsd, swapped, F64, f"JSD {beta}: swapped models")
        bound = -(beta * math.log(beta) + (1 - beta) * math.log(1 - beta))
        assert (jsd >= 0).all() and (jsd <= bound).all()


def test_beta_exactly_zero_and_one_are_the_kls_not_the_jsd_limits():
    """TRL's convention: beta == 0.0 selects the forward KL and 1.0 the reverse KL, while the JSD itself tends to 0
    at both ends (its weight on the other model vanishes): a beta just inside [0, 1] gives a divergence far
    below the KL's, as TRL's ChunkedDivergenceFunction gives."""
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction

    zs, zt, _ = _logits(seed=9)
    for end, inside in ((0.0, 1e-12), (1.0, math.nextafter(1.0, 0.0))):
        kl, _ = divergence_from_logits(zs, zt, end)
        near, _ = divergence_from_logits(zs, zt, inside)
        assert (near < 1e-3 * kl).all()  # bound: not a tolerance: O(beta) (or O(1 - beta)) against an O(1) KL
        h = torch.eye(zs.shape[0], dtype=torch.float32)  # logits = h W^T = the rows of W^T
        w_s, w_t = zs.float().T.contiguous(), zt.float().T.contiguous()
        trl_kl, _ = ChunkedDivergenceFunction.apply(h, w_s, None, h, w_t, None, end)
        trl_near, _ = ChunkedDivergenceFunction.apply(h, w_s, None, h, w_t, None, inside)
        assert (trl_near < 1e-3 * trl_kl).all()  # bound: not a tolerance: the same jump in TRL


def test_zero_probability_terms_add_nothing_and_nan_propagates():
    """A -inf logit (a banned token) has probability 0 and adds 0 to every sum (0 log 0 = 0): the same divergence as
    without that column; a -inf student logit where the teacher has mass makes KL(q || p) infinite; a NaN logit
    makes its row's divergence NaN (and only its row's)."""
    zs, zt, _ = _logits(R=3, seed=11)
    banned_s, banned_t = zs.clone(), zt.clone()
    banned_s[:, 4] = banned_t[:, 4] = float("-inf")
    keep = [i for i in range(zs.shape[1]) if i != 4]
    for beta in (0.0, 0.5, 1.0):
        got, ent = divergence_from_logits(banned_s, banned_t, beta)
        want, want_ent = divergence_from_logits(zs[:, keep], zt[:, keep], beta)
        assert_same_maths(got, want, F64, f"beta {beta}: banned column")
        assert_same_maths(ent, want_ent, F64, f"beta {beta}: entropy")
    only_student = zs.clone()
    only_student[0, 2] = float("-inf")
    assert torch.isinf(divergence_from_logits(only_student, zt, 0.0)[0][0])
    nan = zs.clone()
    nan[1, 3] = float("nan")
    for beta in (0.0, 0.5, 1.0):
        div, _ = divergence_from_logits(nan, zt, beta)
        assert torch.isnan(div[1]) and torch.isfinite(div[[0, 2]]).all()


def test_transform_order_is_scale_then_cap_then_temperature():
    """Each model's z = cap tanh(scale x / cap) / T (TRL's order), per model."""
    x = torch.linspace(-9.0, 9.0, 19, dtype=F64)
    t = DistillLossConfig(**ALL_OPTIONS).student
    want = t.softcap * torch.tanh(t.scale * x / t.softcap) / t.temperature
    assert_same_maths(model_logits(x, t), want, F64, "student transform")
