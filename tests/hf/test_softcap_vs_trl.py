"""A soft-capped head gives TRL's numbers on every path (issue "what no peer ships", done-when).

TRL knows nothing of the cap in its loss: the model applies it (transformers' Gemma 2), so the oracle is TRL's own
``GRPOTrainer._compute_loss`` (tests/support/oracles.py) on float64 logits capped by ``reference.soft_cap``, with the
loss options alone. Ours: ``fused_linear_grpo_loss`` / ``grpo_loss`` with ``softcap=`` on each path the planner can take
(asserted from the plans), the Triton ones under the interpreter. A cap of 1.5 on logits of spread ~1 bends most
of them; the bias holds one very large logit (far in the flat part of tanh).
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import soft_cap

from ..support.cases import CASES, make_inputs, optional_inputs
from ..support.oracles import trl_compute_loss, trl_loss_grad_metrics
from ..support.heads import HIDDEN, assert_head_three_way, fast_path_budget
from ..support.tolerances import assert_three_way, grad_scale

pytestmark = [pytest.mark.interpreter, pytest.mark.usefixtures("poisoned_outputs")]

CAP = 1.5
TOKEN = next(c for c in CASES if c.id == "grpo-beta-kl")
SEQUENCE = next(c for c in CASES if c.id == "grpo-sequence")


def _bias(V):
    b = torch.randn(V, generator=torch.Generator().manual_seed(7)) * 0.3
    b[5] = 40.0  # |x| >> cap: the cap's derivative is ~0 there
    return b


def _trl(inputs, case, bias, temperature, dtype=torch.float64):
    """TRL's loss and (d hidden, d weight, d bias) on logits capped like the model would cap them, everything in
    ``dtype``: float64 the truth, fp32 the middle term of the three-way rule."""
    h, w, b = (t.to(dtype).requires_grad_(True) for t in (inputs["hidden"], inputs["weight"], bias))
    logits = soft_cap(h @ w.T + b, CAP)
    rest = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in optional_inputs(inputs).items()}
    loss, metrics = trl_compute_loss(logits, inputs["ids"], inputs["advantages"].to(dtype), inputs["mask"],
                                     config=case.config.replace(temperature=temperature), **rest)
    return loss.detach(), torch.autograd.grad(loss, [h, w, b]), metrics


def _fused(inputs, case, bias, impl, temperature, **kw):
    h, w, b = (t.clone().requires_grad_(True) for t in (inputs["hidden"], inputs["weight"], bias))
    loss, metrics = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"], bias=b,
                                              config=case.config, impl=impl, softcap=CAP, temperature=temperature,
                                              **optional_inputs(inputs), **kw)
    return loss.detach(), torch.autograd.grad(loss, [h, w, b]), metrics


def _assert_trl(result, trl64, trl32):
    """The three-way rule with TRL as the oracle: against TRL in float64, within K times TRL's own fp32 error."""
    checked = [n for n in ("kl", "entropy", "clip_ratio/region_mean") if n in trl64[2]]  # kl: logged with beta
    assert "entropy" in checked
    assert_head_three_way(result, trl32, trl64, torch.float32, "softcap", metrics=checked)


HEAD_PATHS = [  # (case, impl, extra options, expected path)
    (TOKEN, "torch", {}, "head.torch"),
    (TOKEN, "triton", {"fast_rows": 3}, "head.fast"),
    (SEQUENCE, "triton", {"fast_rows": 10}, "head.fast_sequence"),
    (TOKEN, "triton", {"grad_in_forward": False}, "head.light"),
    (TOKEN, "triton", {"grad_in_forward": False, "deterministic": False}, "head.light"),
]


@pytest.mark.parametrize("case,impl,extra,path", HEAD_PATHS,
                         ids=[f"{p}-{c.id}{'-atomic' if 'deterministic' in e else ''}" for c, _, e, p in HEAD_PATHS])
def test_fused_head_with_softcap_matches_trl(case, impl, extra, path, knobs, plans):
    knobs(fast_path_min_rows=1)
    inputs = make_inputs(case, hidden_size=HIDDEN, V=37, seed=31)
    bias = _bias(37)
    extra = dict(extra)
    if "fast_rows" in extra:
        extra["memory_budget"] = fast_path_budget(inputs, case, extra.pop("fast_rows"), bias)
    plans.clear()
    ours = _fused(inputs, case, bias, impl, 0.8, **extra)
    assert plans[-1].path == path
    _assert_trl(ours, _trl(inputs, case, bias, 0.8), _trl(inputs, case, bias, 0.8, torch.float32))


@pytest.mark.parametrize("impl,extra,path", [("torch", {}, "logits.torch"), ("triton", {}, "logits.fast"),
                                             ("triton", {"grad_in_forward": False}, "logits.sweep")])
def test_logits_loss_with_softcap_matches_trl(impl, extra, path, plans):
    inputs = make_inputs(TOKEN, V=37, seed=32)
    logits = inputs.pop("logits")
    logits[0, 0, 3] = 60.0  # |x| >> cap
    rest = {k: v for k, v in inputs.items() if k not in ("ids", "advantages", "mask")}
    x = logits.clone().requires_grad_(True)
    plans.clear()
    loss, metrics = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=TOKEN.config,
                                 impl=impl, softcap=CAP, temperature=0.8, **rest, **extra)
    (grad,) = torch.autograd.grad(loss, x)
    assert plans[-1].path == path
    capped = lambda z: soft_cap(z, CAP)  # noqa: E731
    trl64, trl32 = (trl_loss_grad_metrics(logits, dict(inputs, logits=logits), TOKEN.config.replace(temperature=0.8),
                                          capped, d) for d in (torch.float64, torch.float32))
    assert_three_way(loss.detach(), trl32[0], trl64[0], torch.float32, "loss")
    assert_three_way(grad, trl32[1], trl64[1], torch.float32, "d logits", scale=grad_scale(trl64[1]))
    for name in ("kl", "entropy", "clip_ratio/region_mean"):
        assert_three_way(metrics[name], trl32[2][name], trl64[2][name], torch.float32, name)
