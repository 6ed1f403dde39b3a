"""Property-based tests: every public function against the float64 reference, over shapes, dtypes, masks, loss
types and every ``GRPOLossConfig`` option, on both implementations.

Hypothesis draws the structure (shapes, dtype, options, which optional tensors exist, the mask's shape); the
tensor values come from a seeded torch generator, so examples stay cheap and realistic. The profile in
tests/conftest.py makes the runs deterministic (derandomize) and bounded; the Triton (interpreter) variants use
tiny shapes and fewer examples.

Pass rules (docs/numerics.md, "Accuracy against float64"), against float64 ground truth computed on the same rounded inputs:
- per-token outputs and the loss are fp32 for every input dtype: ``|ours - truth| <= LOSS_RTOL * max(1, |truth|)``;
- gradients come back in the input dtype: ``err(ours) <= K * err(truth rounded to the dtype) + ATOL[dtype]``,
  errors relative to max |truth| (the three-way rule of tests/support/tolerances.py with the best possible result in
  that dtype as the middle term).
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import grpo_kernels as gk
from grpo_kernels.config import LOSS_TYPES
from grpo_kernels.reference import logprobs_and_entropy, reference_grpo_loss

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "fp64": torch.float64}
K = 2.0
GRAD_ATOL = {torch.float32: 2e-5, torch.float16: 5e-4, torch.bfloat16: 4e-3, torch.float64: 1e-10}
# fp32 accumulation on already-rounded inputs, whatever the input dtype (fp64 inputs stay fp64 on the torch path)
LOSS_RTOL = {torch.float32: 2e-5, torch.float16: 2e-5, torch.bfloat16: 2e-5, torch.float64: 1e-10}
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


def _check_loss(loss, truth, dtype, what):
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    tol = LOSS_RTOL[dtype] * max(1.0, abs(truth.item()))
    assert abs(loss.item() - truth.item()) <= tol, f"{what}: {loss.item()!r} vs float64 {truth.item()!r}"


def _check_metrics(metrics, truth_metrics, what):
    assert metrics.keys() == truth_metrics.keys(), what
    for k, v in metrics.items():
        t = truth_metrics[k].item()
        assert abs(v.item() - t) <= 1e-4 * max(1.0, abs(t)), f"{what}: metric {k} {v.item()!r} vs {t!r}"


def _check_head_grads(leaves, frozen, truths, dtype, what: str) -> None:
    """Gradients of (hidden, weight, bias) against float64 truths; a frozen leaf must get none."""
    for name, leaf, truth in zip(("hidden", "weight", "bias"), [t for t in leaves if t is not None], truths):
        if name in frozen:
            assert leaf.grad is None, f"{what}: frozen {name} got a gradient"
        else:
            _check_grad(leaf.grad, truth, dtype, f"{what} d {name}")


def _check_grad(grad, truth, dtype, what):
    """Three-way rule with the best possible result in ``dtype`` (truth rounded) as the middle term."""
    assert grad is not None and grad.dtype == dtype, what
    assert torch.isfinite(grad).all(), f"{what}: non-finite gradient"
    scale = truth.abs().max().item() if truth.numel() else 0.0
    if scale == 0.0:
        # An exactly zero truth (e.g. V = 1: p = 1, so onehot - p = 0) may come out as rounding noise when the
        # forward and the backward form the logits with different GEMMs (cuBLAS / tl.dot): bounded absolutely,
        # with the atol of the dtype (the scale floor of 1 of tests/support/tolerances.py).
        worst = grad.abs().max().item() if grad.numel() else 0.0
        assert worst <= GRAD_ATOL[dtype], f"{what}: the float64 gradient is zero, ours reaches {worst:.3e}"
        return
    err = (grad.double() - truth).abs().max().item() / scale
    rounding = (truth.to(dtype).double() - truth).abs().max().item() / scale
    bound = K * rounding + GRAD_ATOL[dtype]
    assert err <= bound, f"{what}: error {err:.3e} > {K} * {rounding:.3e} + {GRAD_ATOL[dtype]:.0e} ({dtype})"


# ----------------------------------------------------------------------------------------------------------------
# group_advantages (no impl: plain PyTorch) against a float64 loop over the groups


def _advantages_truth(rewards, group_size, scale, eps, weights):
    r = rewards.double()
    if r.dim() == 2:
        w = torch.ones(r.shape[1], dtype=torch.float64) if weights is None else torch.tensor(weights).double()
        scored = ~torch.isnan(r).all(1)
        r = torch.where(scored, torch.nansum(r * w, 1), float("nan"))
    out = torch.zeros(r.shape[0], dtype=torch.float64)

    def stats(vals):
        vals = [v for v in vals.tolist() if not math.isnan(v)]
        mean = sum(vals) / len(vals) if vals else float("nan")
        std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else float("nan")
        return mean, std

    _, batch_std = stats(r)
    for start in range(0, r.shape[0], group_size):
        group = r[start:start + group_size]
        mean, std = stats(group)
        denom = {"group": std + eps, "batch": batch_std + eps, "none": 1.0}[scale]
        for i, v in enumerate(group.tolist()):
            a = (torch.tensor(v - mean, dtype=torch.float64) / denom).item()  # IEEE: 0 / 0 is NaN, -> 0
            out[start + i] = 0.0 if math.isnan(a) else a
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
    assert adv.shape == (groups * group_size,) and adv.dtype == dtype
    assert torch.isfinite(adv).all()
    # eps = 0 with a zero-variance group is 0 / 0 -> NaN -> 0 on both sides; otherwise relative agreement
    rtol = 1e-5 if dtype == torch.float32 else 1e-10
    assert torch.allclose(adv.double(), truth, rtol=rtol, atol=rtol * max(1.0, truth.abs().max().item()))
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

        x = logits.clone().requires_grad_(True)
        logp, ent = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl, inplace_backward=inplace)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert logp.dtype == ent.dtype == out_dtype and logp.shape == ent.shape == ids.shape
        (a.to(out_dtype) * logp + b.to(out_dtype) * ent).sum().backward()
        for name, ours, truth in (("logp", logp, t_logp), ("entropy", ent, t_ent)):
            err = (ours.double() - truth.detach()).abs().max().item()
            assert err <= LOSS_RTOL[dtype] * max(1.0, truth.abs().max().item()), f"{impl} {name}: {err:.3e}"
        _check_grad(x.grad, t_grad, dtype, f"{impl} d logits")
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

        x = logits.clone().requires_grad_(True)
        if via_module:
            loss, metrics = gk.GRPOLoss(cfg, impl=impl)(x, ids, adv, mask, **kwargs)
        else:
            loss, metrics = gk.grpo_loss(x, ids, adv, mask, config=cfg, impl=impl, **kwargs)
        loss.backward()
        what = f"{impl} {cfg.loss_type} {dtype}"
        _check_loss(loss, t_loss, dtype, what)
        _check_metrics(metrics, t_metrics, what)
        _check_grad(x.grad, t_grad, dtype, f"{what} d logits")

    run()


# ----------------------------------------------------------------------------------------------------------------
# linear_token_logprobs and fused_linear_grpo_loss (and the FusedLinearGRPOLoss module)


def _head(B, T, V, H, dtype, bias, seed, flat=False):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(B * T, H, generator=g) if flat else torch.randn(B, T, H, generator=g)).to(dtype)
    weight = (torch.randn(V, H, generator=g) * 2 / H ** 0.5).to(dtype)
    b = (torch.randn(V, generator=g) * 0.5).to(dtype) if bias else None
    return hidden, weight, b


def _logits64(hidden, weight, bias):
    z = hidden.double() @ weight.double().T
    return z if bias is None else z + bias.double()


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

        leaves = _leaves(tensors, frozen)
        logp, ent = gk.linear_token_logprobs(leaves[0], leaves[1], ids, bias=leaves[2], temperature=temperature,
                                             return_entropy=True, impl=impl, deterministic=deterministic,
                                             mask=mask)
        out_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        assert logp.dtype == out_dtype and logp.shape == ids.shape
        (a.to(out_dtype) * logp + b.to(out_dtype) * ent).sum().backward()
        for name, ours, truth in (("logp", logp, t_logp), ("entropy", ent, t_ent)):
            err = (ours.double() - truth.detach()).abs().max().item()
            assert err <= 1e-4 * max(1.0, truth.abs().max().item()), f"{impl} {name}: {err:.3e}"
        _check_head_grads(leaves, frozen, t_grads, dtype, impl)

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

        leaves = _leaves(tensors, frozen)
        if via_module:
            loss, metrics = gk.FusedLinearGRPOLoss(cfg, impl=impl)(
                leaves[0], leaves[1], ids, advantages=adv, mask=mask, bias=leaves[2], **kwargs)
        else:
            loss, metrics = gk.fused_linear_grpo_loss(leaves[0], leaves[1], ids, adv, mask, bias=leaves[2],
                                                      config=cfg, impl=impl, **kwargs)
        loss.backward()
        what = f"{impl} {cfg.loss_type} {dtype}"
        _check_loss(loss, t_loss, dtype, what)
        _check_metrics(metrics, t_metrics, what)
        _check_head_grads(leaves, frozen, t_grads, dtype, what)

    run()
