"""The eager reference: group advantages, float64 self-consistency, and Liger's fused-linear loss as an oracle."""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.reference import loss_from_logps, reference_grpo_loss

from ..support.cases import CASES, make_inputs
from ..support.heads import assert_head_three_way, linear_truth
from ..support.oracles import liger_fused_linear_loss
from ..support.tolerances import U, gamma


def _trl_style_advantages(rewards, G, scale, eps=1e-4):
    """TRL 1.16's sum_then_normalize advantages, written out with its own ``nanstd``."""
    from trl.trainer.utils import nanstd
    grouped = rewards.view(-1, G)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(G)
    std = nanstd(grouped, dim=1).repeat_interleave(G) if scale != "batch" else nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + eps)
    return torch.nan_to_num(adv, nan=0.0)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_trl(scale):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, 3, generator=g, dtype=torch.float64)
    rewards[2, 1] = float("nan")           # one reward function could not score a completion
    rewards[5] = float("nan")              # no function could: unscorable, advantage 0
    rewards[6:9] = 1.0                     # a group with identical rewards: advantage 0, not NaN
    weights = [1.0, 0.5, 2.0]
    ours = gk.group_advantages(rewards, 3, scale=scale, weights=weights)
    summed = torch.nansum(rewards * torch.tensor(weights, dtype=torch.float64), 1)
    summed[5] = float("nan")
    expected = _trl_style_advantages(summed, 3, scale)
    # bound: TRL's nanstd forms its Bessel factor count / (count - 1) in float32: one fp32 rounding of the variance
    #   (<= u), half of it in the std, so rtol = u of fp32 (2x margin); atol: the float64 rounding of r - mean,
    #   ~u(float64) |r| / std ~ 1e-15 for these rewards (|r| < 8, group std > 0.1), 1e-12 leaving 1000x
    assert torch.allclose(ours, expected, rtol=U[torch.float32], atol=1e-12)
    assert ours[5] == 0 and torch.all(ours[6:9] == 0)


def test_group_advantages_are_zero_mean_unit_std_per_group():
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 1.0, 1.0])
    adv = gk.group_advantages(r, 4)
    # fp32: each advantage rounded once (u) after an exact r - mean, their mean summed over 4 (gamma_3): the group
    # mean is 0 within gamma_4 * sum |adv| / 4; the std of 4 values takes ~8 rounded operations (gamma_8 relative)
    for group in adv.view(2, 4):
        assert abs(group.mean().item()) <= gamma(4) * group.abs().sum().item() / 4
    assert torch.allclose(adv[:4], (r[:4] - 2.5) / (r[:4].std() + 1e-4), rtol=gamma(8), atol=0)  # bound: above


# Stop-gradient terms (cispo's clamped ratio, vespo's phi, on-policy old = logp.detach()) make the gradient
# differ from the loss's derivative by design, and piecewise-constant masks move under finite differences: those
# cases are covered by the TRL comparison instead.
SMOOTH_CASES = [c for c in CASES if c.old and c.config.loss_type not in ("cispo", "vespo")
                and c.config.top_entropy_quantile == 1.0 and c.config.off_policy_mask_threshold is None]


@pytest.mark.parametrize("case", SMOOTH_CASES, ids=lambda c: c.id)
def test_reference_gradient_equals_finite_differences(case):
    """float64 autograd of the reference is the derivative of its own loss (gradcheck)."""
    inputs = make_inputs(case, B=3, T=4, V=9)
    logits = inputs["logits"].double()
    rest = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in inputs.items() if k not in ("logits", "ids", "advantages", "mask")}

    def fn(x):
        return reference_grpo_loss(x, inputs["ids"], inputs["advantages"].double(), inputs["mask"],
                                   config=case.config, **rest)[0]
    # bound: float64 central differences: truncation ~eps^2 * (third derivative) ~ 1e-12, rounding
    #   ~2^-53 |f| / eps ~ 1e-10, both far below atol (gradcheck's float64 defaults, independent of the CPU)
    assert torch.autograd.gradcheck(fn, (logits.requires_grad_(True),), eps=1e-6, atol=1e-6)


