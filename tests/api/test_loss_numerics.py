"""Numerical edge cases, limits, determinism and input integrity (docs/numerics.md).

Every comparison is against the float64 reference (grpo_kernels.reference) on the same rounded inputs; the Triton
variants run under TRITON_INTERPRET=1 on CPU (tests/conftest.py) at small shapes.
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import CLIPPED_LOSS_TYPES, LOSS_TYPES
from grpo_kernels.reference import logprobs_and_entropy, reference_grpo_loss

from ..support.heads import assert_head_three_way, head_same_dtype, linear_truth
from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy, token_truth_and_same_dtype

IMPLS = ["torch", "triton"]


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _token_logprobs_vs_float64(logits, ids, temperature, impl):
    """logp, entropy and d(sum logp + 0.5 * sum entropy)/d logits against float64 by the three-way rule, d logits
    relative to its own largest value (at temperature 1e3 it is ~1e-3). Where plain PyTorch in the logits' dtype
    overflows (fp16 logits / 0.5 beyond 65504), the middle term is plain PyTorch in fp32 on the upcast logits (what
    ours does), its d logits rounded to the logits' dtype."""
    ones, halves = torch.ones(ids.shape), torch.full(ids.shape, 0.5)
    truth, naive = token_truth_and_same_dtype(logits, ids, temperature, ones, halves)
    if not all(torch.isfinite(n).all() for n in naive):
        _, (n_logp, n_ent, n_grad) = token_truth_and_same_dtype(logits.float(), ids, temperature, ones, halves)
        naive = (n_logp, n_ent, n_grad.to(logits.dtype))
    x = logits.clone().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl)
    (logp + 0.5 * ent).sum().backward()
    for name, o, n, t in zip(("logp", "entropy", "d logits"), (logp, ent, x.grad), naive, truth):
        assert_three_way(o, n, t, logits.dtype, f"{impl} {name}", scale=grad_scale(t) if name == "d logits" else None)
    return x.grad


def _loss_vs_float64(logits, ids, adv, mask, impl, **kwargs):
    """grpo_loss against reference_grpo_loss in float64: loss, metrics and d logits."""
    cfg = kwargs.pop("config", None) or gk.GRPOLossConfig(**kwargs.pop("overrides", {}))
    x64 = logits.to(torch.float64, copy=True).requires_grad_(True)
    to64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kwargs.items()}
    t_loss, t_metrics = reference_grpo_loss(x64, ids, adv.double(), mask, config=cfg, **to64)
    (t_grad,) = torch.autograd.grad(t_loss, x64)
    x = logits.clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, ids, adv, mask, config=cfg, impl=impl, **kwargs)
    loss.backward()
    what = f"{impl} {cfg.loss_type}"
    # three-way: the reference in the input precision (fp32 log-probs) is the middle term; at tiny temperatures
    # |log p| ~ |logits| / tau and fp32 rounding of log p moves the ratios by ~1e-4, for every implementation
    xs = logits.clone().requires_grad_(True)
    same, same_metrics = reference_grpo_loss(xs, ids, adv, mask, config=cfg, **kwargs)
    (same_grad,) = torch.autograd.grad(same, xs)
    assert_three_way(loss.detach(), same.detach(), t_loss.detach(), torch.float32, f"{what} loss")
    for k, v in metrics.items():
        assert_three_way(v, same_metrics[k], t_metrics[k], torch.float32, f"{what} metric {k}")
    assert_three_way(x.grad, same_grad, t_grad, torch.float32, f"{what} d logits", scale=grad_scale(t_grad))
    return loss.detach(), x.grad


# ---------------------------------------------------------------------------------------------------- magnitudes


@pytest.mark.parametrize("impl", IMPLS)
def test_logits_of_magnitude_1e4(impl):
    g = _gen(0)
    logits = torch.randn(2, 3, 37, generator=g) * 1e4
    ids = torch.randint(0, 37, (2, 3), generator=g)
    _token_logprobs_vs_float64(logits, ids, 1.0, impl)
    old = torch.randn(2, 3, generator=g) - 5e3
    _loss_vs_float64(logits, ids, torch.randn(2, generator=g), None, impl, old_logps=old,
                     overrides=dict(loss_type="grpo"))


