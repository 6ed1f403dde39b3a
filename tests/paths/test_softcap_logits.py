"""Soft-capped logits (``softcap``, Gemma 2's ``final_logit_softcapping``) on the logits entry points:
``token_logprobs`` (logits.sweep, logits.torch) and ``grpo_loss`` (logits.fast, logits.sweep with the Triton or the
reference token stage, logits.torch), against float64 ground truth (``reference`` with the cap, autograd for
gradients) by the three-way rule, where the same-dtype PyTorch term caps too; and against TRL's own loss fed with
capped logits.

The cap is ``z = c tanh(x / c) / temperature``; every test uses a temperature != 1 and logits of a scale where the cap
bends them (|x| ~ c and beyond), so that a missing cap or a missing cap derivative fails."""
import math

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import GRPOLossConfig
from grpo_kernels.paths import LOGITS_FAST, LOGITS_SWEEP, LOGITS_TORCH
from grpo_kernels.reference import soft_cap

from ..support.cases import CASES, make_inputs, optional_inputs
from ..support.oracles import trl_loss_grad_metrics
from ..support.tolerances import (assert_three_way, grad_scale, loss_truth_and_same_dtype,
                                  token_truth_and_same_dtype)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

CAP = 5.0
TEMPERATURE = 0.7
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (B, T, V, max_block_v): V = 37 (not a multiple of 16, one block); V = 160 (a multiple of 16) in blocks of 64, two
# full blocks and a tail; V = 128 in blocks of 32, full blocks only.
SHAPES = {"2x3x37": (2, 3, 37, None), "2x3x160-blocks64": (2, 3, 160, 64), "1x2x128-blocks32": (1, 2, 128, 32)}


def _logits(B, T, V, dtype, seed, scale=2.0 * CAP):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, T, V, generator=g) * scale).to(dtype), torch.randint(0, V, (B, T), generator=g), g


def _token_ours(logits, ids, a, b, impl, softcap=CAP, inplace=False):
    x = logits.clone().requires_grad_(True)
    logp, entropy = gk.token_logprobs(x, ids, TEMPERATURE, return_entropy=True, impl=impl, softcap=softcap,
                                      inplace_backward=inplace)
    (a * logp + b * entropy).sum().backward()
    return logp.detach(), entropy.detach(), x.grad, x


