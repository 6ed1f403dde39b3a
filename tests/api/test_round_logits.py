"""``round_logits`` (the sampler's recipe: the raw logits rounded to bf16 / fp16 before the soft cap, the temperature
and the softmax) on every entry point, both impls, fp32 and bf16 inputs, with and without a soft cap and a
temperature: log-probs, entropies, losses and gradients against the float64 reference of the recipe (the raw logits
rounded to the dtype exactly, everything after in float64; the gradient straight-through) by the three-way rule, the
plain fp32 recipe in PyTorch the middle term; that the rounding happens; NaN / inf; bad values; off == before.

Why exact raw logits: the head's inputs are dyadic numbers with few bits (``_head``), so ``hidden @ weight.T + bias``
is exact in fp32 whatever the order of the sums and every path rounds the same raw value; with inexact sums an
fp32 rounding difference could move a logit across a bf16 rounding boundary (a jump of one bf16 ulp) on one path and
not another. The values also hit bf16 / fp16 ties, where round-to-nearest-even decides."""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import GRPOLossConfig
from grpo_kernels.kernels.host import cap_args
from grpo_kernels.reference import logprobs_and_entropy, loss_from_logps, reference_grpo_loss, round_logits

from ..support.tolerances import ATOL, assert_three_way, grad_scale, max_err, naive_logprobs_entropy

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after conftest set TRITON_INTERPRET: the kernels below are made here)

from grpo_kernels.kernels.common import round_logit  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
IMPLS = ["torch", "triton"]
# (softcap, temperature): neither; both (a cap that bends logits of the scale used, |x| ~ 10 to 30)
TRANSFORMS = {"plain": (None, 1.0), "cap-temp": (12.0, 1.7)}
B, T, V, H = 2, 3, 37, 16


def _logits(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    # Why this scale: a bf16 ulp at |x| in [8, 16) is 2^-4, so rounding moves log-probs by far more than fp32 noise.
    x = torch.randn(B, T, V, generator=g) * 8.0
    return x.to(dtype), torch.randint(0, V, (B, T), generator=g), g


def _dyadic(shape, g, bits: int, scale: int):
    """Values k / 2^bits with |k| <= scale 2^bits: exact in bf16 when they need <= 8 significant bits."""
    return torch.randint(-scale * 2 ** bits, scale * 2 ** bits + 1, shape, generator=g).float() / 2 ** bits


def _head(dtype, seed=0):
    """hidden (B*T, H) multiples of 2^-5 in [-4, 4] and weight multiples of 2^-6 in [-2, 2] (exact in bf16), bias
    multiples of 2^-11 in [-1, 1]: each product is a multiple of 2^-11 below 8 in magnitude, so the raw logits
    (|x| <= 129, 19 bits; ~10 typically, where bf16's ulp is 2^-4 and fp16's 2^-7) are exact in fp32 in any order
    of summation, and in float64."""
    g = torch.Generator().manual_seed(seed)
    h, w = _dyadic((B * T, H), g, 5, 4), _dyadic((V, H), g, 6, 2)
    b = _dyadic((V,), g, 11, 1)
    return h.to(dtype), w.to(dtype), b.to(dtype), torch.randint(0, V, (B * T,), generator=g), g


def _recipe(x, ids, temperature, softcap, rounding, naive: bool):
    """The recipe on raw logits x: float64 truth (reference) or the plain fp32 PyTorch computation (naive; for leaves
    in bf16 autograd rounds the gradient to bf16 once, as a plain PyTorch computation returns it)."""
    if naive:
        return naive_logprobs_entropy(round_logits(x.float(), rounding), ids, temperature, softcap)
    return logprobs_and_entropy(x.double(), ids, temperature, softcap, rounding)


# ------------------------------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("rounding", ["bf16", "fp16"])
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_token_logprobs(impl, dtype, transform, rounding):
    softcap, temperature = transform
    logits, ids, g = _logits(dtype)
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    results = []
    for x, naive in ((logits.clone(), None), (logits.double(), False), (logits.clone(), True)):
        x.requires_grad_(True)
        if naive is None:
            logp, ent = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl, softcap=softcap,
                                          round_logits=rounding)
        else:
            logp, ent = _recipe(x, ids, temperature, softcap, rounding, naive)
        (grad,) = torch.autograd.grad((a * logp + b * ent).sum(), x)
        results.append((logp.detach(), ent.detach(), grad))
    (lp, en, gr), truth, plain = results
    assert gr.dtype == dtype
    assert_three_way(lp, plain[0], truth[0], torch.float32, f"{impl} logp")
    assert_three_way(en, plain[1], truth[1], torch.float32, f"{impl} entropy")
    assert_three_way(gr, plain[2], truth[2], dtype, f"{impl} d logits", scale=grad_scale(truth[2]))


