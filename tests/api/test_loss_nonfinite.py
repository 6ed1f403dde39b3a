"""Non-finite inputs: a NaN or an Inf at a valid position is never hidden; at a padded position it is neutral.

Contract (docs/numerics.md, "Non-finite inputs"):
- NaN at a valid position of logits, hidden, weight, bias, old / ref log-probs, advantages or is_ratio makes the
  loss NaN, on every path (logits and fused-linear, torch and Triton), on-policy (no ``old_logps``) included.
- +-Inf at a valid position gives a non-finite loss whenever the float64 reference formula does (IEEE arithmetic
  of DESIGN.md section 2); where the formula itself bounds it (an infinite old log-prob is a ratio of 0 or inf,
  which PPO clipping can cap), the loss is the reference's finite value.
- A non-finite value at a padded position (mask 0, or a fully masked row for (B,) tensors) changes nothing: the
  loss and the gradients are those of the same batch with a finite value there, and padded positions get zero
  gradient.
The Triton variants run under TRITON_INTERPRET=1 on CPU (tests/conftest.py).
"""
from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.reference import reference_grpo_loss

from ..support.tolerances import assert_three_way

# NaN / Inf inputs make numpy (under the interpreter) and torch warn about invalid values: expected here.
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")
IMPLS = ["torch", "triton"]
B, T, V, H = 4, 4, 37, 8
VALID = (1, 1)        # a valid token
PADDED = (0, 3)       # a padded token of a ragged row
EMPTY_ROW = 3         # a fully masked row


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H ** 0.5
    bias = torch.randn(V, generator=g) * 0.1
    logits = (hidden @ weight.T + bias) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2:] = False
    mask[2, 3:] = False
    mask[EMPTY_ROW] = False
    logp = torch.log_softmax(logits.double(), -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    return {
        "logits": logits, "hidden": hidden, "weight": weight, "bias": bias, "ids": ids, "mask": mask,
        "advantages": torch.randn(B, generator=g),
        "advantages_2d": torch.randn(B, T, generator=g),
        "old_logps": (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
        "ref_logps": (logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)).float(),
        "is_ratio": torch.rand(B, T, generator=g) + 0.5,
        "is_ratio_row": torch.rand(B, generator=g) + 0.5,
    }


# Which tensor is poisoned, and how the call is built around it. path: "logits" or "linear" (fused head).
# on_policy: no old_logps (TRL's default with one iteration per rollout, the case that once hid NaN).
POISONS = {
    "logits-on-policy": dict(path="logits", tensor="logits", on_policy=True),
    "logits-off-policy": dict(path="logits", tensor="logits", on_policy=False),
    "hidden-on-policy": dict(path="linear", tensor="hidden", on_policy=True),
    "weight-on-policy": dict(path="linear", tensor="weight", on_policy=True),
    "bias-on-policy": dict(path="linear", tensor="bias", on_policy=True),
    "hidden-off-policy": dict(path="linear", tensor="hidden", on_policy=False),
    "old_logps": dict(path="logits", tensor="old_logps", on_policy=False),
    "ref_logps": dict(path="logits", tensor="ref_logps", on_policy=True),
    "advantages-row": dict(path="logits", tensor="advantages", on_policy=True),
    "advantages-token": dict(path="logits", tensor="advantages_2d", on_policy=True),
    "is_ratio-token": dict(path="logits", tensor="is_ratio", on_policy=True),
    "is_ratio-row": dict(path="logits", tensor="is_ratio_row", on_policy=True),
}


def _poison(batch, tensor, position, value):
    """A copy of ``batch`` with ``value`` written into ``tensor`` at the (b, t) ``position`` (whole rows for
    (B,) tensors; the target token's logit and one more entry for logits; one feature for hidden)."""
    out = dict(batch)
    x = batch[tensor].clone()
    b, t = position
    if tensor == "logits":
        x[b, t, batch["ids"][b, t]] = value
        x[b, t, 0] = value
    elif tensor == "hidden":
        x[b, t, 0] = value
    elif tensor == "weight":
        x[batch["ids"][b, t], 0] = value  # every token's logsumexp reads this row
    elif tensor == "bias":
        x[batch["ids"][b, t]] = value
    elif x.dim() == 1:
        x[b] = value
    else:
        x[b, t] = value
    out[tensor] = x
    return out


def _call(batch, poison, impl, config, grad=True):
    """Run the loss path of ``poison`` on ``batch``: (loss, metrics, {name: grad})."""
    spec = POISONS[poison]
    kwargs = dict(mask=batch["mask"], config=config, impl=impl)
    kwargs["advantages"] = batch["advantages_2d"] if spec["tensor"] == "advantages_2d" else batch["advantages"]
    if not spec["on_policy"]:
        kwargs["old_logps"] = batch["old_logps"]
    if spec["tensor"] == "ref_logps":
        kwargs["ref_logps"] = batch["ref_logps"]
    if spec["tensor"].startswith("is_ratio"):
        kwargs["is_ratio"] = batch[spec["tensor"]]
    if spec["path"] == "logits":
        leaves = {"logits": batch["logits"].clone().requires_grad_(grad)}
        loss, metrics = gk.grpo_loss(leaves["logits"], batch["ids"], **kwargs)
    else:
        leaves = {k: batch[k].clone().requires_grad_(grad) for k in ("hidden", "weight", "bias")}
        loss, metrics = gk.fused_linear_grpo_loss(leaves["hidden"], leaves["weight"], batch["ids"],
                                                  bias=leaves["bias"], **kwargs)
    grads = {}
    if grad:
        loss.backward()
        grads = {k: v.grad for k, v in leaves.items()}
    return loss.detach(), metrics, grads


def _config(loss_type, poison, **extra):
    beta = 0.04 if POISONS[poison]["tensor"] == "ref_logps" else 0.0
    return gk.GRPOLossConfig(loss_type=loss_type, beta=beta, **extra)


def _reference(batch, poison, config, dtype=torch.float64):
    """The reference loss on the same inputs in ``dtype`` (logits formed in ``dtype`` for the fused path): the
    float64 truth, or in fp32 the middle term of the three-way rule."""
    spec = POISONS[poison]
    if spec["path"] == "logits":
        logits = batch["logits"].to(dtype)
    else:
        logits = batch["hidden"].to(dtype) @ batch["weight"].to(dtype).T + batch["bias"].to(dtype)
    kwargs = {"old_logps": None if spec["on_policy"] else batch["old_logps"].to(dtype),
              "ref_logps": batch["ref_logps"].to(dtype) if spec["tensor"] == "ref_logps" else None,
              "is_ratio": batch[spec["tensor"]].to(dtype) if spec["tensor"].startswith("is_ratio") else None}
    adv = batch["advantages_2d"] if spec["tensor"] == "advantages_2d" else batch["advantages"]
    loss, _ = reference_grpo_loss(logits, batch["ids"], adv.to(dtype), batch["mask"], config=config, **kwargs)
    return loss


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_at_a_valid_position_makes_the_loss_nan(impl, loss_type, poison):
    batch = _poison(_batch(), POISONS[poison]["tensor"], VALID, float("nan"))
    loss, _, _ = _call(batch, poison, impl, _config(loss_type, poison), grad=False)
    assert torch.isnan(loss), f"{impl} {loss_type}: NaN in {poison} at a valid position gave loss {loss.item()}"


# Every option that changes the loss stage, with NaN in the inputs that every configuration reads.
OPTIONS = {
    "sequence-level": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "delta": dict(loss_type="grpo", delta=1.1),
    "top-entropy": dict(loss_type="dapo", top_entropy_quantile=0.5),
    "off-policy-mask": dict(loss_type="grpo", off_policy_mask_threshold=0.0),
    "entropy-bonus": dict(loss_type="bnpo", entropy_coef=0.05),
    "kl-no-bias-correction": dict(loss_type="dapo", use_bias_correction_kl=False),
    "temperature": dict(loss_type="dr_grpo", temperature=0.7, max_completion_length=9),
    "cispo-eps": dict(loss_type="cispo", epsilon_high=5.0),
    "no-grad-in-forward": dict(loss_type="grpo", grad_in_forward=False),
}


@pytest.mark.parametrize("poison", ["logits-on-policy", "hidden-on-policy", "old_logps"])
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("impl", IMPLS)
def test_nan_at_a_valid_position_with_every_option(impl, option, poison):
    overrides = dict(OPTIONS[option])
    loss_type = overrides.pop("loss_type")
    batch = _poison(_batch(1), POISONS[poison]["tensor"], VALID, float("nan"))
    loss, _, _ = _call(batch, poison, impl, _config(loss_type, poison, **overrides), grad=False)
    assert torch.isnan(loss), f"{impl} {option}: NaN in {poison} at a valid position gave loss {loss.item()}"


def _kind(x: torch.Tensor) -> str:
    v = x.item()
    return "finite" if math.isfinite(v) else "non-finite"


@pytest.mark.parametrize("poison", ["logits-on-policy", "logits-off-policy", "hidden-on-policy", "weight-on-policy",
                                    "old_logps", "ref_logps", "advantages-row", "advantages-token",
                                    "is_ratio-token"])
@pytest.mark.parametrize("loss_type", ["grpo", "sapo", "vespo"])
@pytest.mark.parametrize("impl", IMPLS)
def test_inf_at_a_valid_position_follows_the_float64_reference(impl, loss_type, poison):
    """Non-finite exactly when the float64 reference is; otherwise the reference's value (a clipped ratio)."""
    for sign in ("+inf", "-inf"):
        batch = _poison(_batch(2), POISONS[poison]["tensor"], VALID, float(sign))
        cfg = _config(loss_type, poison)
        loss, _, _ = _call(batch, poison, impl, cfg, grad=False)
        truth = _reference(batch, poison, cfg)
        assert _kind(loss) == _kind(truth), f"{impl} {sign}: loss {loss.item()}, float64 reference {truth.item()}"
        if _kind(truth) == "finite":
            same = _reference(batch, poison, cfg, torch.float32)
            assert_three_way(loss, same, truth, torch.float32, f"{impl} {sign}")


def test_inf_in_logits_and_advantages_is_never_finite():
    """The cases the contract names, pinned on the reference itself (so that the rule above cannot go vacuous)."""
    for poison in ("logits-on-policy", "hidden-on-policy", "weight-on-policy", "advantages-row", "is_ratio-token"):
        for loss_type in LOSS_TYPES:
            batch = _poison(_batch(2), POISONS[poison]["tensor"], VALID, float("inf"))
            cfg = _config(loss_type, poison)
            if poison == "is_ratio-token" and loss_type == "vespo":
                continue  # vespo clamps log(is_ratio) to [log 1e-8, 20] inside its gamma weights, as TRL does
            assert not torch.isfinite(_reference(batch, poison, cfg)), (poison, loss_type)


# Padded positions: (tensor, position). (B,) tensors are poisoned on the fully masked row.
PADDED_POISONS = {
    "logits-on-policy": PADDED, "logits-off-policy": PADDED, "hidden-on-policy": PADDED,
    "old_logps": PADDED, "ref_logps": PADDED, "advantages-row": (EMPTY_ROW, 0), "advantages-token": PADDED,
    "is_ratio-token": PADDED, "is_ratio-row": (EMPTY_ROW, 0),
}
PADDED_CONFIGS = {
    "grpo": dict(loss_type="grpo"),
    "dapo-sequence": dict(loss_type="dapo", importance_sampling_level="sequence"),
    "bnpo-entropy": dict(loss_type="bnpo", entropy_coef=0.05, top_entropy_quantile=0.7),
    "vespo": dict(loss_type="vespo"),
}


# vespo folds is_ratio of every position into its gamma weights, as TRL's get_gamma_weights does: padded is_ratio
# entries are inputs there, not padding (docs/numerics.md, "Non-finite inputs"), so that pair is not a padding case.
# The Triton paths run the same reference stage for vespo as for dapo-sequence: vespo runs on torch only here.
PADDED_CASES = [(i, c, p) for i in IMPLS for c in PADDED_CONFIGS for p in PADDED_POISONS
                if not (c == "vespo" and (p.startswith("is_ratio") or i == "triton"))]


@pytest.mark.parametrize(("impl", "config", "poison"), PADDED_CASES, ids=["-".join(c) for c in PADDED_CASES])
def test_non_finite_at_a_padded_position_is_neutral(impl, config, poison):
    """Same loss and gradients as with a finite value there; zero gradient at the padded position."""
    overrides = dict(PADDED_CONFIGS[config])
    loss_type = overrides.pop("loss_type")
    cfg = _config(loss_type, poison, **overrides)
    clean = _batch(3)
    position = PADDED_POISONS[poison]
    assert not clean["mask"][position], "the poisoned position must be padded"
    loss0, metrics0, grads0 = _call(clean, poison, impl, cfg)
    for value in ("nan", "inf", "-inf"):
        dirty = _poison(clean, POISONS[poison]["tensor"], position, float(value))
        loss1, metrics1, grads1 = _call(dirty, poison, impl, cfg)
        what = f"padded {value} in {poison}"
        # A padded position is never read into a sum (masked before every reduction, padded rows skipped): the
        # same code on the same valid inputs, so the same bits (no tolerance).
        assert torch.isfinite(loss1), f"{what} gave loss {loss1.item()}"
        assert torch.equal(loss1, loss0), (what, loss1.item(), loss0.item())
        for name, m in metrics1.items():
            assert torch.isfinite(m), f"{what}: metric {name} = {m.item()}"
            assert torch.equal(m, metrics0[name]), (what, name)
        for name, g in grads1.items():
            assert torch.isfinite(g).all(), f"{what}: non-finite d {name}"
            assert torch.equal(g, grads0[name]), f"{what}: d {name} changed"
            if name in ("logits", "hidden"):
                assert (g[position] == 0).all(), f"{what}: the padded position got a d {name}"


@pytest.mark.parametrize("impl", IMPLS)
def test_token_logprobs_nan_stays_in_its_token(impl):
    """NaN in one token's logits (or hidden row) poisons that token only; NaN in a weight row poisons every
    token (every logsumexp reads it)."""
    batch = _batch(4)
    logits = _poison(batch, "logits", VALID, float("nan"))["logits"]
    logp, ent = gk.token_logprobs(logits, batch["ids"], return_entropy=True, impl=impl)
    clean_logp, clean_ent = gk.token_logprobs(batch["logits"], batch["ids"], return_entropy=True, impl=impl)
    bad = torch.zeros(B, T, dtype=torch.bool)
    bad[VALID] = True
    assert torch.isnan(logp[bad]).all() and torch.isnan(ent[bad]).all()
    assert torch.equal(logp[~bad], clean_logp[~bad]) and torch.equal(ent[~bad], clean_ent[~bad])

    hidden = _poison(batch, "hidden", VALID, float("nan"))["hidden"]
    logp = gk.linear_token_logprobs(hidden, batch["weight"], batch["ids"], bias=batch["bias"], impl=impl)
    clean = gk.linear_token_logprobs(batch["hidden"], batch["weight"], batch["ids"], bias=batch["bias"], impl=impl)
    assert torch.isnan(logp[bad]).all()
    assert torch.equal(logp[~bad], clean[~bad])  # each token's logits are its own row's products: the same bits

    weight = _poison(batch, "weight", VALID, float("nan"))["weight"]
    logp = gk.linear_token_logprobs(batch["hidden"], weight, batch["ids"], impl=impl)
    assert torch.isnan(logp).all()
