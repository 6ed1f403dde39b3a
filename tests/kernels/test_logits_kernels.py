"""The logits path (Triton under the interpreter, and the chunked torch path) against float64 ground truth."""
import pytest
import torch

import grpo_kernels as gk
from grpo_kernels._testing import override
from grpo_kernels.reference import logprobs_and_entropy

from ..support.cases import CASES, make_inputs, optional_inputs
from ..support.tolerances import (assert_three_way, grad_scale, loss_truth_and_same_dtype, naive_logprobs_entropy,
                                  token_truth_and_same_dtype)

pytestmark = pytest.mark.usefixtures("poisoned_outputs")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# (B, T, V, block_v): V not a power of two, T = 1, a single token, V below / above / across the block size
SHAPES = {
    "1x1x1": (1, 1, 1, None),
    "2x1x37": (2, 1, 37, None),
    "3x5x1000-block256": (3, 5, 1000, 256),
    "2x3x4099": (2, 3, 4099, None),
}


def _ours(logits, ids, temperature, a, b, impl, block_v=None):
    with override(max_block_v=block_v):
        x = logits.clone().requires_grad_(True)
        logp, entropy = gk.token_logprobs(x, ids, temperature, return_entropy=True, impl=impl)
        (grad,) = torch.autograd.grad((a * logp + b * entropy).sum(), x)
    return logp, entropy, grad


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp-grad", "logp+entropy-grad"])
def test_token_logprobs_three_way(shape, dtype, impl, entropy_grad, monkeypatch):
    B, T, V, block_v = shape
    g = torch.Generator().manual_seed(B * 1000 + V)
    logits = (torch.randn(B, T, V, generator=g) * 3).to(dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    a = torch.randn(B, T, generator=g)
    b = torch.randn(B, T, generator=g) if entropy_grad else torch.zeros(B, T)
    truth, naive = token_truth_and_same_dtype(logits, ids, 0.8, a, b)
    ours = _ours(logits, ids, 0.8, a, b, impl, block_v)
    assert ours[0].dtype == torch.float32 and ours[2].dtype == dtype
    for name, o, n, t in zip(("logp", "entropy", "d logits"), ours, naive, truth):
        assert_three_way(o, n, t, dtype, f"{impl} {name}")


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_minus_inf_logits_and_noncontiguous_view(impl):
    """Banned tokens (-inf logits) get probability 0 (no NaN anywhere); a sliced logits view needs no copy."""
    g = torch.Generator().manual_seed(3)
    full = torch.randn(2, 5, 300, generator=g)
    full[0, 1, :200] = float("-inf")
    logits = full[:, :-1]  # (2, 4, 300), time-strided
    ids = torch.randint(200, 300, (2, 4), generator=g)
    a, b = torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)
    truth, naive = token_truth_and_same_dtype(logits, ids, 1.0, a, b)
    ours = _ours(logits, ids, 1.0, a, b, impl)
    for name, o, n, t in zip(("logp", "entropy", "d logits"), ours, naive, truth):
        assert_three_way(o, n, t, torch.float32, f"{impl} {name}", scale=grad_scale(t) if name == "d logits" else None)
    assert (ours[2][0, 1, :200] == 0).all()


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_inplace_backward_reuses_the_logits_buffer(impl):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 3, 130, generator=g, dtype=torch.bfloat16)
    ids = torch.randint(0, 130, (2, 3), generator=g)
    expected = _ours(logits, ids, 1.0, torch.ones(2, 3), torch.zeros(2, 3), impl)[2]
    x = logits.clone().requires_grad_(True)
    logp = gk.token_logprobs(x, ids, impl=impl, inplace_backward=True)
    logp.sum().backward()
    assert x.grad.data_ptr() == x.data_ptr(), "in-place backward must reuse the logits storage"
    assert torch.equal(x.grad, expected)

@pytest.mark.interpreter
@pytest.mark.parametrize("entropy_grad", [False, True], ids=["logp-grad", "logp+entropy-grad"])
def test_backward_row_without_gradient_is_zero_despite_nan_statistics(entropy_grad):
    """A row whose incoming gradients are 0 reads nothing and gets exact zeros, even when its saved lse and
    entropy are NaN (a NaN row of a token the loss masks out); the other rows match float64."""
    from grpo_kernels.kernels.logits_kernels import logits_logprobs_backward, logits_logprobs_forward

    g = torch.Generator().manual_seed(8)
    logits = torch.randn(1, 3, 100, generator=g)
    logits[0, 1, 7] = float("nan")
    ids = torch.tensor([[3, 5, 99]])
    with override(max_block_v=32):
        logp, lse, entropy = logits_logprobs_forward(logits, ids, 0.9)
        assert torch.isnan(lse[1]) and torch.isnan(entropy[1])
        grad_logp = torch.tensor([0.5, 0.0, -1.5])
        grad_ent = torch.tensor([0.25, 0.0, 2.0]) if entropy_grad else None
        out = logits_logprobs_backward(logits, ids, lse, entropy, grad_logp, grad_ent, 0.9)
    assert torch.equal(out[0, 1], torch.zeros(100))
    truth, naive = token_truth_and_same_dtype(logits[:, ::2], ids[:, ::2], 0.9, grad_logp[::2].view(1, 2),
                                              (grad_ent if entropy_grad else torch.zeros(3))[::2].view(1, 2))
    assert_three_way(out[:, ::2], naive[2], truth[2], torch.float32, "d logits", scale=grad_scale(truth[2]))