@pytest.mark.parametrize("impl", IMPLS)
def test_banned_tokens_minus_inf(impl):
    """-inf logits (banned tokens) have probability 0: finite entropy, log-prob and loss, zero gradient there; a row
    whose only finite logit is the sampled token has log-prob 0 and entropy 0."""
    g = _gen(1)
    logits = torch.randn(2, 3, 41, generator=g)
    ids = torch.randint(20, 41, (2, 3), generator=g)
    logits[:, :, :20] = float("-inf")
    logits[1, 2] = float("-inf")
    logits[1, 2, ids[1, 2]] = 3.0
    grad = _token_logprobs_vs_float64(logits, ids, 0.8, impl)
    assert (grad[:, :, :20] == 0).all() and (grad[1, 2] == 0).all()
    logp, ent = gk.token_logprobs(logits, ids, return_entropy=True, impl=impl)
    assert logp[1, 2] == 0 and ent[1, 2] == 0
    ref = torch.randn(2, 3, generator=g) - 3
    _, grad = _loss_vs_float64(logits, ids, torch.tensor([1.0, -0.5]), None, impl, ref_logps=ref,
                               overrides=dict(loss_type="grpo", beta=0.04, entropy_coef=0.05,
                                              top_entropy_quantile=0.5))
    assert (grad[:, :, :20] == 0).all()


@pytest.mark.parametrize("temperature", [1e-3, 1e3], ids=["tau-1e-3", "tau-1e3"])
@pytest.mark.parametrize("impl", IMPLS)
def test_temperature_near_zero_and_large(impl, temperature):
    g = _gen(2)
    logits = torch.randn(3, 2, 53, generator=g) * 2
    ids = torch.randint(0, 53, (3, 2), generator=g)
    _token_logprobs_vs_float64(logits, ids, temperature, impl)
    logp = logprobs_and_entropy(logits.double(), ids, temperature)[0]
    old = (logp + 0.1 * torch.randn(3, 2, generator=g, dtype=torch.float64)).float()
    _loss_vs_float64(logits, ids, torch.randn(3, generator=g), None, impl, old_logps=old,
                     overrides=dict(loss_type="dapo", temperature=temperature))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16_near_overflow(impl):
    """fp16 logits near 65504 with temperature 0.5 (z beyond the fp16 range): ours upcasts before dividing."""
    g = _gen(3)
    logits = (torch.rand(2, 3, 29, generator=g) * 2 - 1).mul(6e4).to(torch.float16)
    ids = torch.randint(0, 29, (2, 3), generator=g)
    _token_logprobs_vs_float64(logits, ids, 0.5, impl)
    # the fused head in fp16 whose logits (~1.6e5) do not fit in fp16: the tiles are fp32
    hidden = torch.full((2, 3, 16), 100.0, dtype=torch.float16) * (torch.rand(2, 3, 16, generator=g) + 0.5).half()
    weight = (torch.rand(29, 16, generator=g) * 100).half()
    logp, ent = gk.linear_token_logprobs(hidden, weight, ids, return_entropy=True, impl=impl)
    t_logp, t_ent = logprobs_and_entropy(hidden.double() @ weight.double().T, ids)
    n_logp, n_ent = naive_logprobs_entropy(hidden.float() @ weight.float().T, ids, 1.0)  # plain fp32 tiles
    assert_three_way(logp, n_logp, t_logp, torch.float32, f"{impl} head logp")
    assert_three_way(ent, n_ent, t_ent, torch.float32, f"{impl} head entropy")


