"""grpo_loss (both impls) and the eager reference against TRL 1.16's own ``GRPOTrainer._compute_loss``.

Done-when of the foundation: loss, d logits and metrics match TRL in fp32 for every loss type and option, by the
three-way rule of tests/support/tolerances.py with TRL as the oracle: against TRL in float64, within K times the
error of TRL itself in fp32 on the same inputs (measured in the same run) plus the fp32 ATOL.
"""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import reference_grpo_loss

from ..support.cases import CASES, make_inputs
from ..support.oracles import trl_compute_loss, trl_loss_grad_metrics
from ..support.tolerances import assert_same_maths, assert_three_way, grad_scale

METRICS = ("kl", "entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
           "cispo_clip_ratio", "vespo/phi_seq_mean")


def _kwargs(inputs):
    return {k: v for k, v in inputs.items() if k not in ("logits", "ids", "advantages", "mask")}


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
    trl64, trl32 = (trl_loss_grad_metrics(inputs["logits"], inputs, case.config, dtype=d)
                    for d in (torch.float64, torch.float32))
    assert trl32[1].abs().sum() > 0 or case.id == "on-policy", "degenerate case: TRL's gradient is zero"

    logits = inputs["logits"].clone().requires_grad_(True)
    if impl == "reference":
        loss, metrics = reference_grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"],
                                            config=case.config, **_kwargs(inputs))
    else:
        loss, metrics = gk.grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=case.config, impl=impl, **_kwargs(inputs))
    (grad,) = torch.autograd.grad(loss, logits)
    assert loss.dtype == torch.float32
    assert_three_way(loss.detach(), trl32[0], trl64[0], torch.float32, "loss")
    assert_three_way(grad, trl32[1], trl64[1], torch.float32, "d logits", scale=grad_scale(trl64[1]))
    for name in METRICS:
        if name in trl64[2]:
            assert_three_way(metrics[name], trl32[2][name], trl64[2][name], torch.float32, name)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_float64_gradcheck_free_of_trl(case):
    """The reference in float64 equals TRL run in float64 (the same maths in other orders): agreement within
    tests/support/tolerances.py's same_maths_slack (2 ATOL of float64), the gradient relative to its largest value."""
    inputs = make_inputs(case)
    inputs = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}
    logits = inputs["logits"].requires_grad_(True)
    loss, _ = reference_grpo_loss(logits, inputs["ids"], inputs["advantages"], inputs["mask"], config=case.config,
                                  **_kwargs(inputs))
    (grad,) = torch.autograd.grad(loss, logits)
    trl_loss, trl_grad, _ = _trl(case, inputs)
    assert_same_maths(loss, trl_loss, torch.float64, "loss")
    assert_same_maths(grad, trl_grad, torch.float64, "d logits", scale=grad_scale(trl_grad))
