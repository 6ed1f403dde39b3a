"""grpo_loss (both impls) and the eager reference against TRL 1.16's own ``GRPOTrainer._compute_loss``.

Done-when of the foundation: loss and d logits match TRL to 1e-5 relative in fp32 for every loss type and option.
"""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import reference_grpo_loss

from ..support.cases import CASES, make_inputs
from ..support.oracles import trl_compute_loss

METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
RTOL = 1e-5


def _kwargs(inputs):
    return {k: v for k, v in inputs.items() if k not in ("logits", "ids", "advantages", "mask")}


def _assert_close_rel(ours, theirs, what):
    scale = theirs.abs().max().clamp(min=1e-6)
    err = ((ours.double() - theirs.double()).abs().max() / scale).item()
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL}"


def _trl(case, inputs):
    logits = inputs["logits"].clone().requires_grad_(True)
    loss, metrics = trl_compute_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=case.config, **_kwargs(inputs))
    (grad,) = torch.autograd.grad(loss, logits)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("impl", ["torch", "triton", "reference"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_matches_trl_fp32(case, impl):
    inputs = make_inputs(case)
    trl_loss, trl_grad, trl_metrics = _trl(case, inputs)
    assert trl_grad.abs().sum() > 0 or case.id == "on-policy", "degenerate case: TRL's gradient is zero"

    logits = inputs["logits"].clone().requires_grad_(True)
    if impl == "reference":
        loss, metrics = reference_grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"],
                                            config=case.config, **_kwargs(inputs))
    else:
        loss, metrics = gk.grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=case.config, impl=impl, **_kwargs(inputs))
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.dtype == torch.float32
    _assert_close_rel(loss.detach(), trl_loss, "loss")
    _assert_close_rel(grad, trl_grad, "d logits")
    for name in METRICS:
        if name in trl_metrics:
            assert metrics[name].item() == pytest.approx(trl_metrics[name], rel=RTOL, abs=1e-7), name
    if case.config.loss_type == "cispo":
        assert metrics["cispo_clip_ratio"].item() == pytest.approx(trl_metrics["cispo_clip_ratio"], abs=1e-7)
    if case.config.loss_type == "vespo":
        assert metrics["vespo/phi_seq_mean"].item() == pytest.approx(trl_metrics["vespo/phi_seq_mean"], rel=RTOL)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_float64_gradcheck_free_of_trl(case):
    """The reference in float64 equals TRL run in float64 (both exact maths): agreement to 1e-12."""
    inputs = make_inputs(case)
    inputs = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    logits = inputs["logits"].requires_grad_(True)
    loss, _ = reference_grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                                  **_kwargs(inputs))
    (grad,) = torch.autograd.grad(loss, logits)
    trl_loss, trl_grad, _ = _trl(case, inputs)
    assert torch.allclose(loss, trl_loss, rtol=1e-12, atol=1e-14)
    assert torch.allclose(grad, trl_grad, rtol=1e-10, atol=1e-14)