# ----------------------------------------------------------------------------------------------------- loss edges


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_ratios_far_outside_the_clip_range(impl, loss_type):
    """log ratios of +-30 (ratios e^+-30): the reference's value, and zero gradient where the clip is active."""
    g = _gen(4)
    B, T, V = 3, 4, 23
    logits = torch.randn(B, T, V, generator=g)
    ids = torch.randint(0, V, (B, T), generator=g)
    logp = logprobs_and_entropy(logits.double(), ids)[0]
    sign = torch.where(torch.rand(B, T, generator=g) < 0.5, -1.0, 1.0).double()
    old = (logp - 30 * sign).float()
    adv = torch.tensor([1.0, -1.0, 0.5])
    _, grad = _loss_vs_float64(logits, ids, adv, None, impl, old_logps=old, overrides=dict(loss_type=loss_type))
    if loss_type in CLIPPED_LOSS_TYPES:
        clipped = ((sign > 0) & (adv[:, None] > 0)) | ((sign < 0) & (adv[:, None] < 0))
        assert clipped.any() and (grad[clipped] == 0).all()


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_zero_advantages(impl, loss_type):
    """A = 0 everywhere: the policy term is exactly 0 (loss and gradient), only the KL term is left."""
    g = _gen(5)
    logits = torch.randn(2, 3, 19, generator=g)
    ids = torch.randint(0, 19, (2, 3), generator=g)
    old = torch.randn(2, 3, generator=g) - 3
    x = logits.clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, ids, torch.zeros(2), old_logps=old, loss_type=loss_type, impl=impl)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
    ref = torch.randn(2, 3, generator=g) - 3
    _loss_vs_float64(logits, ids, torch.zeros(2, 3), None, impl, old_logps=old, ref_logps=ref,
                     overrides=dict(loss_type=loss_type, beta=0.1))