# ------------------------------------------------------------------------------------------------- token_logprobs


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_token_logprobs_three_way(shape, dtype, impl, knobs):
    """logp, entropy and d logits (log-prob and entropy gradients) against float64 with the cap."""
    B, T, V, block = shape
    knobs(max_block_v=block)
    logits, ids, g = _logits(B, T, V, dtype, seed=V + B)
    a, b = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    truth, naive = token_truth_and_same_dtype(logits, ids, TEMPERATURE, a, b, CAP)
    ours = _token_ours(logits, ids, a, b, impl)
    assert ours[2].dtype == dtype
    for name, o, n, t in zip(("logp", "entropy", "d logits"), ours, naive, truth):
        assert_three_way(o, n, t, dtype, f"{impl} {name}", scale=t.abs().max().item() if name == "d logits" else None)


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp-grad", "logp+entropy-grad"])
def test_inplace_backward_reads_the_target_before_overwriting_it(impl, entropy_grad, knobs):
    """inplace_backward with the cap: the gradient is the logits buffer itself and equals the out-of-place one bit for
    bit (the target's capped value comes from the logit read before the sweep rewrote it)."""
    knobs(max_block_v=64)
    logits, ids, g = _logits(2, 3, 160, torch.bfloat16, seed=4)
    a = torch.randn(2, 3, generator=g)
    b = torch.randn(2, 3, generator=g) if entropy_grad else torch.zeros(2, 3)
    expected = _token_ours(logits, ids, a, b, impl)[2]
    _, _, grad, x = _token_ours(logits, ids, a, b, impl, inplace=True)
    assert grad.data_ptr() == x.data_ptr(), "in-place backward must reuse the logits storage"
    assert torch.equal(grad, expected)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_logits_far_beyond_the_cap(impl, knobs):
    """|x| >> softcap (x ~ +-200 with softcap 30, +-inf included): the capped logits saturate at +-30 (a real -inf
    becomes -30, as torch.tanh), the derivative is ~0 there; everything finite and equal to float64."""
    knobs(max_block_v=32)
    logits, ids, g = _logits(2, 3, 80, torch.float32, seed=9, scale=200.0)
    logits[0, 0, :5] = float("-inf")
    logits[1, 2, 7] = float("inf")
    a, b = torch.randn(2, 3, generator=g), torch.randn(2, 3, generator=g)
    truth, naive = token_truth_and_same_dtype(logits, ids, TEMPERATURE, a, b, 30.0)
    ours = _token_ours(logits, ids, a, b, impl, softcap=30.0)
    for name, o, n, t in zip(("logp", "entropy", "d logits"), ours, naive, truth):
        assert_three_way(o, n, t, torch.float32, f"{impl} {name}", scale=grad_scale(t) if name == "d logits" else None)
    # |x| > 9c: 1 - tanh^2 < 6.1e-8 there, the true gradient is ~0 and a missing cap derivative would make it O(1)
    saturated = logits.abs() > 30.0 * 9
    assert saturated.any()
    assert_three_way(ours[2][saturated], naive[2][saturated], truth[2][saturated], torch.float32,
                     f"{impl} saturated d logits", scale=grad_scale(truth[2]))


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_nan_logit_propagates_through_the_cap(impl):
    """A NaN logit makes its token's log-prob, entropy and gradient NaN (tanh(NaN) is NaN); other tokens are exact."""
    logits, ids, _ = _logits(2, 2, 37, torch.float32, seed=5)
    logits[1, 0, 3] = float("nan")
    logp, entropy, grad, _ = _token_ours(logits, ids, torch.ones(2, 2), torch.ones(2, 2), impl)
    assert torch.isnan(logp[1, 0]) and torch.isnan(entropy[1, 0]) and torch.isnan(grad[1, 0]).all()
    keep = torch.ones(2, 2, dtype=torch.bool)
    keep[1, 0] = False
    assert torch.isfinite(logp[keep]).all() and torch.isfinite(grad[keep]).all()


@pytest.mark.interpreter
def test_backward_row_without_gradient_is_exactly_zero():
    """A row with zero incoming gradients reads nothing and gets exact zeros under the cap (its capped padding lanes
    are -c, not -inf, so no 0 * inf), even when its saved statistics are NaN and its logits are +-inf or NaN."""
    from grpo_kernels.kernels.logits_kernels import logits_logprobs_backward, logits_logprobs_forward

    logits, ids, _ = _logits(1, 3, 100, torch.float32, seed=8)
    logits[0, 1, :3] = torch.tensor([float("nan"), float("inf"), float("-inf")])
    ids = torch.tensor([[3, 5, 99]])
    logp, lse, entropy = logits_logprobs_forward(logits, ids, TEMPERATURE, softcap=CAP, block_v=32)
    assert torch.isnan(lse[1]) and torch.isnan(entropy[1])
    grad_logp, grad_entropy = torch.tensor([0.5, 0.0, -1.5]), torch.tensor([0.25, 0.0, 2.0])
    out = logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_entropy, TEMPERATURE, softcap=CAP,
                                   block_v=32)
    assert torch.equal(out[0, 1], torch.zeros(100))
    truth, naive = token_truth_and_same_dtype(logits[:, ::2], ids[:, ::2], TEMPERATURE, grad_logp[::2],
                                              grad_entropy[::2], CAP)
    assert_three_way(out[:, ::2], naive[2], truth[2], torch.float32, "d logits", scale=grad_scale(truth[2]))


# ------------------------------------------------------------------------------------------------------ grpo_loss

_ENTROPY_KL = GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.05, temperature=TEMPERATURE, softcap=CAP)
# name -> (impl, config, the path it must take): the fast kernel, the sweep with the Triton token stage, the sweep
# with the reference stage (a sequence-level ratio), the PyTorch path
LOSS_PATHS = {
    "logits.fast": ("triton", _ENTROPY_KL, LOGITS_FAST),
    "logits.sweep-token-stage": ("triton", _ENTROPY_KL.replace(grad_in_forward=False), LOGITS_SWEEP),
    "logits.sweep-sequence": ("triton", _ENTROPY_KL.replace(loss_type="grpo", importance_sampling_level="sequence"),
                              LOGITS_SWEEP),
    "logits.torch": ("torch", _ENTROPY_KL, LOGITS_TORCH),
}
_CASE = next(c for c in CASES if c.id == "grpo-beta-kl")  # old and reference log-probs


