"""Property-based tests: every public function against the float64 reference, over shapes, dtypes, masks, loss
types and every ``GRPOLossConfig`` option, on both implementations.

Hypothesis draws the structure (shapes, dtype, options, which optional tensors exist, the mask's shape); the
tensor values come from a seeded torch generator, so examples stay cheap and realistic. The profile in
tests/conftest.py makes the runs deterministic (derandomize) and bounded; the Triton (interpreter) variants use
tiny shapes and fewer examples.

Pass rules (docs/numerics.md, "Accuracy against float64"): the three-way rule of tests/support/tolerances.py against
float64 ground truth computed on the same rounded inputs, the middle term being plain PyTorch (the reference code)
in fp32 on those inputs (float64 for float64 inputs), i.e. what ours computes internally, measured on this machine:
- per-token outputs, the loss and the metrics are fp32 for every input dtype: ATOL of fp32, relative to
  max(1, |truth|);
- gradients come back in the input dtype: the middle term's gradient rounded to that dtype, errors relative to
  max |truth|, ATOL of the dtype (for fp16 / bf16 it holds one u of the dtype: what separates ours from the
  middle term where their fp32 values straddle a rounding boundary of the dtype, or where ours rounds to the dtype
  a second time, when it scales by the upstream gradient).
"""
from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo_kernels as gk
from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.reference import logprobs_and_entropy, reference_grpo_loss

from ..support.tolerances import ATOL, K, assert_three_way, max_err, naive_logprobs_entropy

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
VOCABS = [1, 2, 3, 5, 17, 37, 100, 129]          # not powers of two (1 and 2 are the degenerate vocabularies)
EXAMPLES = {"torch": 40, "triton": 15}


def _dtypes(impl):
    names = ["fp32", "bf16", "fp16"] + (["fp64"] if impl == "torch" else [])
    return st.sampled_from(names).map(DTYPES.__getitem__)


def _shapes(impl):
    big = impl == "torch"
    return st.tuples(st.integers(1, 4 if big else 3), st.integers(1, 6 if big else 4),
                     st.sampled_from(VOCABS if big else [1, 5, 37, 130]))


@st.composite
def masks(draw, B, T):
    """ragged lengths (a fully masked row possible), an arbitrary pattern, all valid, all masked, or None."""
    kind = draw(st.sampled_from(["ragged", "pattern", "all-valid", "all-masked", "none"]))
    if kind == "none":
        return None
    if kind == "ragged":
        lengths = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
        return torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    if kind == "pattern":
        bits = draw(st.lists(st.booleans(), min_size=B * T, max_size=B * T))
        return torch.tensor(bits).view(B, T)
    return torch.full((B, T), kind == "all-valid")


@st.composite
def configs(draw):
    """Every option of GRPOLossConfig."""
    loss_type = draw(st.sampled_from(LOSS_TYPES))
    eps_high = draw(st.sampled_from([0.2, 0.28, 1.0, 4.0] if loss_type == "cispo" else [0.2, 0.28]))
    return gk.GRPOLossConfig(
        loss_type=loss_type,
        beta=draw(st.sampled_from([0.0, 0.0, 0.04])),
        epsilon_low=draw(st.sampled_from([0.0, 0.15, 0.2])),
        epsilon_high=eps_high,
        temperature=draw(st.sampled_from([1.0, 0.7, 1.5])),
        use_bias_correction_kl=draw(st.booleans()),
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        delta=draw(st.sampled_from([None, 1.1, 3.0])),
        max_completion_length=draw(st.sampled_from([None, 7])),
        sapo_temperature_pos=draw(st.sampled_from([1.0, 0.8])),
        sapo_temperature_neg=draw(st.sampled_from([1.05, 1.3])),
        vespo_k_pos=draw(st.sampled_from([2.0, 1.0])), vespo_lambda_pos=draw(st.sampled_from([3.0, 1.5])),
        vespo_k_neg=draw(st.sampled_from([3.0, 2.0])), vespo_lambda_neg=draw(st.sampled_from([2.0, 0.5])),
        off_policy_mask_threshold=draw(st.sampled_from([None, None, 0.0, 0.1])),
        top_entropy_quantile=draw(st.sampled_from([1.0, 1.0, 0.5, 0.2])),
        entropy_coef=draw(st.sampled_from([0.0, 0.0, 0.03])),
        deterministic=draw(st.booleans()),
        grad_in_forward=draw(st.booleans()),
        memory_budget=draw(st.sampled_from([None, 1 << 14, 1 << 20])),
    )


