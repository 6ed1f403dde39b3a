"""The comparisons tests/kernels/test_gpu_kernels.py makes on a GPU (tests/support/device_checks.py), run here on
small CPU tensors through the Triton interpreter: each check passes on the kernels' results and fails on a result
moved by more than its three-way bound, so the first GPU session meets checks that are known to work. The
failures are shown in fp32, where plain PyTorch (the middle term) is as accurate as ours; in bf16 it is far less
(tests/support/device_checks.py), so there the checks catch only gross errors."""
import pytest
import torch

import grpo_kernels as gk

from ..support.cases import CASES, make_inputs
from ..support.device_checks import (check_head, check_logits_loss, check_logits_loss_call, check_logprobs_rows,
                                     check_token_logprobs, head_loss, head_truths, logits_loss)
from ..support.tolerances import loss_truth_and_same_dtype

pytestmark = pytest.mark.interpreter
CASE = {c.id: c for c in CASES}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs_check(dtype):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 5, 37, generator=g) * 2).to(dtype)
    ids = torch.randint(0, 37, (2, 5), generator=g)
    check_token_logprobs(logits, ids, 0.9, torch.randn(2, 5, generator=g), rows=slice(0, 3))


def test_logprobs_rows_check_passes_and_fails():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(6, 8, generator=g).bfloat16(), (torch.randn(37, 8, generator=g) / 2).bfloat16()
    ids = torch.randint(0, 37, (6,), generator=g)
    logp, ent = gk.linear_token_logprobs(h, w, ids, temperature=0.8, return_entropy=True, impl="triton")
    check_logprobs_rows((logp, ent), h @ w.T, h.double() @ w.double().T, ids, 0.8)
    with pytest.raises(AssertionError, match="log-prob"):
        check_logprobs_rows((logp + 0.1, ent), h @ w.T, h.double() @ w.double().T, ids, 0.8)


@pytest.mark.parametrize("case", ["everything", "sequence-beta", "vespo-is-ratio"])
def test_logits_loss_check(case):
    check_logits_loss_call(make_inputs(CASE[case], B=3, T=4), CASE[case].config, what=case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logits_loss_check_scaled_in_place_and_on_a_slice(dtype):
    """The upstream factor and the in-place gradient (the GPU test's ``loss * 3``), and a per-token loss's truth
    taken on the last positions alone (``fraction``); in fp32 a gradient moved by 1% fails."""
    inputs = make_inputs(CASE["grpo-token"], B=2, T=6, dtype=dtype)
    inputs["mask"][:] = True  # every row whole: the last 2 positions are 2 / 6 of each row's normalizer
    cfg = CASE["grpo-token"].config
    loss, grad, x = logits_loss(inputs, cfg, upstream=3.0, inplace_backward=True)
    assert grad.data_ptr() == x.data_ptr()
    check_logits_loss((loss, grad), loss_truth_and_same_dtype(inputs, cfg), dtype, upstream=3.0)
    tail = {k: (v[:, -2:] if torch.is_tensor(v) and v.dim() > 1 else v) for k, v in inputs.items()}
    truths = loss_truth_and_same_dtype(tail, cfg)
    loss, grad, _ = logits_loss(inputs, cfg)
    check_logits_loss((loss, grad[:, -2:]), truths, dtype, fraction=2 / 6)
    if dtype == torch.float32:
        with pytest.raises(AssertionError, match="d logits"):
            check_logits_loss((loss, grad[:, -2:] * 1.01), truths, dtype, fraction=2 / 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_head_check(dtype):
    case = CASE["is-ratio-token"]
    inputs = make_inputs(case, B=3, T=4, V=37, hidden_size=16, dtype=dtype)
    bias = (torch.randn(37, generator=torch.Generator().manual_seed(2)) * 0.1).to(dtype)
    truths = head_truths(inputs, case.config, bias)
    ours = head_loss(inputs, case.config, bias)
    check_head(ours, truths, dtype)
    check_head(head_loss(inputs, case.config, bias, frozen=True), truths, dtype)
    if dtype == torch.float32:
        with pytest.raises(AssertionError, match="d weight"):
            check_head((ours[0], (ours[1][0], ours[1][1] * 1.01, ours[1][2])), truths, dtype)