@pytest.mark.parametrize("impl", IMPLS)
def test_the_rounding_happens(impl):
    """fp32 logits whose bf16 rounding moves the target's log-prob by far more than fp32 noise: ours follows the
    recipe, not the fp32 logits (and round_logits=None keeps the fp32 ones)."""
    logits, ids, _ = _logits(torch.float32, seed=3)
    # 1 + 2^-8 + 2^-9 rounds to 1 + 2^-7 in bf16 (up, past the tie): the target logit moves by 2^-9 times 8
    logits[0, 0, ids[0, 0]] = 8.0 * (1 + 2 ** -8 + 2 ** -9)
    rounded = gk.token_logprobs(logits, ids, impl=impl, round_logits="bf16")
    unrounded = gk.token_logprobs(logits, ids, impl=impl)
    truth_r = logprobs_and_entropy(logits.double(), ids, rounding="bf16")[0]
    truth_u = logprobs_and_entropy(logits.double(), ids)[0]
    gap = max_err(truth_r, truth_u)
    # bound: "clearly different": the gap is 2^-9 * 8 * (1 - p) ~ 1e-2, a thousand times the fp32 floor ATOL[fp32]
    assert gap > 100 * ATOL[torch.float32]
    assert max_err(rounded, truth_r) <= ATOL[torch.float32] < gap / 100
    assert max_err(unrounded, truth_u) <= ATOL[torch.float32]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")  # NaN / inf logits on purpose
def test_nan_and_inf_propagate(impl):
    """A NaN logit makes its row NaN; an +inf logit and -inf (banned tokens) stay infinite: every non-finite log-prob
    is where it is without the rounding. Values past bf16's largest and fp16's 65520 (its rounding boundary) become
    +-inf, as a cast makes them."""
    logits, ids, _ = _logits(torch.float32, seed=5)
    logits[0, 1, 4] = float("nan")
    logits[1, 0, 2] = float("inf")
    logits[1, 2, :3] = float("-inf")
    ids[1, 2] = 5
    for rounding in ("bf16", "fp16"):
        ours = gk.token_logprobs(logits, ids, impl=impl, round_logits=rounding)
        off = gk.token_logprobs(logits, ids, impl=impl)
        assert torch.equal(torch.isnan(ours), torch.isnan(off)) and torch.isnan(ours[0, 1])
        assert torch.equal(torch.isinf(ours), torch.isinf(off))
        keep = torch.isfinite(off)
        truth = logprobs_and_entropy(logits.double(), ids, rounding=rounding)[0]
        assert max_err(ours[keep], truth[keep]) <= ATOL[torch.float32]
    # 3.4e38 is past bf16's largest (3.39e38), 65520 past fp16's rounding boundary: both round to +-inf, so the row
    # gives what the row with +-inf in their place gives, where the fp32 row's log-prob is finite (-big)
    for rounding, big in (("bf16", 3.4e38), ("fp16", 65520.0)):
        row = torch.tensor([[big, -big, 1.0, 0.0]])
        assert torch.isfinite(gk.token_logprobs(row, torch.tensor([3]), impl=impl)).all()
        rounded = gk.token_logprobs(row, torch.tensor([3]), impl=impl, round_logits=rounding)
        infinite = gk.token_logprobs(torch.tensor([[float("inf"), float("-inf"), 1.0, 0.0]]), torch.tensor([3]),
                                     impl=impl)
        torch.testing.assert_close(rounded, infinite, rtol=0, atol=0, equal_nan=True)  # exact


