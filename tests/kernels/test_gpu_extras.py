"""The extra per-token outputs (``extra_outputs=``: log sum p^2, mean logit, is_top1) on the compiled Triton kernels
of a CUDA GPU, at the Qwen vocabulary (skipped elsewhere; ``benchmarks/gpu_check.sh`` runs it with the test suite).

On CPU the same kernels run under TRITON_INTERPRET=1 in tests/paths/test_head_extras.py and
tests/hf/test_trl_outputs.py; here they run compiled: the tile forward (``head.light``, with gradients; the
``fwd_extras`` tile for bf16) and the row fold (``head.no_grad``, its sweep split around the target's block), against
the float64 reference on the same GPU and against TRL's own ``ChunkedLogProbFunction`` (its Triton kernel on CUDA).
Integer-valued inputs make every logit exact in every implementation (tensor-core dots included), so is_top1 is
compared exactly, duplicate weight rows making exact ties in different blocks, tiles and vocab splits.
"""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import EXTRA_OUTPUTS
from grpo_kernels.reference import token_extras

from ..support.tolerances import assert_three_way

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
DEV = "cuda"
N, H, V = 256, 64, 151936
TIED = (2047, 2048, 70001, 151935)  # a block boundary of the fold (2048), another split, the last column


def _case(dtype):
    g = torch.Generator(device=DEV).manual_seed(0)
    hidden = torch.randint(-2, 3, (N, H), device=DEV, generator=g).float()
    weight = torch.randint(-1, 2, (V, H), device=DEV, generator=g).float()
    bias = torch.randint(-2, 3, (V,), device=DEV, generator=g) * 0.5
    for col in TIED[1:]:
        weight[col], bias[col] = weight[TIED[0]], bias[TIED[0]]
    hidden[:32] = 3 * weight[TIED[0]]
    ids = torch.randint(0, V, (N,), device=DEV, generator=g)
    ids[:32] = torch.tensor(TIED * 8, device=DEV)
    return hidden.to(dtype), weight.to(dtype), bias.to(dtype), ids


@pytest.mark.parametrize("grad", [True, False], ids=["head.light", "head.no_grad"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_extras_compiled_at_qwen_vocab(dtype, grad):
    hidden, weight, bias, ids = _case(dtype)
    h = hidden.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = gk.linear_token_logprobs(h, weight, ids, bias=bias, temperature=0.8, impl="triton",
                                       extra_outputs=EXTRA_OUTPUTS)
    x = hidden.double() @ weight.double().T + bias.double()
    truth = token_extras(x, ids, 0.8)
    same = token_extras(hidden @ weight.T + bias, ids, 0.8)
    assert torch.equal(out.is_top1, truth[2]) and out.is_top1[:32].tolist() == [True, False, False, False] * 8
    for name, t, s in zip(EXTRA_OUTPUTS[:2], truth, same):
        assert_three_way(getattr(out, name), s, t, torch.float32, f"{dtype} grad={grad} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_trl_function_on_cuda_matches_trl(dtype):
    """TRLLogProbFunction against TRL's function on CUDA (its Triton fold; exact logits: the same is_top1)."""
    pytest.importorskip("trl")
    from trl.kernels import ChunkedLogProbFunction

    from grpo_kernels.integrations.trl import TRLLogProbFunction

    hidden, weight, bias, ids = _case(dtype)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    with torch.no_grad():
        ours = TRLLogProbFunction.apply(hidden, weight, bias, ids, 0.8, 32768, None, 1.0, outputs)
        theirs = ChunkedLogProbFunction.apply(hidden, weight, bias, ids, 0.8, 32768, None, 1.0, outputs)
    truth = token_extras(hidden.double() @ weight.double().T + bias.double(), ids, 0.8)
    assert ours[4].dtype == torch.bool and torch.equal(ours[4], theirs[4]) and torch.equal(ours[4], truth[2])
    for i, t in ((2, truth[0]), (3, truth[1])):
        assert_three_way(ours[i], theirs[i], t, torch.float32, f"{dtype} {outputs[i]}")
