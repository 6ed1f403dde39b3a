"""Triton kernel of the per-token GRPO terms: ratio, clipping, KL, per-token loss, its derivative and metrics.

It replaces ~40 small eager launches of ``reference.loss_from_logps`` on B x T tensors by one pass, for the
configurations whose per-token loss needs no cross-token statistic (token-level ratios; no off-policy or entropy
mask; not vespo). Reduction weights ``w`` (mask and the loss type's normalizer) are computed beforehand, so the
kernel returns the per-token gradient ``G = w * d l / d logp`` and per-block partial sums that the caller adds
up in a fixed order (deterministic, no atomics).
"""
from __future__ import annotations

import torch

from .._checks import alloc
from .._triton import import_triton
from .host import cdiv, row_col_strides
from .launch import launch
from .token_terms import token_terms

BLOCK = 1024
N_SUMS = 6  # sum w*l, sum m*kl, sum m*low, sum m*high, sum m*region, sum m*cispo_clipped

from ..loss_types import POLICY_TERMS

# The KIND constexpr: the policy term's index in the loss-type table (grpo_kernels/loss_types.py).
KIND_CLIPPED, KIND_CISPO, KIND_SAPO = (POLICY_TERMS.index(p) for p in ("clipped", "cispo", "sapo"))


triton, tl = import_triton()


# Why do_not_specialize: a new batch shape must not compile a new variant (T == 1, T % 16).
@triton.jit(do_not_specialize=["N", "T", "adv_stride_b", "adv_stride_t", "is_stride_b", "is_stride_t"])
def token_loss_fwd(logp_ptr, old_ptr, ref_ptr, adv_ptr, is_ptr, mask_ptr, w_ptr, grad_ptr, partial_ptr,
                   N, T, adv_stride_b, adv_stride_t, is_stride_b, is_stride_t,
                   eps_low, eps_high, delta, beta, sapo_t_pos, sapo_t_neg,
                   KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS: tl.constexpr,
                   HAS_DELTA: tl.constexpr, USE_BETA: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
                   BLOCK: tl.constexpr):
    # Why a 1-D block of tokens per program: every term is elementwise given the precomputed weights.
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < N
    b = offs // T
    t = offs % T
    logp = tl.load(logp_ptr + offs, mask=valid, other=0.0)
    m = tl.load(mask_ptr + offs, mask=valid, other=0.0)
    w = tl.load(w_ptr + offs, mask=valid, other=0.0)
    adv = tl.load(adv_ptr + b * adv_stride_b + t * adv_stride_t, mask=valid, other=0.0)
    old = logp
    ref = logp
    isr = logp
    if HAS_OLD:
        old = tl.load(old_ptr + offs, mask=valid, other=0.0)
    if HAS_REF:
        ref = tl.load(ref_ptr + offs, mask=valid, other=0.0)
    if HAS_IS:
        isr = tl.load(is_ptr + b * is_stride_b + t * is_stride_t, mask=valid, other=0.0)
    policy, d_policy, kl, rho, rho1 = token_terms(logp, old, ref, adv, isr, eps_low, eps_high, delta, beta,
                                                  sapo_t_pos, sapo_t_neg, KIND, HAS_OLD, HAS_REF, HAS_IS,
                                                  HAS_DELTA, USE_BETA, BIAS_CORRECTION)
    # Why `keep`: padded tokens may hold anything (exp overflow to inf); 0 * inf must not leak a NaN.
    keep = valid & (m != 0.0)
    tl.store(grad_ptr + offs, tl.where(keep, w * d_policy, 0.0), mask=valid)

    # Per-block partial sums for the loss and the metrics; the caller sums blocks in order.
    low = tl.where((rho1 < 1.0 - eps_low) & (adv < 0), 1.0, 0.0)
    high = tl.where((rho1 > 1.0 + eps_high) & (adv > 0), 1.0, 0.0)
    region = tl.maximum(low, high)
    cispo_clipped = tl.where((rho > eps_high) & (adv > 0), 1.0, 0.0)
    base = partial_ptr + pid * 6
    tl.store(base + 0, tl.sum(tl.where(keep, w * policy, 0.0), axis=0))
    tl.store(base + 1, tl.sum(tl.where(keep, m * kl, 0.0), axis=0))
    tl.store(base + 2, tl.sum(tl.where(keep, m * low, 0.0), axis=0))
    tl.store(base + 3, tl.sum(tl.where(keep, m * high, 0.0), axis=0))
    tl.store(base + 4, tl.sum(tl.where(keep, m * region, 0.0), axis=0))
    tl.store(base + 5, tl.sum(tl.where(keep, m * cispo_clipped, 0.0), axis=0))


def token_loss_forward(logps, tokens, cfg, kind: int):
    """Per-token terms for (B, T) fp32 log-probs and their ``inputs.LossTokens``. Returns (grad (B, T) =
    w * dl/dlogp, sums (N_SUMS,) fp64 in block order)."""
    B, T = logps.shape
    N = B * T
    mask_f, weights = tokens.mask_f, tokens.weights
    old_logps, ref_logps = tokens.old_logps, tokens.ref_logps
    adv, adv_sb, adv_st = row_col_strides(tokens.advantages, B, T)
    isr, is_sb, is_st = row_col_strides(tokens.is_ratio, B, T)
    n_blocks = max(cdiv(N, BLOCK), 1)
    grad = alloc((B, T), torch.float32, logps.device)
    partial = alloc((n_blocks, N_SUMS), torch.float32, logps.device)
    old = None if old_logps is None else old_logps.float().contiguous()
    ref = None if ref_logps is None else ref_logps.float().contiguous()
    logp = logps.float().contiguous()
    launch(token_loss_fwd, (n_blocks,), logp, old if old is not None else logp, ref if ref is not None else logp,
           adv, isr if isr is not None else logp, mask_f, weights, grad, partial,
           N, T, adv_sb, adv_st, is_sb, is_st,
           float(cfg.epsilon_low), float(cfg.epsilon_high), float(cfg.delta or 0.0), float(cfg.beta),
           float(cfg.sapo_temperature_pos), float(cfg.sapo_temperature_neg),
           KIND=kind, HAS_OLD=old is not None, HAS_REF=ref is not None, HAS_IS=isr is not None,
           HAS_DELTA=cfg.delta is not None, USE_BETA=cfg.beta != 0.0,
           BIAS_CORRECTION=cfg.use_bias_correction_kl, BLOCK=BLOCK, num_warps=4)
    return grad, partial.double().sum(0)


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the launcher above on small CPU tensors, once per policy
    kind without and with every optional input."""
    from ..config import GRPOLossConfig
    from ..inputs import LossTokens

    def scenario(kind, full):
        def thunk():
            x = torch.zeros(4, 8)
            cfg = GRPOLossConfig(beta=0.04 if full else 0.0, delta=1.5 if full else None)
            tokens = LossTokens(torch.zeros(4), x, x, x if full else None, x if full else None,
                                x if full else None)
            token_loss_forward(x, tokens, cfg, kind)
        return thunk

    return [(f"token_loss_{name}_{'all_options' if full else 'plain'}", scenario(kind, full))
            for kind, name in ((KIND_CLIPPED, "clipped"), (KIND_CISPO, "cispo"), (KIND_SAPO, "sapo"))
            for full in (False, True)]