@pytest.mark.interpreter
def test_large_vocab_triton():
    """V = 262144 (the largest vocab the contract names), one token, under the interpreter. logp and entropy are fp32
    results of bf16 logits (exact in fp32): the middle term is plain PyTorch in fp32 on those logits, whose sums
    over V round like ours on this machine (a fixed bound failed on another CPU at this V)."""
    g = torch.Generator().manual_seed(5)
    V = 262144
    logits = torch.randn(1, 1, V, generator=g).to(torch.bfloat16)
    ids = torch.tensor([[V - 1]])
    logp, entropy = gk.token_logprobs(logits, ids, return_entropy=True, impl="triton")
    t_logp, t_entropy = logprobs_and_entropy(logits.double(), ids)
    n_logp, n_entropy = naive_logprobs_entropy(logits.float(), ids, 1.0)
    assert_three_way(logp, n_logp, t_logp, torch.float32, "logp")
    assert_three_way(entropy, n_entropy, t_entropy, torch.float32, "entropy")


LOSS_CASES = [c for c in CASES if c.id in ("grpo-token", "dapo-token", "cispo-token", "sapo-token",
                                           "vespo-token", "luspo-sequence", "everything", "entropy-bonus")]


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", LOSS_CASES, ids=lambda c: c.id)
def test_grpo_loss_triton_three_way(case, dtype):
    inputs = make_inputs(case, B=3, T=5, V=300, dtype=dtype, seed=11)
    rest = optional_inputs(inputs)
    args = (inputs["ids"], inputs["advantages"], inputs["mask"])
    loss64, grad64, loss_d, grad_d = loss_truth_and_same_dtype(inputs, case.config)

    x = inputs["logits"].clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, *args, config=case.config, impl="triton", **rest)
    (grad,) = torch.autograd.grad(loss, x)
    assert_three_way(loss.detach(), loss_d, loss64, dtype, "loss")
    assert_three_way(grad, grad_d, grad64, dtype, "d logits", scale=grad64.abs().max().item())


@pytest.mark.parametrize("impl", ["triton", "torch"])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "bnpo", "dr_grpo", "luspo", "cispo", "sapo", "vespo"])
def test_empty_mask_gives_zero_loss_and_zero_grad(loss_type, impl):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 3, 50, generator=g, requires_grad=True)
    ids = torch.randint(0, 50, (2, 3), generator=g)
    ref = torch.randn(2, 3, generator=g) - 4
    loss, metrics = gk.grpo_loss(logits, ids, torch.randn(2, generator=g), torch.zeros(2, 3, dtype=torch.bool),
                                 ref_logps=ref, loss_type=loss_type, beta=0.04, entropy_coef=0.01,
                                 top_entropy_quantile=0.5, impl=impl)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert all(torch.isfinite(v) for v in metrics.values())

@pytest.mark.interpreter
def test_token_level_configs_use_the_fused_stage(monkeypatch):
    """Token-level configs run the per-token Triton kernel, not the eager stage (whose maths it must match)."""
    import grpo_kernels.token_stage as loss_module

    def fail(*args, **kwargs):
        raise AssertionError("eager loss stage used")
    monkeypatch.setattr(loss_module, "loss_from_logps", fail)
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case)
    gk.grpo_loss(inputs.pop("logits"), inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask"),
                 config=case.config, impl="triton", **inputs)

@pytest.mark.interpreter
def test_padded_rows_are_skipped_and_get_zero_gradient():
    """grpo_loss passes its mask to the Triton sweep: padded rows read no logits (NaN logits there change
    nothing) and get an exactly zero gradient, while valid rows match the torch path."""
    case = next(c for c in CASES if c.id == "grpo-beta-kl")
    inputs = make_inputs(case, B=3, T=5, V=300, seed=21)
    logits = inputs.pop("logits")
    poisoned = logits.clone()
    poisoned[~inputs["mask"]] = float("nan")
    ids, adv, mask = inputs.pop("ids"), inputs.pop("advantages"), inputs.pop("mask")
    x = poisoned.clone().requires_grad_(True)
    loss, metrics = gk.grpo_loss(x, ids, adv, mask, config=case.config, impl="triton", **inputs)
    loss.backward()
    y = logits.clone().requires_grad_(True)
    expected, expected_metrics = gk.grpo_loss(y, ids, adv, mask, config=case.config, impl="torch", **inputs)
    expected.backward()
    assert (x.grad[~mask] == 0).all()
    # both paths against float64 by the three-way rule (the clean logits; padded rows are skipped, so the same)
    loss64, grad64, metrics64, loss_d, grad_d, metrics_d = loss_truth_and_same_dtype(
        dict(inputs, logits=logits, ids=ids, advantages=adv, mask=mask), case.config, with_metrics=True)
    for path, (l, gr, m) in {"triton": (loss, x.grad, metrics), "torch": (expected, y.grad, expected_metrics)}.items():
        assert_three_way(l.detach(), loss_d, loss64, torch.float32, f"{path} loss")
        assert_three_way(gr, grad_d, grad64, torch.float32, f"{path} d logits", scale=grad_scale(grad64))
        for k in m:
            assert_three_way(m[k], metrics_d[k], metrics64[k], torch.float32, f"{path} metric {k}")
