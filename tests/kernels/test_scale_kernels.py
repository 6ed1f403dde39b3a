"""The gradient hand-out kernel (``kernels/scale_kernels.py``): fp32 accumulator times the incoming gradient of the
loss, cast once; in place for a gradient already in its dtype, and untouched for a scale of exactly 1."""
from __future__ import annotations

import pytest
import torch

from grpo_kernels.kernels import scale_kernels

pytestmark = pytest.mark.interpreter


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.25, -3.0])
def test_scale_and_cast_in_one_pass_equals_torch(dtype, scale):
    g = torch.Generator().manual_seed(0)
    acc = torch.randn(37, 129, generator=g)  # n not a multiple of the block: a masked tail
    expected = (acc * scale).to(dtype)  # torch rounds to nearest: the same value, exactly
    src = acc.clone()
    out = scale_kernels.scaled_gradient(src, torch.tensor(scale), dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert (out.data_ptr() == src.data_ptr()) == (dtype == torch.float32)


def test_a_scale_of_one_touches_nothing_in_place():
    """With IN_PLACE a scale of exactly 1 neither reads nor writes: launched here with a separate destination, that
    destination keeps its zeros; any other scale writes every element."""
    src, dst = torch.ones(5000), torch.zeros(5000)
    grid = (-(-5000 // scale_kernels.SCALE_BLOCK),)
    for scale, expected in ((1.0, 0.0), (2.0, 2.0)):
        scale_kernels.scale_cast_kernel[grid](src, dst, torch.tensor([scale]), 5000, IN_PLACE=True,
                                              ROUND_BY_HAND=False, BLOCK=scale_kernels.SCALE_BLOCK)
        assert torch.equal(dst, torch.full((5000,), expected))


def test_a_nan_scale_propagates():
    out = scale_kernels.scaled_gradient(torch.ones(10), torch.tensor(float("nan")), torch.bfloat16)
    assert out.isnan().all()