def _loss_ours(inputs, impl, config, logits=None, **kwargs):
    x = (inputs["logits"] if logits is None else logits).clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, inputs["ids"], inputs["advantages"], inputs["mask"], config=config, impl=impl,
                                 **optional_inputs(inputs), **kwargs)
    (grad,) = torch.autograd.grad(loss, x)
    return loss.detach(), grad, metrics


@pytest.mark.parametrize("shape,dtype", [((3, 4, 37, None), torch.float32), ((3, 4, 160, 64), torch.bfloat16)],
                         ids=["V37-fp32", "V160-blocks64-bf16"])
@pytest.mark.parametrize("path", LOSS_PATHS)
def test_grpo_loss_three_way(path, shape, dtype, knobs, plans):
    """Loss and d logits of every logits path with the cap, the KL term and the entropy bonus (its gradient runs
    through the cap), against float64; a fully masked row and ragged lengths (make_inputs). (Multi-block fp32 rows
    are in test_grpo_loss_padded_rows_get_exact_zeros, against the unpadded run.)"""
    impl, config, expected_path = LOSS_PATHS[path]
    B, T, V, block = shape
    knobs(max_block_v=block)
    inputs = make_inputs(_CASE, B=B, T=T, V=V, dtype=dtype, seed=V)
    inputs["logits"] = inputs["logits"] * CAP  # |x| ~ 2c: well inside the bend of the cap
    loss64, grad64, metrics64, loss_d, grad_d, metrics_d = loss_truth_and_same_dtype(inputs, config,
                                                                                  with_metrics=True)
    loss, grad, metrics = _loss_ours(inputs, impl, config)
    assert [p.path for p in plans] == [expected_path]
    assert grad.dtype == dtype
    assert_three_way(loss, loss_d, loss64, dtype, f"{path} loss")
    assert_three_way(grad, grad_d, grad64, dtype, f"{path} d logits", scale=grad_scale(grad64))
    assert_three_way(metrics["entropy"], metrics_d["entropy"], metrics64["entropy"], dtype, f"{path} entropy")


@pytest.mark.parametrize("path", LOSS_PATHS)
def test_grpo_loss_padded_rows_get_exact_zeros(path, knobs):
    """Padded tokens whose logits are NaN / +-inf: an exactly zero gradient there (poisoned output buffers), valid
    rows as with clean logits, also when d logits is written into the logits buffer."""
    impl, config, _ = LOSS_PATHS[path]
    knobs(max_block_v=64)
    inputs = make_inputs(_CASE, B=3, T=4, V=160, seed=2)
    mask = inputs["mask"]
    dirty = inputs["logits"].clone()
    dirty[~mask] = float("nan")
    dirty[:, :, :2][~mask] = torch.tensor([float("inf"), float("-inf")])
    expected_loss, expected_grad, _ = _loss_ours(inputs, impl, config)
    for inplace in (False, True):
        loss, grad, _ = _loss_ours(inputs, impl, config, logits=dirty, inplace_backward=inplace)
        assert (grad[~mask] == 0).all(), f"inplace={inplace}"
        # padded rows are never read: the same code on the same valid logits, so the same bits
        assert torch.equal(loss, expected_loss) and torch.equal(grad[mask], expected_grad[mask]), f"inplace={inplace}"


