"""The loss-type table (grpo_kernels/loss_types.py) against the contract written out by hand, and every consumer
of it: the config's accepted names, the reference's policy terms and reductions, the Triton stage's KIND codes."""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import loss_types
from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.loss_types import LOSS_TABLE, reduction_weights
from grpo_kernels.reference import loss_from_logps

from ..support.tolerances import gamma

# docs/DESIGN.md section 2, written out independently of the table
CONTRACT = {
    "grpo": ("clipped", lambda l, m, n: ((m * l).sum(-1) / m.sum(-1).clamp(min=1)).mean()),
    "sapo": ("sapo", lambda l, m, n: ((m * l).sum(-1) / m.sum(-1).clamp(min=1)).mean()),
    "bnpo": ("clipped", lambda l, m, n: (m * l).sum() / m.sum().clamp(min=1)),
    "dr_grpo": ("clipped", lambda l, m, n: (m * l).sum() / (m.shape[0] * m.shape[1])),
    "dapo": ("clipped", lambda l, m, n: (m * l).sum() / max(n, 1)),
    "cispo": ("cispo", lambda l, m, n: (m * l).sum() / max(n, 1)),
    "vespo": ("vespo", lambda l, m, n: (m * l).sum() / max(n, 1)),
    "luspo": ("clipped", lambda l, m, n: (m * l).sum(-1).mean()),
}


def test_table_covers_the_contract_and_the_config():
    assert set(LOSS_TABLE) == set(CONTRACT) == set(LOSS_TYPES)
    for name, (policy, _) in CONTRACT.items():
        assert LOSS_TABLE[name].policy == policy, name
    for name in LOSS_TYPES:
        assert gk.GRPOLossConfig(loss_type=name).loss_type == name
    with pytest.raises(ValueError, match="loss_type"):
        gk.GRPOLossConfig(loss_type="ppo")
    assert {n for n, lt in LOSS_TABLE.items() if lt.uses_num_items_in_batch} == {"dapo", "cispo", "vespo"}
    assert {n for n, lt in LOSS_TABLE.items() if not lt.token_local} == {"vespo"}


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_reduction_weights_match_the_contract(name):
    g = torch.Generator().manual_seed(1)
    per_token = torch.randn(5, 6, generator=g, dtype=torch.float64)
    mask = (torch.rand(5, 6, generator=g) > 0.3).double()
    mask[2] = 0.0  # a fully masked row
    for num_items in (None, 40):
        w = reduction_weights(mask, name, num_items)
        n = mask.sum().item() if num_items is None else num_items
        expected = CONTRACT[name][1](per_token, mask, n)
        # bound: float64, 30 terms summed in two orders, each term a few roundings (a weight, a product, a row
        #   normalizer): each side within gamma(40) * sum |terms| of the exact value, so within twice that
        slack = 2 * gamma(40, torch.float64) * (w * per_token).abs().sum().item()
        torch.testing.assert_close((w * per_token).sum(), expected, rtol=0, atol=slack)
        assert (w[mask == 0] == 0).all()


@pytest.mark.parametrize("name", LOSS_TYPES)
def test_reference_follows_the_table(name):
    """One token, one row: the reference's value is the contract's policy term for the table's policy."""
    logp = torch.tensor([[-1.2]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1.6]], dtype=torch.float64)
    adv = torch.tensor([0.7], dtype=torch.float64)
    cfg = gk.GRPOLossConfig(loss_type=name, epsilon_low=0.2, epsilon_high=0.28)
    loss, _ = loss_from_logps(logp, adv, old_logps=old, config=cfg)
    rho = torch.exp(logp.detach() - old)[0, 0]
    a = adv[0]
    policy = LOSS_TABLE[name].policy
    if policy == "clipped":
        expected = -torch.minimum(rho * a, rho.clamp(0.8, 1.28) * a)
    elif policy == "cispo":
        expected = -torch.clamp(rho, max=0.28) * a * logp.detach()[0, 0]
    elif policy == "sapo":
        t = cfg.sapo_temperature_pos
        expected = -torch.sigmoid(t * (rho - 1)) * 4 / t * a
    else:
        log_w = torch.log(rho).clamp(min=torch.log(torch.tensor(1e-8, dtype=torch.float64)), max=20.0)
        phi = torch.exp(cfg.vespo_lambda_pos + cfg.vespo_k_pos * log_w - cfg.vespo_lambda_pos * torch.exp(log_w))
        expected = -phi * a * logp.detach()[0, 0]
    # bound: float64, at most ~12 roundings on each side on O(1) values (exponents below 4 in size, so an exp
    #   turns an absolute error into a relative one of the same size): within gamma(12) * 4 ~ 5e-15, 1e-12 leaving
    #   200x
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-12, atol=1e-12)


def test_triton_stage_kinds_follow_the_table():
    from grpo_kernels.kernels import token_loss_kernels as tk

    # the kernel's branches are `KIND == 0` (clipped), `KIND == 1` (cispo), else sapo
    assert (tk.KIND_CLIPPED, tk.KIND_CISPO, tk.KIND_SAPO) == (0, 1, 2)
    for name, lt in LOSS_TABLE.items():
        if lt.token_local:
            assert lt.policy_kind == {"clipped": 0, "cispo": 1, "sapo": 2}[lt.policy], name
    assert loss_types.POLICY_TERMS[:3] == ("clipped", "cispo", "sapo")