@triton.jit
def _round_kernel(x_ptr, out_ptr, n, SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    # the one helper alone: load, round, store
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_logit(x, SOFTCAP), mask=offs < n)


@pytest.mark.interpreter
def test_kernel_rounding_is_the_cast():
    """``common.round_logit`` (by hand for bf16 under the interpreter, a cast for fp16) equals torch's round-to-
    nearest-even cast bit for bit on ties, carries into the exponent, subnormals, the largest values, +-inf, NaN."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-2 ** 31, 2 ** 31, (2000,), generator=g, dtype=torch.int64)
    special = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 2 - 2 ** -9, 3.4e38,
                            3.3895e38, 65504.0, 65519.0, 65520.0, 1e-40, 6e-8, 3e-8, 0.0, float("inf"), float("nan")])
    x = torch.cat([bits.int().view(torch.float32), special, -special])  # random bit patterns: every exponent
    x = torch.cat([x, torch.tensor([2 ** 31 - 1], dtype=torch.int32).view(torch.float32)])  # a NaN of all ones
    for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        out = torch.empty_like(x)
        _round_kernel[(1,)](x, out, x.numel(), SOFTCAP=cap_args(None, name)["SOFTCAP"],
                     BLOCK=triton.next_power_of_2(x.numel()))
        expected = x.to(dtype).float()
        nan = torch.isnan(expected)
        assert torch.equal(torch.isnan(out), nan) and torch.equal(out[~nan], expected[~nan]), name


# ------------------------------------------------------------------------------------------ linear_token_logprobs


def _head_truth(h, w, b, ids, temperature, softcap, rounding, naive: bool, weights):
    leaves = [t.detach().clone() if naive else t.detach().double() for t in (h, w, b)]
    f = [t.requires_grad_().float() if naive else t.requires_grad_() for t in leaves]
    logp, ent = _recipe(f[0] @ f[1].T + f[2], ids, temperature, softcap, rounding, naive)
    grads = torch.autograd.grad((weights[0] * logp + weights[1] * ent).sum(), leaves)
    return logp.detach(), ent.detach(), grads


@pytest.mark.parametrize("rounding", ["bf16", "fp16"])
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_linear_token_logprobs(impl, dtype, transform, rounding):
    """With gradients (head.light / head.torch) and without (head.no_grad / head.torch)."""
    softcap, temperature = transform
    h, w, b, ids, g = _head(dtype)
    weights = torch.randn(B * T, generator=g), torch.randn(B * T, generator=g)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    logp, ent = gk.linear_token_logprobs(*leaves[:2], ids, leaves[2], temperature, return_entropy=True, impl=impl,
                                         softcap=softcap, round_logits=rounding)
    grads = torch.autograd.grad((weights[0] * logp + weights[1] * ent).sum(), leaves)
    with torch.no_grad():
        logp_ng = gk.linear_token_logprobs(h, w, ids, b, temperature, impl=impl, softcap=softcap,
                                           round_logits=rounding)
    truth = _head_truth(h, w, b, ids, temperature, softcap, rounding, False, weights)
    plain = _head_truth(h, w, b, ids, temperature, softcap, rounding, True, weights)
    for what, o in (("logp", logp), ("no-grad logp", logp_ng)):
        assert_three_way(o, plain[0], truth[0], torch.float32, f"{impl} {what}")
    assert_three_way(ent, plain[1], truth[1], torch.float32, f"{impl} entropy")
    for name, o, n, t in zip(("d hidden", "d weight", "d bias"), grads, plain[2], truth[2]):
        assert_three_way(o, n, t, dtype, f"{impl} {name}", scale=grad_scale(t))


# ------------------------------------------------------------------------------------------------------ the losses

_CONFIG = GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.05)
# name -> config overrides that choose another path: the default fast ones (logits.fast / head.fast), the separate
# sweeps (grad_in_forward=False: logits.sweep / head.light), the atomic head backward
LOSS_PATHS = {"fast": {}, "sweep": {"grad_in_forward": False}, "atomic": {"grad_in_forward": False,
                                                                         "deterministic": False}}


def _loss_inputs(g):
    adv = torch.randn(B, generator=g)
    mask = torch.ones(B, T)
    mask[1, 2] = 0
    ref = -torch.rand(B, T, generator=g) * 3
    return adv, mask, ref


def _loss_config(impl, transform, path):
    """(softcap, temperature, the loss config with bf16 rounding) of a loss case; the PyTorch path has one route."""
    if impl == "torch" and path:
        pytest.skip("the PyTorch path has one route")
    softcap, temperature = transform
    return softcap, temperature, _CONFIG.replace(softcap=softcap, temperature=temperature, round_logits="bf16", **path)


def _loss_recipe(logp, ent, adv, mask, ref, cfg):
    return loss_from_logps(logp, adv, mask, ref_logps=ref, entropy=ent, config=cfg)[0]


@pytest.mark.parametrize("path", LOSS_PATHS.values(), ids=LOSS_PATHS.keys())
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_grpo_loss(impl, dtype, transform, path):
    softcap, temperature, cfg = _loss_config(impl, transform, path)
    logits, ids, g = _logits(dtype, seed=1)
    adv, mask, ref = _loss_inputs(g)
    x = logits.clone().requires_grad_()
    loss, _ = gk.grpo_loss(x, ids, adv, mask, ref_logps=ref, config=cfg, impl=impl)
    (grad,) = torch.autograd.grad(loss, x)
    x64 = logits.double().requires_grad_()
    loss64, _ = reference_grpo_loss(x64, ids, adv, mask, ref_logps=ref, config=cfg)
    (grad64,) = torch.autograd.grad(loss64, x64)
    xf = logits.clone().requires_grad_()
    loss_f = _loss_recipe(*_recipe(xf, ids, temperature, softcap, "bf16", True), adv, mask, ref, cfg)
    (grad_f,) = torch.autograd.grad(loss_f, xf)
    assert_three_way(loss.detach(), loss_f.detach(), loss64.detach(), torch.float32, f"{impl} loss")
    assert_three_way(grad, grad_f, grad64, dtype, f"{impl} d logits", scale=grad_scale(grad64))


@pytest.mark.parametrize("path", LOSS_PATHS.values(), ids=LOSS_PATHS.keys())
@pytest.mark.parametrize("transform", TRANSFORMS.values(), ids=TRANSFORMS.keys())
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("impl", IMPLS)
def test_fused_linear_grpo_loss(impl, dtype, transform, path):
    softcap, temperature, cfg = _loss_config(impl, transform, path)
    h, w, b, ids, g = _head(dtype, seed=2)
    adv, mask, ref = _loss_inputs(g)
    leaves = [t.clone().requires_grad_() for t in (h, w, b)]
    loss, _ = gk.fused_linear_grpo_loss(leaves[0].view(B, T, H), leaves[1], ids.view(B, T), adv, mask,
                                        bias=leaves[2], ref_logps=ref, config=cfg, impl=impl)
    grads = torch.autograd.grad(loss, leaves)
    results = []
    for naive in (False, True):
        fs = [(t.detach().clone() if naive else t.detach().double()).requires_grad_() for t in (h, w, b)]
        x = (fs[0].float() @ fs[1].float().T + fs[2].float()) if naive else (fs[0] @ fs[1].T + fs[2])
        x = x.view(B, T, V)
        loss_r = _loss_recipe(*_recipe(x, ids.view(B, T), temperature, softcap, "bf16", naive), adv, mask, ref, cfg)
        results.append((loss_r.detach(), torch.autograd.grad(loss_r, fs)))
    (loss64, grads64), (loss_f, grads_f) = results
    assert_three_way(loss.detach(), loss_f, loss64, torch.float32, f"{impl} loss")
    for name, o, n, t in zip(("d hidden", "d weight", "d bias"), grads, grads_f, grads64):
        assert_three_way(o, n, t, dtype, f"{impl} {name}", scale=grad_scale(t))


def test_modules_and_explain_carry_the_option():
    """GRPOLoss / FusedLinearGRPOLoss take it as a config override; explain() says where the rounding happens."""
    logits, ids, g = _logits(torch.float32, seed=4)
    adv, mask, ref = _loss_inputs(g)
    module = gk.GRPOLoss(beta=0.04, round_logits="bf16", impl="torch")
    assert module.config.round_logits == "bf16"
    expected = gk.grpo_loss(logits, ids, adv, mask, ref_logps=ref, beta=0.04, round_logits="bf16", impl="torch")[0]
    assert torch.equal(module(logits, ids, adv, mask, ref_logps=ref)[0], expected)
    text = gk.explain(gk.token_logprobs, logits, ids, impl="torch", round_logits="bf16")
    assert "round_logits bf16" in text and "straight-through" in text
    assert "round_logits" not in gk.explain(gk.token_logprobs, logits, ids, impl="torch")
    h, w, b, hids, _ = _head(torch.float32)
    text = gk.explain(gk.fused_linear_grpo_loss, h.view(B, T, H), w, hids.view(B, T), adv, mask, bias=b,
                      round_logits="fp16", impl="triton")
    assert "round_logits fp16" in text and "Triton kernels" in text


# ------------------------------------------------------------------------------------------- bad values, default off


@pytest.mark.parametrize("value", ["bfloat16", "fp32", "BF16", 16, True, torch.bfloat16])
def test_bad_value_raises_naming_the_argument(value):
    logits, ids, _ = _logits(torch.float32)
    h, w, b, hids, g = _head(torch.float32)
    adv, mask, _ = _loss_inputs(g)
    calls = [lambda: gk.token_logprobs(logits, ids, round_logits=value),
             lambda: gk.linear_token_logprobs(h, w, hids, b, round_logits=value),
             lambda: gk.grpo_loss(logits, ids, adv, mask, round_logits=value),
             lambda: gk.fused_linear_grpo_loss(h.view(B, T, H), w, hids.view(B, T), adv, mask, round_logits=value),
             lambda: GRPOLossConfig(round_logits=value)]
    for call in calls:
        with pytest.raises(ValueError, match="round_logits must be None or one of"):
            call()


@pytest.mark.parametrize("impl", IMPLS)
def test_off_is_bitwise_the_same_as_before(impl):
    """round_logits=None gives the kernels of before (the same SOFTCAP constexpr, a bool) and bitwise the same
    results as a call without the keyword, on every entry point."""
    assert cap_args(None, None) == cap_args(None) == {"softcap": 1.0, "SOFTCAP": False}
    assert cap_args(12.0, None)["SOFTCAP"] is True
    logits, ids, g = _logits(torch.bfloat16, seed=6)
    adv, mask, ref = _loss_inputs(g)
    h, w, b, hids, _ = _head(torch.bfloat16)
    for fn, args, kw in ((gk.token_logprobs, (logits, ids, 0.7), {"softcap": 12.0, "return_entropy": True}),
                         (gk.linear_token_logprobs, (h, w, hids, b, 0.7), {"return_entropy": True}),
                         (gk.grpo_loss, (logits, ids, adv, mask), {"ref_logps": ref, "beta": 0.04}),
                         (gk.fused_linear_grpo_loss, (h.view(B, T, H), w, hids.view(B, T), adv, mask),
                          {"bias": b, "softcap": 12.0})):
        before, after = fn(*args, impl=impl, **kw), fn(*args, impl=impl, round_logits=None, **kw)
        flat = [t for pair in (before, after) for t in (pair if isinstance(pair, tuple) else (pair,))]
        for x, y in zip(flat[: len(flat) // 2], flat[len(flat) // 2:]):
            pairs = [(x[k], y[k]) for k in x] if isinstance(x, dict) else [(x, y)]
            for u, v in pairs:  # exact: rtol=0, atol=0
                torch.testing.assert_close(torch.as_tensor(u), torch.as_tensor(v), rtol=0, atol=0, equal_nan=True)