@pytest.mark.parametrize("path", LOSS_PATHS)
def test_grpo_loss_nan_logit_at_a_valid_token(path):
    """A NaN logit at a valid token makes the loss NaN on every path (the cap keeps NaN)."""
    impl, config, _ = LOSS_PATHS[path]
    inputs = make_inputs(_CASE, B=2, T=3, V=37, seed=3)
    inputs["mask"] = torch.ones(2, 3, dtype=torch.bool)
    inputs["logits"][1, 2, 5] = float("nan")
    loss, grad, _ = _loss_ours(inputs, impl, config)
    assert math.isnan(loss.item()), f"{path}: NaN logit gave a finite loss {loss.item()}"
    assert torch.isnan(grad[1, 2]).all()


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_grpo_loss_matches_trl_on_capped_logits(loss_type, impl):
    """TRL 1.16's own ``_compute_loss`` fed with ``reference.soft_cap(logits, c)`` (autograd back to the raw logits)
    equals ``grpo_loss(logits, softcap=c)``: loss, d logits and metrics by the three-way rule (fp32, TRL in
    float64 the truth, TRL in fp32 the middle term)."""
    config = GRPOLossConfig(loss_type=loss_type, beta=0.04, temperature=TEMPERATURE, epsilon_high=0.28)
    inputs = make_inputs(_CASE, B=3, T=5, V=37, seed=13)
    inputs["logits"] = inputs["logits"] * CAP
    x = inputs["logits"].clone().requires_grad_(True)
    capped = lambda z: soft_cap(z, CAP)  # noqa: E731
    trl64, trl32 = (trl_loss_grad_metrics(x, inputs, config, capped, d) for d in (torch.float64, torch.float32))
    loss, grad, metrics = _loss_ours(inputs, impl, config, softcap=CAP)
    # three-way with TRL as the oracle: against TRL in float64, within K times the error of TRL in fp32
    assert_three_way(loss, trl32[0], trl64[0], torch.float32, "loss")
    assert_three_way(grad, trl32[1], trl64[1], torch.float32, "d logits", scale=grad_scale(trl64[1]))
    for name in ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"):
        assert_three_way(metrics[name], trl32[2][name], trl64[2][name], torch.float32, name)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
def test_torch_path_keeps_two_temporaries_per_chunk(dtype):
    """logits.torch with the cap and the entropy bonus (the backward's heaviest branch), several chunks: the traced
    transient memory is the plan's (two chunk temporaries, planner.plan_logits), not a third chunk for the cap."""
    from grpo_kernels.explain import plan_call

    from ..support.memory_trace import transient_peak

    inputs = make_inputs(_CASE, B=4, T=8, V=1024, dtype=dtype, seed=1)
    x = inputs["logits"].requires_grad_(True)
    args = (x, inputs["ids"], inputs["advantages"], inputs["mask"])
    options = dict(config=_ENTROPY_KL, impl="torch", memory_budget=100_000, **optional_inputs(inputs))
    plan = plan_call(gk.grpo_loss, *args, **options)
    assert plan.path == LOGITS_TORCH and plan.chunk_rows < 32

    def run():
        loss, metrics = gk.grpo_loss(*args, **options)
        loss.backward()
        return [loss, *metrics.values(), x.grad]
    traced = transient_peak(run)
    assert traced <= 1.10 * plan.transient_bytes, f"planned {plan.transient_bytes} B ({plan.transient}), traced {traced}"


# ---------------------------------------------------------------------------------------------------- cap off


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_softcap_none_is_bitwise_the_uncapped_call(impl, knobs):
    """softcap=None is the default: the same bits as no softcap argument on every path, and a cap changes the
    result (the argument reaches the kernels). That the cap compiles to nothing when off is checked on the compiled
    code: the AOT report's SASS of every cap-off config is unchanged by the feature (docs/kernels.md)."""
    knobs(max_block_v=32)
    inputs = make_inputs(_CASE, B=2, T=3, V=80, dtype=torch.bfloat16, seed=6)
    a = torch.randn(2, 3)
    uncapped = GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.05, temperature=TEMPERATURE)
    for cfg in (uncapped, uncapped.replace(grad_in_forward=False)) if impl == "triton" else (uncapped,):
        absent = _loss_ours(inputs, impl, cfg)
        given = _loss_ours(inputs, impl, cfg, softcap=None)
        capped = _loss_ours(inputs, impl, cfg, softcap=CAP)
        assert torch.equal(absent[0], given[0]) and torch.equal(absent[1], given[1])
        assert not torch.equal(absent[1], capped[1])
    results = []
    for kwargs in ({}, {"softcap": None}):
        x = inputs["logits"].clone().requires_grad_(True)
        logp, entropy = gk.token_logprobs(x, inputs["ids"], TEMPERATURE, return_entropy=True, impl=impl, **kwargs)
        (a * logp + entropy).sum().backward()
        results.append((logp, entropy, x.grad))
    for name, u, v in zip(("logp", "entropy", "d logits"), *results):
        assert torch.equal(u, v), name
