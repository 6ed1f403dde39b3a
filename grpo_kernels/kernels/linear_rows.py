"""The row sweeps of the fused head's epilogue kernels (``linear_epilogue_kernels.py``): one row of fp32 logits
folded into the online logsumexp / entropy statistics, with the extra statistics of ``config.TokenExtras`` (log
sum p^2, the sum of the logits, the max before the target) when their HAS_* flags are on, and the target's logit.
@triton.jit helpers only (inlined into the kernels that call them), and the extras' output buffers.

Imported lazily with the kernel module (TRITON_INTERPRET set before the first launch takes effect).
"""
from __future__ import annotations

import torch

from .._checks import alloc
from .._triton import import_triton
from .common import LOG2E, lane_fold, lane_fold_sq, lanes_sq_to_row, lanes_to_row, row_lse_entropy, soft_cap

triton, tl = import_triton()


@triton.jit
def lane_offsets(BLOCK: tl.constexpr, LANE: tl.constexpr):
    """(BLOCK // LANE, LANE) offsets 0 .. BLOCK - 1, row-major: LANE contiguous values per lane."""
    return tl.arange(0, BLOCK // LANE)[:, None] * LANE + tl.arange(0, LANE)[None, :]


@triton.jit
def head_row_lse_entropy(z_row, b_ptr, V, inv_temperature, softcap, HAS_BIAS: tl.constexpr,
                         SOFTCAP: tl.constexpr, BLOCK: tl.constexpr):
    """(logsumexp, entropy) of one row of fp32 logits, z = soft_cap(x + b) * inv_temperature (``head_row_stats``
    without the extra statistics)."""
    lse, ent, _s, _s2, _y_sum, _m, _y_before = head_row_stats(z_row, b_ptr, V, 0, inv_temperature, softcap,
                                                              HAS_BIAS, SOFTCAP, False, False, False, BLOCK)
    return lse, ent


@triton.jit
def head_row_stats(z_row, b_ptr, V, target, inv_temperature, softcap, HAS_BIAS: tl.constexpr,
                   SOFTCAP: tl.constexpr, HAS_SQ: tl.constexpr, HAS_SUM: tl.constexpr, HAS_TOP1: tl.constexpr,
                   BLOCK: tl.constexpr):
    """(lse, entropy, s, s2, sum y, max y, max y before ``target``) of one row of fp32 logits x, y = soft_cap(x + b),
    z = y * inv_temperature: per-lane online statistics over unmasked (16-byte vector) full blocks and one masked
    tail, lanes combined once. The extras, each only when its flag is on (else 0): s2 = sum e^(2 (z - m)) with
    s = sum e^(z - m) (``log sum p^2 = log s2 - 2 log s``), the plain sum of y, and the max of y over the columns
    before ``target`` with the row max (is_top1). They ride on the same loads: no second pass over the row.

    Why the lane width: a lane must sit in one thread (common.lane_fold). Four fp32 logits are one 16-byte vector;
    with a half-precision bias, eight (one 16-byte vector of bias, two of logits), else the bias load alone would
    be split into 8-byte pieces or the lane across two threads."""
    LANE: tl.constexpr = 8 if HAS_BIAS and b_ptr.dtype.element_ty.primitive_bitwidth == 16 else 4
    offs = lane_offsets(BLOCK, LANE)
    c = inv_temperature * LOG2E
    m = tl.full([BLOCK // LANE], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK // LANE], tl.float32)
    a = tl.zeros([BLOCK // LANE], tl.float32)
    s2 = tl.zeros([BLOCK // LANE], tl.float32)
    # Why a block-shaped sum of y, reduced once after the sweep: one FADD per element and no reduction in the loop
    # (a loop-carried sum of a per-lane reduction makes Triton 3.6's thread-locality pass assert when the sweep is
    # split around the target's block, as for is_top1).
    y_sum = tl.zeros([BLOCK // LANE, LANE], tl.float32)
    y_before = tl.full([BLOCK // LANE], float("-inf"), tl.float32)
    v_main = (V // BLOCK) * BLOCK
    # Why an unmasked main loop: full blocks need no predicate, so the loads vectorize to 16 bytes.
    if HAS_TOP1:
        # Why three loops, the blocks before the target's, its own and those after: the max before the target of
        # a wholly earlier block is its lanes' max (m after the first loop), so that only the target's own block
        # compares columns; no instruction per element is added to the other blocks.
        t_block = tl.minimum((target.to(tl.int32) // BLOCK) * BLOCK, v_main)
        for v0 in range(0, t_block, BLOCK):
            _y, m, s, a, s2, y_sum = fold_full_block(z_row, b_ptr, v0, offs, m, s, a, s2, y_sum, c, softcap,
                                                     HAS_BIAS, SOFTCAP, HAS_SQ, HAS_SUM)
        y_before = m
        after = t_block
        if t_block < v_main:
            y, m, s, a, s2, y_sum = fold_full_block(z_row, b_ptr, t_block, offs, m, s, a, s2, y_sum, c, softcap,
                                                    HAS_BIAS, SOFTCAP, HAS_SQ, HAS_SUM)
            y_before = tl.maximum(y_before, tl.max(tl.where(t_block + offs < target, y, float("-inf")), axis=1))
            after = t_block + BLOCK
        for v0 in range(after, v_main, BLOCK):
            _y, m, s, a, s2, y_sum = fold_full_block(z_row, b_ptr, v0, offs, m, s, a, s2, y_sum, c, softcap,
                                                     HAS_BIAS, SOFTCAP, HAS_SQ, HAS_SUM)
    else:
        for v0 in range(0, v_main, BLOCK):
            _y, m, s, a, s2, y_sum = fold_full_block(z_row, b_ptr, v0, offs, m, s, a, s2, y_sum, c, softcap,
                                                     HAS_BIAS, SOFTCAP, HAS_SQ, HAS_SUM)
    cols = v_main + offs
    ok = cols < V
    x = tl.load(z_row + cols, mask=ok, other=float("-inf"))
    if HAS_BIAS:
        x += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        # Why the select: the cap maps the masked lanes' -inf to -softcap, a finite logit that would count in the
        # sum; they must keep weight 0.
        x = tl.where(ok, soft_cap(x, softcap, SOFTCAP), float("-inf"))
    if HAS_SQ:
        m, s, a, s2 = lane_fold_sq(x, m, s, a, s2, c)
    else:
        m, s, a = lane_fold(x, m, s, a, c)
    if HAS_SUM:
        y_sum += tl.where(ok, x, 0.0)
    if HAS_TOP1:
        # the tail is the last block: no block after it, and every column before the target is a valid one
        y_before = tl.maximum(y_before, tl.max(tl.where(cols < target, x, float("-inf")), axis=1))
    m_row, s_row, a_row = lanes_to_row(m, s, a, c)
    s2_row = 0.0
    if HAS_SQ:
        s2_row = lanes_sq_to_row(m, s2, c)
    lse, ent = row_lse_entropy(m_row, s_row, a_row, inv_temperature)
    return lse, ent, s_row, s2_row, tl.sum(tl.sum(y_sum, axis=1), axis=0), m_row, tl.max(y_before, axis=0)


@triton.jit
def fold_full_block(z_row, b_ptr, v0, offs, m, s, a, s2, y_sum, c, softcap, HAS_BIAS: tl.constexpr,
                    SOFTCAP: tl.constexpr, HAS_SQ: tl.constexpr, HAS_SUM: tl.constexpr):
    """Fold the full block of the row at column v0 into the lanes' statistics (``head_row_stats``); returns its capped
    logits y with (m, s, a, s2, y_sum)."""
    x = tl.load(z_row + v0 + offs)
    if HAS_BIAS:
        x += tl.load(b_ptr + v0 + offs).to(tl.float32)
    y = soft_cap(x, softcap, SOFTCAP)
    if HAS_SQ:
        m, s, a, s2 = lane_fold_sq(y, m, s, a, s2, c)
    else:
        m, s, a = lane_fold(y, m, s, a, c)
    if HAS_SUM:
        y_sum += y
    return y, m, s, a, s2, y_sum


@triton.jit
def store_extras(sq_ptr, mean_ptr, top1_ptr, tok, logp, z_t, s_row, s2_row, y_sum, m_row, y_before, V,
                 inv_temperature, HAS_SQ: tl.constexpr, HAS_SUM: tl.constexpr, HAS_TOP1: tl.constexpr):
    """A token's extra outputs from ``head_row_stats`` (z_t: its target's z): log sum p^2 = log s2 - 2 log s; the mean
    of z = (sum y) / T / V; is_top1 = z_t >= max z and z_t > max z before the target (TRL's rule: the first maximum
    wins), compared in z (y / T rounded: a tie in z is a tie, as TRL sees it), False where logp is NaN."""
    if HAS_SQ:
        tl.store(sq_ptr + tok, tl.log(s2_row) - 2.0 * tl.log(s_row))
    if HAS_SUM:
        tl.store(mean_ptr + tok, y_sum * inv_temperature / V)
    if HAS_TOP1:
        top1 = (z_t >= m_row * inv_temperature) & (z_t > y_before * inv_temperature) & (logp == logp)
        tl.store(top1_ptr + tok, top1)


@triton.jit
def target_logit(z_row, b_ptr, target, ok, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The capped logit soft_cap(x + b) of column ``target``, before the temperature (0 where ``ok`` is false)."""
    x = tl.load(z_row + target, mask=ok, other=0.0)
    if HAS_BIAS:
        x += tl.load(b_ptr + target, mask=ok, other=0.0).to(tl.float32)
    return soft_cap(x, softcap, SOFTCAP)


def extra_outputs(N: int, device, extras) -> tuple:
    """(log_sum_sq_probs fp32 | None, mean_logits fp32 | None, is_top1 bool | None), (N,) each, for a
    ``config.TokenExtras``."""
    return (alloc((N,), torch.float32, device) if extras.log_sum_sq_probs else None,
            alloc((N,), torch.float32, device) if extras.mean_logits else None,
            alloc((N,), torch.bool, device) if extras.is_top1 else None)
