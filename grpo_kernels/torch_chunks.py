"""The PyTorch paths' in-place chunk maths, defined once for ``logits.torch`` (``logits/logprobs.py``) and
``head.torch`` (``head/torch_tiles.py``): the soft cap of a chunk of logits and a chunk's d logits.

Why in place: a chunk is ``rows x columns`` of fp32 values, and the plans of both paths count two such buffers alive
at once (``TORCH_LOGITS_TEMPS`` / ``TORCH_HEAD_TEMPS``, docs/memory.md); every formula here keeps to that, with or
without the soft cap. The maths is ``reference.soft_cap`` / ``soft_cap_derivative`` and docs/DESIGN.md section 3,
formed in the caller's buffer (no autograd).
"""
from __future__ import annotations

import torch

from .reference import ROUND_DTYPES

# Why clamp -inf logits before multiplying by a probability: p = 0 there, and 0 * -1e30 = 0 where 0 * -inf is NaN.
# Finite after a multiplication by any per-token scale below 1e8.
NEG_BIG = -1e30


def round_(z: torch.Tensor, rounding: str | None) -> torch.Tensor:
    """``z`` overwritten with its values rounded to ``rounding`` (bf16 / fp16) and back (``reference.round_logits``;
    one half-size temporary); unchanged for None. The chunk's d logits are then those of the rounded logits, passed
    to the raw ones unchanged (straight-through)."""
    return z if rounding is None else z.copy_(z.to(ROUND_DTYPES[rounding]))


def soft_cap_(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``z`` overwritten with ``softcap * tanh(z / softcap)`` (``reference.soft_cap``); unchanged for None."""
    return z if softcap is None else z.div_(softcap).tanh_().mul_(softcap)


def dlogits_(z: torch.Tensor, lse, h, g, g_h, inv_t: float, softcap: float | None, target, target_here=None):
    """d loss / d raw logits of one chunk, formed in ``z``'s buffer plus one more chunk-sized buffer.

    z: (R, C) raw logits of the chunk (bias included, not yet capped or divided by the temperature) in the
    accumulation dtype, owned by the caller and overwritten; lse, h (entropy), g = d loss / d logp and g_h =
    d loss / d entropy: (R, 1) (h and g_h None without an entropy gradient); target: (R, 1) int64 column of each
    row's target in this chunk (clamped into it); target_here: (R, 1) bool, whether the target lies in this chunk
    (None: always). Returns ``soft_cap'(x) (g onehot - p (g + g_h (log p + H))) / T``, soft_cap' = 1 without a cap.

    Why this order with a cap: the capped logits (buffer A) give log p (buffer B); A then becomes the cap's
    derivative ``1 - (capped / c)^2``, read at the target for the onehot term. With an entropy gradient log p and p
    are both needed beside the derivative, so A becomes ``soft_cap' p`` as ``exp(log soft_cap' + log p)`` (no third
    buffer; a derivative of 0 gives log = -inf and exactly 0, and it is >= 0 since |capped| <= c in floating point)."""
    onehot = g
    if softcap is None:
        log_p = z.mul_(inv_t).sub_(lse)
        p = log_p.exp()
        if g_h is None:
            dz = p.mul_(-g)
        else:  # -p (g + g_h (log p + H)), formed in log_p's buffer
            dz = log_p.clamp_(min=NEG_BIG).add_(h).mul_(g_h).add_(g).mul_(p).neg_()
        del log_p, p
    else:
        capped = soft_cap_(z, softcap)
        log_p = capped.mul(inv_t).sub_(lse)
        derivative = capped.div_(softcap).square_().neg_().add_(1.0)  # reference.soft_cap_derivative, in place
        del capped
        onehot = g * derivative.gather(-1, target)
        if g_h is None:
            dz = log_p.exp_().mul_(derivative).mul_(-g)
        else:
            weighted_p = derivative.log_().add_(log_p).exp_()
            dz = log_p.clamp_(min=NEG_BIG).add_(h).mul_(g_h).add_(g).mul_(weighted_p).neg_()
        del derivative
    if target_here is not None:
        onehot = torch.where(target_here, onehot, 0.0)
    # Why gather + scatter_ and not scatter_add_: one column per row, so the write lands once; scatter_add_ is an
    # accumulating (atomic on CUDA) op, which deterministic mode runs none of (docs/numerics.md, "Determinism").
    return dz.scatter_(-1, target, dz.gather(-1, target) + onehot).mul_(inv_t)