@st.composite
def loss_batches(draw, impl):
    """(config, B, T, V, dtype, mask, seed, the optional tensors' kinds)."""
    B, T, V = draw(_shapes(impl))
    return dict(config=draw(configs()), B=B, T=T, V=V, dtype=draw(_dtypes(impl)), mask=draw(masks(B, T)),
                seed=draw(st.integers(0, 2 ** 16)), old=draw(st.booleans()), adv_2d=draw(st.booleans()),
                is_ratio=draw(st.sampled_from([None, "row", "row-1", "token"])),
                sampling=draw(st.booleans()), num_items=draw(st.sampled_from([None, 5, 1])),
                zero_adv=draw(st.booleans()))


def _loss_tensors(spec, logits64):
    """The per-token tensors of a drawn batch (fp32; float64 logits of the policy give realistic log-probs)."""
    B, T, cfg = spec["B"], spec["T"], spec["config"]
    g = torch.Generator().manual_seed(spec["seed"] + 1)
    ids = torch.randint(0, spec["V"], (B, T), generator=g)
    logp = torch.log_softmax(logits64 / cfg.temperature, -1).gather(-1, ids.unsqueeze(-1)).squeeze(-1)
    adv = torch.randn(B, T, generator=g) if spec["adv_2d"] else torch.randn(B, generator=g)
    if spec["zero_adv"]:
        adv[0] = 0.0
    out = {"ids": ids, "advantages": adv, "mask": spec["mask"]}
    if spec["old"]:
        out["old_logps"] = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    if cfg.beta != 0.0:
        out["ref_logps"] = (logp + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    shape = {None: None, "row": (B,), "row-1": (B, 1), "token": (B, T)}[spec["is_ratio"]]
    if shape is not None:
        out["is_ratio"] = torch.rand(shape, generator=g) + 0.5
    if spec["sampling"]:
        out["sampling_logps"] = (logp + 0.2 * torch.randn(B, T, generator=g, dtype=torch.float64)).float()
    if spec["num_items"] is not None:
        out["num_items_in_batch"] = spec["num_items"]
    return out


def _to64(kwargs):
    return {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}


def _mid(dtype):
    """The precision of the middle term: fp32 (ours computes in fp32 for every lower input dtype), float64 for
    float64 inputs (then the middle term is the truth itself and the rule reduces to ATOL[float64])."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_loss(loss, same, truth, dtype, what):
    assert loss.dtype == _mid(dtype), what
    assert_three_way(loss, same, truth, _mid(dtype), f"{what} loss")


def _check_metrics(metrics, same_metrics, truth_metrics, dtype, what):
    assert metrics.keys() == truth_metrics.keys(), what
    for k, v in metrics.items():
        assert_three_way(v, same_metrics[k], truth_metrics[k], _mid(dtype), f"{what}: metric {k}")


def _check_head_grads(leaves, frozen, sames, truths, dtype, what: str) -> None:
    """Gradients of (hidden, weight, bias) against float64 truths; a frozen leaf must get none."""
    for name, leaf, same, truth in zip(("hidden", "weight", "bias"), [t for t in leaves if t is not None], sames,
                                       truths):
        if name in frozen:
            assert leaf.grad is None, f"{what}: frozen {name} got a gradient"
        else:
            _check_grad(leaf.grad, same, truth, dtype, f"{what} d {name}")


def _check_grad(grad, same, truth, dtype, what):
    """Three-way rule, the middle term ``same`` (plain PyTorch in fp32) rounded to ``dtype`` as ours is."""
    assert grad is not None and grad.dtype == dtype, what
    assert torch.isfinite(grad).all(), f"{what}: non-finite gradient"
    scale = truth.abs().max().item() if truth.numel() else 0.0
    if scale == 0.0:
        # An exactly zero truth (e.g. V = 1: p = 1, so onehot - p = 0) may come out as rounding noise when the
        # forward and the backward form the logits with different GEMMs (cuBLAS / tl.dot): bounded absolutely,
        # with the atol of the dtype (the scale floor of 1 of tests/support/tolerances.py).
        worst = grad.abs().max().item() if grad.numel() else 0.0
        assert worst <= ATOL[dtype], f"{what}: the float64 gradient is zero, ours reaches {worst:.3e}"
        return
    e_ours, e_same = max_err(grad, truth) / scale, max_err(same.to(dtype), truth) / scale
    bound = K * e_same + ATOL[dtype]
    assert e_ours <= bound, f"{what}: error {e_ours:.3e} > {K} * {e_same:.3e} + {ATOL[dtype]:.1e} ({dtype})"


# ----------------------------------------------------------------------------------------------------------------
# group_advantages (no impl: plain PyTorch) against a float64 loop over the groups


def _advantages_truth(rewards, group_size, scale, eps, weights, dtype=torch.float64):
    """A loop over the groups with the textbook formulas, in ``dtype``: float64 for the truth, the rewards' own
    dtype for the middle term of the three-way rule."""
    r = rewards.to(dtype)
    if r.dim() == 2:
        w = torch.ones(r.shape[1], dtype=dtype) if weights is None else torch.tensor(weights).to(dtype)
        scored = ~torch.isnan(r).all(1)
        r = torch.where(scored, torch.nansum(r * w, 1), float("nan"))
    out = torch.zeros(r.shape[0], dtype=dtype)
    nan = torch.tensor(float("nan"), dtype=dtype)

    def stats(vals):
        vals = vals[~torch.isnan(vals)]
        n = vals.numel()
        mean = vals.sum() / n if n else nan
        std = torch.sqrt(((vals - mean) ** 2).sum() / (n - 1)) if n > 1 else nan
        return mean, std

    _, batch_std = stats(r)
    for start in range(0, r.shape[0], group_size):
        group = r[start:start + group_size]
        mean, std = stats(group)
        denom = {"group": std + eps, "batch": batch_std + eps, "none": torch.tensor(1.0, dtype=dtype)}[scale]
        out[start:start + group_size] = torch.nan_to_num((group - mean) / denom, nan=0.0)  # IEEE: 0 / 0 is NaN
    return out


@settings(max_examples=60)
@given(groups=st.integers(1, 4), group_size=st.integers(1, 5), n_rewards=st.sampled_from([None, 1, 3]),
       scale=st.sampled_from(["group", "batch", "none"]), eps=st.sampled_from([1e-4, 0.0, 0.5]),
       dtype=st.sampled_from([torch.float32, torch.float64]), seed=st.integers(0, 2 ** 16),
       constant_group=st.booleans(), nan_rewards=st.booleans(), weighted=st.booleans())
def test_group_advantages_property(groups, group_size, n_rewards, scale, eps, dtype, seed, constant_group,
                                   nan_rewards, weighted):
    g = torch.Generator().manual_seed(seed)
    shape = (groups * group_size,) if n_rewards is None else (groups * group_size, n_rewards)
    rewards = torch.randn(shape, generator=g).to(dtype)
    if constant_group:
        rewards[:group_size] = 0.5               # zero group variance: advantages exactly 0
    if nan_rewards:
        rewards[-1] = float("nan")               # an unscorable completion
    weights = [0.5, 2.0, 1.0] if (weighted and n_rewards == 3) else None
    adv = gk.group_advantages(rewards, group_size, scale=scale, eps=eps, weights=weights)
    truth = _advantages_truth(rewards, group_size, scale, eps, weights)
    same = _advantages_truth(rewards, group_size, scale, eps, weights, dtype)
    assert adv.shape == (groups * group_size,) and adv.dtype == dtype
    assert torch.isfinite(adv).all()
    # eps = 0 with a zero-variance group is 0 / 0 -> NaN -> 0 on both sides; otherwise the three-way rule
    assert_three_way(adv, same, truth, dtype, "advantages")
    if constant_group and scale == "group" and not (nan_rewards and groups == 1):
        assert (adv[:group_size] == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# token_logprobs


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_token_logprobs_property(impl):
    @settings(max_examples=EXAMPLES[impl])
    @given(shape=_shapes(impl), dtype=_dtypes(impl), flat=st.booleans(), seed=st.integers(0, 2 ** 16),
           temperature=st.sampled_from([1.0, 0.6, 2.5]), entropy_grad=st.booleans(), inplace=st.booleans(),
           scale=st.sampled_from([1.0, 4.0]))
    def run(shape, dtype, flat, seed, temperature, entropy_grad, inplace, scale):
        B, T, V = shape
        g = torch.Generator().manual_seed(seed)
        lead = (B * T,) if flat else (B, T)
        logits = (torch.randn(*lead, V, generator=g) * scale).to(dtype)
        ids = torch.randint(0, V, lead, generator=g)
        a = torch.randn(lead, generator=g, dtype=torch.float64)
        b = torch.randn(lead, generator=g, dtype=torch.float64) if entropy_grad else torch.zeros(lead).double()

        x64 = logits.to(torch.float64, copy=True).requires_grad_(True)
        t_logp, t_ent = logprobs_and_entropy(x64, ids, temperature)
        (t_grad,) = torch.autograd.grad((a * t_logp + b * t_ent).sum(), x64)
        xs = logits.to(_mid(dtype), copy=True).requires_grad_(True)
        s_logp, s_ent = naive_logprobs_entropy(xs, ids, temperature)
        (s_grad,) = torch.autograd.grad((a.to(_mid(dtype)) * s_logp.to(_mid(dtype))
                                         + b.to(_mid(dtype)) * s_ent.to(_mid(dtype))).sum(), xs)

        x = logits.clone().requires_grad_(True)
        logp, ent = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl, inplace_backward=inplace)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert logp.dtype == ent.dtype == out_dtype and logp.shape == ent.shape == ids.shape
        (a.to(out_dtype) * logp + b.to(out_dtype) * ent).sum().backward()
        for name, ours, same, truth in (("logp", logp, s_logp, t_logp), ("entropy", ent, s_ent, t_ent)):
            assert_three_way(ours, same.detach(), truth.detach(), _mid(dtype), f"{impl} {name}")
        _check_grad(x.grad, s_grad, t_grad, dtype, f"{impl} d logits")
        if inplace:
            assert x.grad.data_ptr() == x.data_ptr()

    run()


# ----------------------------------------------------------------------------------------------------------------
# grpo_loss (and the GRPOLoss module)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_grpo_loss_property(impl):
    @settings(max_examples=EXAMPLES[impl] * 2)
    @given(spec=loss_batches(impl), via_module=st.booleans())
    def run(spec, via_module):
        B, T, V, dtype, cfg = spec["B"], spec["T"], spec["V"], spec["dtype"], spec["config"]
        g = torch.Generator().manual_seed(spec["seed"])
        logits = (torch.randn(B, T, V, generator=g) * 2).to(dtype)
        kwargs = _loss_tensors(spec, logits.double())
        ids, adv, mask = kwargs.pop("ids"), kwargs.pop("advantages"), kwargs.pop("mask")

        x64 = logits.to(torch.float64, copy=True).requires_grad_(True)
        t_loss, t_metrics = reference_grpo_loss(x64, ids, adv.double(), mask, config=cfg, **_to64(kwargs))
        (t_grad,) = torch.autograd.grad(t_loss, x64)
        xs = logits.to(_mid(dtype), copy=True).requires_grad_(True)
        s_loss, s_metrics = reference_grpo_loss(xs, ids, adv.to(_mid(dtype)), mask, config=cfg,
                                                **(_to64(kwargs) if dtype == torch.float64 else kwargs))
        (s_grad,) = torch.autograd.grad(s_loss, xs)

        x = logits.clone().requires_grad_(True)
        if via_module:
            loss, metrics = gk.GRPOLoss(cfg, impl=impl)(x, ids, adv, mask, **kwargs)
        else:
            loss, metrics = gk.grpo_loss(x, ids, adv, mask, config=cfg, impl=impl, **kwargs)
        loss.backward()
        what = f"{impl} {cfg.loss_type} {dtype}"
        _check_loss(loss, s_loss.detach(), t_loss.detach(), dtype, what)
        _check_metrics(metrics, s_metrics, t_metrics, dtype, what)
        _check_grad(x.grad, s_grad, t_grad, dtype, f"{what} d logits")

    run()


# ----------------------------------------------------------------------------------------------------------------
# linear_token_logprobs and fused_linear_grpo_loss (and the FusedLinearGRPOLoss module)


def _head(B, T, V, H, dtype, bias, seed, flat=False):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B * T, H, generator=g) if flat else torch.randn(B, T, H, generator=g)).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def _logits(hidden, weight, bias):
    """Full logits in the leaves' own dtype (plain PyTorch: the truth in float64, the middle term in fp32)."""
    z = hidden @ weight.T
    return z if bias is None else z + bias


def _logits64(hidden, weight, bias):
    return _logits(hidden.double(), weight.double(), None if bias is None else bias.double())


def _leaves(tensors, frozen):
    return [None if t is None else t.clone().requires_grad_(name not in frozen)
            for name, t in zip(("hidden", "weight", "bias"), tensors)]


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_linear_token_logprobs_property(impl):
    @settings(max_examples=EXAMPLES[impl])
    @given(shape=_shapes(impl), H=st.sampled_from([1, 3, 8, 17]), dtype=_dtypes(impl), bias=st.booleans(),
           flat=st.booleans(), seed=st.integers(0, 2 ** 16), temperature=st.sampled_from([1.0, 0.6, 2.5]),
           deterministic=st.booleans(), with_mask=st.booleans(), frozen=st.sampled_from([(), ("weight", "bias")]),
           data=st.data())
    def run(shape, H, dtype, bias, flat, seed, temperature, deterministic, with_mask, frozen, data):
        B, T, V = shape
        tensors = _head(B, T, V, H, dtype, bias, seed, flat)
        g = torch.Generator().manual_seed(seed + 7)
        lead = (B * T,) if flat else (B, T)
        ids = torch.randint(0, V, lead, generator=g)
        mask = data.draw(masks(B, T)) if with_mask else None
        mask = None if mask is None else mask.reshape(lead)
        a = torch.randn(lead, generator=g, dtype=torch.float64)
        b = torch.randn(lead, generator=g, dtype=torch.float64)

        leaves64 = [None if t is None else t.to(torch.float64, copy=True).requires_grad_(True) for t in tensors]
        t_logp, t_ent = logprobs_and_entropy(_logits64(*leaves64), ids, temperature)
        if mask is not None:
            t_logp, t_ent = torch.where(mask, t_logp, 0.0), torch.where(mask, t_ent, 0.0)
        t_grads = torch.autograd.grad((a * t_logp + b * t_ent).sum(), [t for t in leaves64 if t is not None])
        mid = _mid(dtype)
        leaves_s = [None if t is None else t.to(mid, copy=True).requires_grad_(True) for t in tensors]
        s_logp, s_ent = naive_logprobs_entropy(_logits(*leaves_s), ids, temperature)
        s_logp, s_ent = s_logp.to(mid), s_ent.to(mid)
        if mask is not None:
            s_logp, s_ent = torch.where(mask, s_logp, 0.0), torch.where(mask, s_ent, 0.0)
        s_grads = torch.autograd.grad((a.to(mid) * s_logp + b.to(mid) * s_ent).sum(),
                                      [t for t in leaves_s if t is not None])

        leaves = _leaves(tensors, frozen)
        logp, ent = gk.linear_token_logprobs(leaves[0], leaves[1], ids, bias=leaves[2], temperature=temperature,
                                             return_entropy=True, impl=impl, deterministic=deterministic,
                                             mask=mask)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert logp.dtype == out_dtype and logp.shape == ids.shape
        (a.to(out_dtype) * logp + b.to(out_dtype) * ent).sum().backward()
        for name, ours, same, truth in (("logp", logp, s_logp, t_logp), ("entropy", ent, s_ent, t_ent)):
            assert_three_way(ours, same.detach(), truth.detach(), mid, f"{impl} {name}")
        _check_head_grads(leaves, frozen, s_grads, t_grads, dtype, impl)

    run()


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_fused_linear_grpo_loss_property(impl):
    @settings(max_examples=EXAMPLES[impl] * 2)
    @given(spec=loss_batches(impl), H=st.sampled_from([1, 3, 8, 17]), bias=st.booleans(), flat=st.booleans(),
           frozen=st.sampled_from([(), ("weight", "bias")]), via_module=st.booleans())
    def run(spec, H, bias, flat, frozen, via_module):
        B, T, V, dtype, cfg = spec["B"], spec["T"], spec["V"], spec["dtype"], spec["config"]
        tensors = _head(B, T, V, H, dtype, bias, spec["seed"], flat)
        kwargs = _loss_tensors(spec, _logits64(*tensors).view(B, T, V))
        ids, adv, mask = kwargs.pop("ids"), kwargs.pop("advantages"), kwargs.pop("mask")

        leaves64 = [None if t is None else t.to(torch.float64, copy=True).requires_grad_(True) for t in tensors]
        t_loss, t_metrics = reference_grpo_loss(_logits64(*leaves64).view(B, T, V), ids, adv.double(), mask,
                                                config=cfg, **_to64(kwargs))
        t_grads = torch.autograd.grad(t_loss, [t for t in leaves64 if t is not None])
        mid = _mid(dtype)
        leaves_s = [None if t is None else t.to(mid, copy=True).requires_grad_(True) for t in tensors]
        s_loss, s_metrics = reference_grpo_loss(_logits(*leaves_s).view(B, T, V), ids, adv.to(mid), mask,
                                                config=cfg, **(_to64(kwargs) if mid == torch.float64 else kwargs))
        s_grads = torch.autograd.grad(s_loss, [t for t in leaves_s if t is not None])

        leaves = _leaves(tensors, frozen)
        if via_module:
            loss, metrics = gk.FusedLinearGRPOLoss(cfg, impl=impl)(
                leaves[0], leaves[1], ids, advantages=adv, mask=mask, bias=leaves[2], **kwargs)
        else:
            loss, metrics = gk.fused_linear_grpo_loss(leaves[0], leaves[1], ids, adv, mask, bias=leaves[2],
                                                      config=cfg, impl=impl, **kwargs)
        loss.backward()
        what = f"{impl} {cfg.loss_type} {dtype}"
        _check_loss(loss, s_loss.detach(), t_loss.detach(), dtype, what)
        _check_metrics(metrics, s_metrics, t_metrics, dtype, what)
        _check_head_grads(leaves, frozen, s_grads, t_grads, dtype, what)

    run()
