"""The hand-out of a gradient made in the forward (``head/fast.py``): the stored fp32 accumulator scaled by the
incoming gradient of the loss and cast to its tensor's dtype, in one pass, the scale read on the device (no host
sync).

Why a kernel: the scale is a 0-dim tensor on the device, unknown to the host without a sync. Read there, it lets
a program skip all its memory traffic when it is 1 and the gradient is the accumulator itself (an fp32 master
weight: the common ``loss.backward()`` costs nothing here), and otherwise fuses the scale with the cast to bf16 /
fp16 (one read of the fp32 accumulator, one write in the weight's dtype, never a scaled fp32 copy first).
"""
from __future__ import annotations

import torch

from .._checks import alloc
from .._triton import import_triton, interpreting
from .host import cdiv
from .launch import launch, target_arch
from .linear_tiles import to_input_dtype

triton, tl = import_triton()

# Elements per program: 16 KiB of fp32 read per program; the grid is the size over this.
SCALE_BLOCK = 4096


@triton.jit
def scale_cast_kernel(src_ptr, dst_ptr, scale_ptr, n, IN_PLACE: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
                      BLOCK: tl.constexpr):
    """dst[i] = (src[i] * scale) in dst's dtype for this program's block of i < n (int64 offsets), rounded to
    nearest (by hand under the interpreter, whose casts truncate); in place (dst is src) nothing is read or written
    when scale is exactly 1. A NaN or infinite scale propagates."""
    s = tl.load(scale_ptr).to(tl.float32)
    if (s != 1.0) | (not IN_PLACE):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(src_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, to_input_dtype(x * s, dst_ptr.dtype.element_ty, ROUND_BY_HAND), mask=ok)


def scaled_gradient(grad: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``grad * scale`` in ``dtype`` (one rounding from ``grad``'s values): in ``grad``'s own buffer when it is
    already in ``dtype`` (contiguous), else a new contiguous tensor. scale: a one-element tensor on grad's device."""
    n = grad.numel()
    in_place = grad.dtype == dtype and grad.is_contiguous()
    src = grad if grad.is_contiguous() else grad.contiguous()
    out = src if in_place else alloc(grad.shape, dtype, grad.device)
    if n:
        launch(scale_cast_kernel, (cdiv(n, SCALE_BLOCK),), src, out, scale.reshape(1).float(), n,
               IN_PLACE=in_place, ROUND_BY_HAND=interpreting() and target_arch() is None, BLOCK=SCALE_BLOCK,
               num_warps=4)
    return out


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the in-place fp32 hand-out and the fp32 -> bf16 / fp16 one."""
    def scenario(dtype):
        def thunk():
            scaled_gradient(torch.zeros(4096, 64), torch.ones(1), dtype)
        return thunk

    return [(f"scale_cast_{name}", scenario(dtype))
            for dtype, name in ((torch.float32, "fp32_in_place"), (torch.bfloat16, "to_bf16"),
                                (torch.float16, "to_fp16"))]