def test_zero_group_variance():
    """Equal rewards in a group give advantages of exactly 0 with every scale; so do groups of one and
    unscorable (all-NaN) completions."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 2.0, 4.0])
    for scale in ("group", "batch", "none"):
        adv = gk.group_advantages(rewards, 3, scale=scale)
        assert (adv[:3] == 0).all() and torch.isfinite(adv).all(), scale
    assert (gk.group_advantages(torch.full((4,), 0.3), 2, scale="batch") == 0).all()
    assert (gk.group_advantages(torch.full((4,), 0.3), 4, eps=0.0) == 0).all()  # 0 / 0 -> 0, not NaN
    assert (gk.group_advantages(torch.randn(5), 1) == 0).all()
    multi = torch.tensor([[float("nan"), float("nan")], [1.0, 2.0], [0.0, 1.0], [3.0, float("nan")]])
    adv = gk.group_advantages(multi, 2)
    assert adv[0] == 0 and torch.isfinite(adv).all()


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_rows_of_length_one(impl, loss_type, level):
    g = _gen(6)
    logits = torch.randn(3, 1, 31, generator=g)
    ids = torch.randint(0, 31, (3, 1), generator=g)
    old = logprobs_and_entropy(logits.double(), ids)[0].float() + 0.3 * torch.randn(3, 1, generator=g)
    _loss_vs_float64(logits, ids, torch.randn(3, generator=g), None, impl, old_logps=old,
                     overrides=dict(loss_type=loss_type, importance_sampling_level=level))
    # length-1 rows inside a longer T
    logits = torch.randn(3, 4, 31, generator=g)
    ids = torch.randint(0, 31, (3, 4), generator=g)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[:, 0] = True
    _loss_vs_float64(logits, ids, torch.randn(3, generator=g), mask, impl,
                     overrides=dict(loss_type=loss_type, importance_sampling_level=level))


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("impl", IMPLS)
def test_every_row_masked(impl, loss_type):
    """A non-empty batch with mask all 0: loss 0, gradients exactly 0, metrics finite, on both paths."""
    g = _gen(7)
    B, T, V, H = 2, 3, 17, 5
    mask = torch.zeros(B, T, dtype=torch.bool)
    ids = torch.randint(0, V, (B, T), generator=g)
    for options in (dict(), dict(entropy_coef=0.01, top_entropy_quantile=0.5)):  # per-token kernel / reference
        kwargs = dict(old_logps=torch.randn(B, T, generator=g), ref_logps=torch.randn(B, T, generator=g),
                      is_ratio=torch.rand(B, T, generator=g) + 0.5, loss_type=loss_type, beta=0.04, impl=impl,
                      **options)
        x = torch.randn(B, T, V, generator=g, requires_grad=True)
        loss, metrics = gk.grpo_loss(x, ids, torch.randn(B, generator=g), mask, **kwargs)
        loss.backward()
        assert loss.item() == 0.0 and (x.grad == 0).all(), options
        assert all(torch.isfinite(v) for v in metrics.values()), options
        hidden = torch.randn(B, T, H, generator=g, requires_grad=True)
        weight = torch.randn(V, H, generator=g, requires_grad=True)
        loss, metrics = gk.fused_linear_grpo_loss(hidden, weight, ids, torch.randn(B, generator=g), mask, **kwargs)
        loss.backward()
        assert loss.item() == 0.0 and (hidden.grad == 0).all() and (weight.grad == 0).all(), options
        assert all(torch.isfinite(v) for v in metrics.values()), options


# ------------------------------------------------------------------------------------------------------- limits


def test_long_sequence_torch_path():
    """T = 131073 > 2^17 at a tiny vocabulary: both losses on the PyTorch path against float64. (On the Triton
    path the 1-D token grid has no T limit; the interpreter is too slow at this T, tests/kernels/test_gpu_kernels.py
    runs the compiled kernels at T = 131072.)"""
    g = _gen(8)
    B, T, V, H = 1, 131073, 5, 3
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g)
    logits = hidden @ weight.T
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.rand(B, T, generator=g) < 0.9
    old = logprobs_and_entropy(logits.double(), ids)[0].float() + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, T, generator=g)
    cfg = gk.GRPOLossConfig(loss_type="grpo", importance_sampling_level="sequence")
    x, h = logits.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    losses = (gk.grpo_loss(x, ids, adv, mask, old_logps=old, config=cfg, impl="torch")[0],
              gk.fused_linear_grpo_loss(h, weight, ids, adv, mask, old_logps=old, config=cfg, impl="torch")[0])
    # three-way, per entry point: the truth in float64 on its own inputs (the fp32 logits; hidden and weight), the
    # middle term the reference in fp32 on the same inputs (autograd through hidden @ W.T for d hidden)
    for loss, leaf, make_logits in zip(losses, (x, h), (lambda d: logits.to(d), lambda d: hidden.to(d))):
        loss.backward()
        terms = []
        for dtype in (torch.float64, torch.float32):
            src = make_logits(dtype).detach().requires_grad_(True)
            z = src if leaf is x else src @ weight.to(dtype).T
            ref, _ = reference_grpo_loss(z, ids, adv.to(dtype), mask, old_logps=old.to(dtype), config=cfg)
            terms.append((ref.detach(), torch.autograd.grad(ref, src)[0]))
        (t_loss, t_grad), (n_loss, n_grad) = terms
        what = "grpo_loss" if leaf is x else "fused_linear_grpo_loss"
        assert_three_way(loss.detach(), n_loss, t_loss, torch.float32, f"{what} loss")
        assert_three_way(leaf.grad, n_grad, t_grad, torch.float32, f"{what} d input", scale=grad_scale(t_grad))


@pytest.mark.parametrize("impl", IMPLS)
def test_offsets_beyond_2_to_the_31(impl):
    """A logits row that starts past element 2^31 (a time stride of 2^30 + 112, below 2^31 so that only 64-bit
    offset arithmetic reaches row 2; an untouched 4 GiB buffer, V = 262144): read and differentiated correctly;
    int32 offsets would wrap and read outside the buffer (under the interpreter: a crash). Only the three rows'
    pages are touched."""
    V = 262144
    stride = 2 ** 30 + 112
    base = torch.empty(2 * stride + V, dtype=torch.bfloat16)
    logits = base.as_strided((1, 3, V), (3 * stride, stride, 1))
    g = _gen(9)
    for t in range(3):
        logits[0, t] = (torch.randn(V, generator=g) * (t + 1)).to(torch.bfloat16)
    ids = torch.tensor([[7, V - 2, V // 2 + 5]])
    x = logits.detach().requires_grad_(True)
    logp, ent = gk.token_logprobs(x, ids, return_entropy=True, impl=impl)
    (logp.sum() + ent.sum()).backward()
    ones = torch.ones(1, 3)
    # three-way: logp and entropy are fp32 results of bf16 logits (exact in fp32), so the middle term is plain
    # PyTorch in fp32 on those logits (its sums over V = 262144 round like ours on this machine); d logits is bf16,
    # the middle term that fp32 gradient rounded to bf16
    truth, (n_logp, n_ent, n_grad) = token_truth_and_same_dtype(logits.float().contiguous(), ids, 1.0, ones, ones)
    assert_three_way(logp, n_logp, truth[0], torch.float32, f"{impl} logp")
    assert_three_way(ent, n_ent, truth[1], torch.float32, f"{impl} entropy")
    assert_three_way(x.grad, n_grad.bfloat16(), truth[2], torch.bfloat16, f"{impl} d logits",
                     scale=grad_scale(truth[2]))
    del base, logits, x


@pytest.mark.parametrize("deterministic", [True, False], ids=["deterministic", "atomic"])
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_offsets_beyond_2_to_the_31(impl, deterministic):
    """The fused head indexes hidden and weight rows, never an N x V array: here both have a row stride of
    2^30 + 64 elements (below 2^31, views over untouched 4 GiB fp16 buffers, H = 16), so their third rows start
    past element 2^31; log-probs, entropy and all three gradients match float64 (int32 offsets would wrap and read
    outside the buffers: under the interpreter, a crash)."""
    H, stride = 16, 2 ** 30 + 64
    g = _gen(12)
    bases = [torch.empty(2 * stride + H, dtype=torch.float16) for _ in range(2)]
    hidden, weight = (b.as_strided((3, H), (stride, 1)) for b in bases)
    hidden.copy_(torch.randn(3, H, generator=g).half())
    weight.copy_((torch.randn(3, H, generator=g) / 2).half())
    bias = torch.randn(3, generator=g).half()
    ids = torch.tensor([2, 0, 1])
    leaves = [t.detach().requires_grad_(True) for t in (hidden, weight, bias)]
    logp, ent = gk.linear_token_logprobs(*leaves[:2], ids, bias=leaves[2], return_entropy=True, impl=impl,
                                         deterministic=deterministic)
    (logp.sum() + 0.5 * ent.sum()).backward()
    # three-way: the truth in float64, the middle term plain PyTorch in fp32 on the (exactly upcast) fp16 inputs, as
    # our fp32 tiles compute; its gradients rounded to fp16 like ours
    terms = []
    for dtype in (torch.float64, torch.float32):
        ls = [t.to(dtype).contiguous().requires_grad_(True) for t in (hidden, weight, bias)]
        if dtype == torch.float64:
            t_logp, t_ent = logprobs_and_entropy(ls[0] @ ls[1].T + ls[2], ids)
        else:
            t_logp, t_ent = naive_logprobs_entropy(ls[0] @ ls[1].T + ls[2], ids, 1.0)
        (t_logp.sum() + 0.5 * t_ent.sum()).backward()
        terms.append((t_logp.detach(), t_ent.detach(), [t.grad for t in ls]))
    (t_logp, t_ent, t_grads), (n_logp, n_ent, n_grads) = terms
    assert_three_way(logp, n_logp, t_logp, torch.float32, "logp")
    assert_three_way(ent, n_ent, t_ent, torch.float32, "entropy")
    for name, ours, n, t in zip(("hidden", "weight", "bias"), leaves, n_grads, t_grads):
        assert_three_way(ours.grad, n.half(), t, torch.float16, f"d {name}", scale=grad_scale(t))
    del bases, hidden, weight, leaves


def test_vocab_262144_fused_linear_torch_path():
    """V = 262144 at tiny N on the fused-linear PyTorch path (the logits-path Triton kernels are tested at this V in
    tests/kernels/test_logits_kernels.py; the fused-linear Triton kernels take minutes at this V under the interpreter
    and run at V = 151936 in tests/kernels/test_gpu_kernels.py). Three-way rule: against float64, within K times the
    error of naive fp32 autograd (``h @ W.T``, log-softmax) on the same inputs, measured in this run on this CPU."""
    g = _gen(10)
    V, H = 262144, 4
    hidden = torch.randn(3, H, generator=g, requires_grad=True)
    weight = (torch.randn(V, H, generator=g) * 2).requires_grad_(True)
    ids = torch.tensor([0, V // 2 + 1, V - 1])
    logp, ent = gk.linear_token_logprobs(hidden, weight, ids, return_entropy=True, impl="torch")
    (logp.sum() + ent.sum()).backward()
    h64, w64 = hidden.double().detach().requires_grad_(True), weight.double().detach().requires_grad_(True)
    t_logp, t_ent = logprobs_and_entropy(h64 @ w64.T, ids)
    (t_logp.sum() + t_ent.sum()).backward()
    h32, w32 = hidden.detach().clone().requires_grad_(True), weight.detach().clone().requires_grad_(True)
    n_logp, n_ent = naive_logprobs_entropy(h32 @ w32.T, ids, 1.0)
    (n_logp.sum() + n_ent.sum()).backward()
    assert_three_way(logp, n_logp, t_logp, torch.float32, "logp")
    assert_three_way(ent, n_ent, t_ent, torch.float32, "entropy")
    for name, ours, naive, truth in (("d hidden", hidden.grad, h32.grad, h64.grad),
                                     ("d weight", weight.grad, w32.grad, w64.grad)):
        assert_three_way(ours, naive, truth, torch.float32, name, scale=truth.abs().max().item())


# ------------------------------------------------------------------------------------------ determinism, integrity


def _all_inputs(seed=11, B=3, T=4, V=37, H=8):
    g = _gen(seed)
    hidden, weight = torch.randn(B, T, H, generator=g), torch.randn(V, H, generator=g) / H ** 0.5
    bias = torch.randn(V, generator=g) * 0.1
    logits = (hidden @ weight.T + bias) * 2
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2:] = False
    logp = logprobs_and_entropy(logits.double(), ids)[0]
    noisy = lambda s: (logp + s * torch.randn(B, T, generator=g, dtype=torch.float64)).float()  # noqa: E731
    return dict(logits=logits, hidden=hidden, weight=weight, bias=bias, ids=ids, mask=mask,
                advantages=torch.randn(B, generator=g), old_logps=noisy(0.3), ref_logps=noisy(0.5),
                is_ratio=torch.rand(B, T, generator=g) + 0.5, sampling_logps=noisy(0.2),
                num_items_in_batch=torch.tensor(7))


CONFIGS = {
    "grpo-token": dict(loss_type="grpo", beta=0.04),
    "dapo-sequence": dict(loss_type="dapo", beta=0.04, importance_sampling_level="sequence"),
    "vespo-entropy": dict(loss_type="vespo", beta=0.04, entropy_coef=0.02, top_entropy_quantile=0.7,
                          off_policy_mask_threshold=0.0),
}


def _run(inputs, path, impl, config, inplace_backward=False):
    """Forward + backward on the given tensors (leaves made from them without copying); returns loss, metrics,
    grads."""
    kw = {k: inputs[k] for k in ("old_logps", "ref_logps", "is_ratio", "sampling_logps", "num_items_in_batch")}
    if path == "logits":
        leaves = {"logits": inputs["logits"].requires_grad_(True)}
        loss, metrics = gk.grpo_loss(leaves["logits"], inputs["ids"], inputs["advantages"], inputs["mask"],
                                     config=config, impl=impl, inplace_backward=inplace_backward, **kw)
    else:
        leaves = {k: inputs[k].requires_grad_(True) for k in ("hidden", "weight", "bias")}
        loss, metrics = gk.fused_linear_grpo_loss(leaves["hidden"], leaves["weight"], inputs["ids"],
                                                  inputs["advantages"], inputs["mask"], bias=leaves["bias"],
                                                  config=config, impl=impl, **kw)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in leaves.items()}
    for v in leaves.values():
        v.requires_grad_(False)
        v.grad = None
    return loss.detach(), {k: v.clone() for k, v in metrics.items()}, grads


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("impl", IMPLS)
def test_bitwise_deterministic_by_default(impl, path, config):
    """Two runs in the default mode (deterministic=True) give bitwise identical loss, metrics and gradients."""
    cfg = gk.GRPOLossConfig(**CONFIGS[config])
    assert cfg.deterministic
    first = _run(_all_inputs(), path, impl, cfg)
    second = _run(_all_inputs(), path, impl, cfg)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][k], second[1][k]) for k in first[1])
    assert all(torch.equal(first[2][k], second[2][k]) for k in first[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("impl", IMPLS)
def test_atomic_backward_agrees_with_the_deterministic_one(impl, dtype):
    """deterministic=False (fp32 atomics on a GPU: last-bit run-to-run differences) computes the same numbers to
    rounding; under the interpreter atomics run in a fixed order, so run-to-run variation cannot show here."""
    cfg = gk.GRPOLossConfig(**CONFIGS["grpo-token"])
    inputs = {k: (v.to(dtype) if k in ("hidden", "weight", "bias") else v) for k, v in _all_inputs().items()}
    det = _run(dict(inputs), "linear", impl, cfg)
    inputs = {k: (v.to(dtype) if k in ("hidden", "weight", "bias") else v) for k, v in _all_inputs().items()}
    atomic = _run(inputs, "linear", impl, cfg.replace(deterministic=False))
    # both against float64 by the three-way rule (plain PyTorch in the inputs' dtype the middle term): each within
    # it, so the two within twice it of each other, whatever order the atomics add in
    head = {k: v for k, v in _all_inputs().items() if k not in ("logits", "bias")}
    head.update(hidden=inputs["hidden"], weight=inputs["weight"])
    truth = linear_truth(head, cfg, bias=inputs["bias"])
    same = head_same_dtype(head, cfg, bias=inputs["bias"])
    for name, (loss, _, grads) in (("deterministic", det), ("atomic", atomic)):
        ours = (loss, [grads[k] for k in ("hidden", "weight", "bias")])
        assert_head_three_way(ours, same, truth, dtype, f"{impl} {name}")


def _snapshot(inputs):
    return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inputs.items()}


def _unchanged(inputs, snapshot, skip=()):
    for k, v in inputs.items():
        if torch.is_tensor(v) and k not in skip:
            assert v.dtype == snapshot[k].dtype and torch.equal(v, snapshot[k]), f"{k} was modified"


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("path", ["logits", "linear"])
@pytest.mark.parametrize("impl", IMPLS)
def test_inputs_are_never_modified(impl, path, config):
    """Every tensor passed in (logits / hidden / weight / bias, ids, mask, advantages, old / ref / sampling
    log-probs, is_ratio, num_items_in_batch) is bitwise unchanged after forward + backward."""
    inputs = _all_inputs()
    snapshot = _snapshot(inputs)
    _run(inputs, path, impl, gk.GRPOLossConfig(**CONFIGS[config]))
    _unchanged(inputs, snapshot)


@pytest.mark.parametrize("impl", IMPLS)
def test_only_inplace_backward_touches_the_logits(impl):
    """inplace_backward=True is the one option that writes into an input: the logits buffer becomes d logits."""
    inputs = _all_inputs()
    snapshot = _snapshot(inputs)
    cfg = gk.GRPOLossConfig(**CONFIGS["grpo-token"])
    _, _, grads = _run(inputs, "logits", impl, cfg, inplace_backward=True)
    _unchanged(inputs, snapshot, skip=("logits",))
    assert torch.equal(inputs["logits"], grads["logits"])
    expected = _run(_all_inputs(), "logits", impl, cfg)[2]["logits"]
    assert torch.equal(grads["logits"], expected)
    # the other public functions
    inputs = _all_inputs()
    snapshot = _snapshot(inputs)
    gk.token_logprobs(inputs["logits"].requires_grad_(True), inputs["ids"], 0.7, impl=impl).sum().backward()
    gk.linear_token_logprobs(inputs["hidden"].requires_grad_(True), inputs["weight"].requires_grad_(True),
                             inputs["ids"], bias=inputs["bias"], mask=inputs["mask"], impl=impl).sum().backward()
    gk.group_advantages(inputs["advantages"], 3)
    for k in ("logits", "hidden", "weight"):
        inputs[k].requires_grad_(False)
    _unchanged(inputs, snapshot)


def test_tf32_rule_follows_torch_setting():
    """One rule for fp32 inputs (grpo_kernels/_precision.py): TF32 exactly when torch's own fp32 matmuls use it, for
    the Triton dots (DOT_FP32 = DOT_TF32) as for the cuBLAS GEMMs (which read the same setting). Every way of setting
    it is tried in a child process: torch refuses to read the legacy flag once the two APIs were mixed."""
    import subprocess
    import sys

    code = """
import torch
from grpo_kernels._precision import fp32_matmuls_use_tf32 as tf32
assert not tf32()
torch.backends.cuda.matmul.allow_tf32 = True; assert tf32()
torch.backends.cuda.matmul.allow_tf32 = False; assert not tf32()
torch.set_float32_matmul_precision("high"); assert tf32()
torch.set_float32_matmul_precision("highest"); assert not tf32()
torch.backends.cuda.matmul.fp32_precision = "tf32"; assert tf32()
torch.backends.cuda.matmul.fp32_precision = "ieee"; assert not tf32()
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