LIGER_CASES = [c for c in CASES if c.config.loss_type != "luspo" and c.config.top_entropy_quantile == 1.0
               and c.config.entropy_coef == 0.0 and c.config.off_policy_mask_threshold is None
               and not c.adv_2d and c.is_ratio != "row"
               and not (c.config.importance_sampling_level == "sequence" and c.config.loss_type == "sapo")]


@pytest.mark.parametrize("case", LIGER_CASES, ids=lambda c: c.id)
def test_matches_liger_fused_linear(case):
    """Liger's chunked loss agrees where it implements the contract (docs/numerics.md: known divergences of the peers)."""
    inputs = make_inputs(case, hidden_size=16, seed=3)
    rest = {k: v for k, v in inputs.items() if k not in ("hidden", "weight", "ids", "advantages", "mask")}
    rest.pop("sampling_logps", None)
    h = inputs["hidden"].clone().requires_grad_(True)
    w = inputs["weight"].clone().requires_grad_(True)
    ours, _ = gk.fused_linear_grpo_loss(h, w, inputs["ids"], inputs["advantages"], inputs["mask"],
                                        config=case.config, impl="torch", **rest)
    ours_grads = torch.autograd.grad(ours, (h, w))
    h2 = inputs["hidden"].clone().requires_grad_(True)
    w2 = inputs["weight"].clone().requires_grad_(True)
    theirs = liger_fused_linear_loss(h2, w2, inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=case.config, **rest)
    theirs_grads = torch.autograd.grad(theirs, (h2, w2))
    # both against the float64 reference by the three-way rule (the reference in fp32 the middle term): Liger
    # implements the contract here, and ours does; so the two agree within twice the bound
    head = {k: v for k, v in inputs.items() if k != "sampling_logps"}  # the inputs both calls were given
    truth, same = (linear_truth(head, case.config, dtype=d) for d in (torch.float64, torch.float32))
    assert_head_three_way((theirs.detach(), theirs_grads), same, truth, torch.float32, "liger")
    assert_head_three_way((ours.detach(), ours_grads), same, truth, torch.float32, "ours")


def test_documented_divergence_liger_luspo():
    """Liger's luspo normalizes per_token_loss * len(row) by B*T; TRL 1.16 (and we) sum masked tokens per row."""
    case = next(c for c in CASES if c.id == "luspo-token")
    inputs = make_inputs(case, hidden_size=16, seed=3)
    ours, _ = gk.fused_linear_grpo_loss(inputs["hidden"], inputs["weight"], inputs["ids"], inputs["advantages"],
                                        inputs["mask"], old_logps=inputs["old_logps"], config=case.config)
    theirs = liger_fused_linear_loss(inputs["hidden"], inputs["weight"], inputs["ids"], inputs["advantages"],
                                     inputs["mask"], old_logps=inputs["old_logps"], config=case.config)
    # bound: not a tolerance: a real difference, not rounding: the two normalizers differ by a factor != 1 on these
    #   ragged rows, so the losses differ at the loss's own scale; 1e-3 is far above fp32 rounding (ATOL[fp32],
    #   1.5e-5) and below that scale
    assert abs(ours.item() - theirs.item()) > 1e-3


def test_loss_from_logps_on_policy_ratio_is_one_and_gradient_flows():
    logps = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, metrics = loss_from_logps(logps, adv, config=gk.GRPOLossConfig(loss_type="bnpo"))
    loss.backward()
    # on-policy: loss = -mean(A), d loss / d logp = -A / N per token
    # bound: float64: ratio exp(0) = 1 exactly and the advantages cancel exactly; -A / 6 within a few roundings
    assert loss.item() == 0.0
    assert torch.allclose(logps.grad, -adv[:, None].expand(2, 3) / 6, rtol=gamma(4, torch.float64),
                          atol=0)  # bound: above
    assert metrics["clip_ratio/region_mean"].item() == 0.0
