"""Inputs that pass validation but once gave wrong numbers (review findings, kept as regressions)."""
import os

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.reference import logprobs_and_entropy, reference_grpo_loss

from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy

IMPLS = ["torch", "triton"]
# A test that compares the impls inside one call runs Triton on CUDA tensors on a GPU machine and under the CPU
# interpreter elsewhere (tests/conftest.py sets TRITON_INTERPRET=1 without CUDA).
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available() else "cuda"


def _logits_case(seed=0, B=2, T=3, V=40):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g), torch.randint(0, V, (B, T), generator=g),
            torch.randn(B, generator=g), torch.randn(B, T, generator=g) * 0.3 - 3.5)


@pytest.mark.parametrize("mask_kind", ["float-half", "int-256"])
def test_non_binary_masks_count_like_bool(mask_kind):
    """Any non-zero mask value is a valid token, on every path (an int8 cast once skipped 0.5 and 256)."""
    logits, ids, adv, old = (t.to(DEVICE) for t in _logits_case())
    mask = torch.tensor([[1.0, 0.5, 0.0], [1.0, 1.0, 1.0]]) if mask_kind == "float-half" else \
        torch.tensor([[1, 256, 0], [1, 1, 1]], dtype=torch.int32)
    mask = mask.to(DEVICE)
    results = []
    for impl in IMPLS:
        x = logits.clone().requires_grad_(True)
        loss, metrics = gk.grpo_loss(x, ids, adv, mask, old_logps=old, impl=impl, loss_type="grpo")
        loss.backward()
        results.append((loss.detach(), x.grad, metrics["entropy"]))
    # every impl against float64 with the boolean mask, by the three-way rule (the reference in fp32 the middle term)
    cfg = gk.GRPOLossConfig(loss_type="grpo")
    terms = []
    for dtype in (torch.float64, torch.float32):
        x = logits.to(dtype).cpu().requires_grad_(True)
        loss, metrics = reference_grpo_loss(x, ids.cpu(), adv.to(dtype).cpu(), (mask != 0).cpu(),
                                            old_logps=old.to(dtype).cpu(), config=cfg)
        terms.append((loss.detach(), torch.autograd.grad(loss, x)[0], metrics["entropy"]))
    truth, same = terms
    for impl, result in zip(IMPLS, results):
        for name, o, s, t in zip(("loss", "d logits", "entropy"), result, same, truth):
            assert_three_way(o.cpu(), s, t, torch.float32, f"{impl} {name}",
                             scale=grad_scale(t) if name == "d logits" else None)


@pytest.mark.parametrize("impl", IMPLS)
def test_strided_token_ids(impl):
    """ids[:, ::2] flattens to a stride-2 view: the kernels must not read it with unit stride."""
    g = torch.Generator().manual_seed(1)
    big = torch.randint(0, 40, (2, 6), generator=g)
    ids = big[:, ::2]
    logits = torch.randn(2, 3, 40, generator=g)
    hidden, weight = torch.randn(2, 3, 8, generator=g), torch.randn(40, 8, generator=g)
    # the same code on the same values, only the ids' layout differs: the same bits (a unit-stride read of the view
    # would gather other tokens)
    assert torch.equal(gk.token_logprobs(logits, ids, impl=impl),
                       gk.token_logprobs(logits, ids.contiguous(), impl=impl))
    assert torch.equal(gk.linear_token_logprobs(hidden, weight, ids, impl=impl),
                       gk.linear_token_logprobs(hidden, weight, ids.contiguous(), impl=impl))


@pytest.mark.parametrize("impl", IMPLS)
def test_minus_inf_bias_gives_finite_entropy_and_gradients(impl):
    """A banned token (-inf bias) has probability 0; entropy and its gradient stay finite."""
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(3, 8, generator=g, requires_grad=True)
    weight = torch.randn(20, 8, generator=g)
    bias = torch.zeros(20)
    bias[5] = float("-inf")
    ids = torch.tensor([0, 1, 2])
    logp, ent = gk.linear_token_logprobs(hidden, weight, ids, bias=bias, return_entropy=True, impl=impl)
    (logp.sum() + ent.sum()).backward()
    _, t_ent = logprobs_and_entropy(hidden.detach().double() @ weight.double().T + bias.double(), ids)
    _, n_ent = naive_logprobs_entropy(hidden.detach() @ weight.T + bias, ids, 1.0)
    assert_three_way(ent, n_ent, t_ent, torch.float32, f"{impl} entropy")
    assert torch.isfinite(hidden.grad).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("impl", IMPLS)
# an is_ratio of +inf at padding, on purpose: the kernel's terms there are inf * 0, selected away (what is tested)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")
def test_sentinels_at_padded_positions_do_not_leak_nan(impl, level):
    """old / ref log-probs of -1e4 at padding (a common sentinel) overflow exp(); no NaN may reach the grads."""
    logits, ids, adv, old = _logits_case(seed=3)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    old = torch.where(mask, old, -1e4)
    ref = torch.where(mask, old + 0.1, -1e4)
    is_ratio = torch.where(mask, 1.0, float("inf"))
    x = logits.clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, ids, adv, mask, old_logps=old, ref_logps=ref, is_ratio=is_ratio, beta=0.04,
                                 importance_sampling_level=level, entropy_coef=0.01, impl=impl)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert (x.grad[~mask] == 0).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("impl", IMPLS)
def test_second_backward_after_inplace_backward_raises(impl):
    logits, ids, _, _ = _logits_case(seed=4)
    x = logits.clone().requires_grad_(True)
    logp = gk.token_logprobs(x, ids, impl=impl, inplace_backward=True)
    total = logp.sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_backward"):
        total.backward()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_empty_batch_gives_zero(loss_type, impl):
    for B, T in ((0, 3), (2, 0)):
        x = torch.randn(B, T, 11, requires_grad=True)
        loss, _ = gk.grpo_loss(x, torch.zeros(B, T, dtype=torch.long), torch.randn(B), loss_type=loss_type,
                               impl=impl)
        loss.backward()
        assert loss.item() == 0.0


@pytest.mark.parametrize("impl", IMPLS)
def test_num_items_in_batch_as_a_one_element_tensor(impl):
    logits, ids, adv, old = _logits_case(seed=5)
    expected, _ = gk.grpo_loss(logits, ids, adv, old_logps=old, num_items_in_batch=7, impl=impl)
    for n in (torch.tensor(7), torch.tensor([7.0])):
        loss, _ = gk.grpo_loss(logits, ids, adv, old_logps=old, num_items_in_batch=n, impl=impl)
        assert loss.shape == () and torch.equal(loss, expected)  # the same division by 7: the same bits
