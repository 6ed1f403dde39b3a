"""The GRPO loss over given logits with its gradient written by the forward kernel (``grad_in_forward``), and the
backward's scaling of that gradient by the incoming one.

For every configuration where ``loss_types.per_token_gradient_known`` holds, a token's gradient
``g = w * d l / d logp`` is known as soon as its row's logsumexp is (the reduction weights ``w`` come precomputed
on B x T), and so is the entropy bonus's ``g_h = -entropy_coef * mask / n_valid``. So one kernel sweeps the row for
logsumexp and entropy, evaluates the per-token terms (``token_terms``, the one Triton definition of the maths),
then sweeps the row again writing ``d logits = (g (onehot - p) - g_h p (log p + H)) / temperature``, into the
logits buffer itself (in place) or a new one. Three passes over HBM (read forward, read + write backward) become
one read and one write when the second sweep hits L2: programs are persistent, one per SM, fewer where that many
rows would not fit the device's L2 (``rows_in_flight``: the planner's choice, stated by ``explain``), and the second
sweep runs the row backwards. Each row also writes its loss and metric
terms; the caller sums them in a fixed order (deterministic, no atomics). A soft cap (``transform.softcap``) is applied to
every logit the two sweeps read and to the target's, in registers (``logits_rows``); its value is a runtime argument.

Layout as ``logits_kernels``: any batch/time strides, unit vocab stride, a 1-D grid, int64 offsets, fp32 maths.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import alloc
from .._triton import import_triton
from .launch import launch
from .._testing import knobs
from .common import soft_cap
from .host import as_btv, cap_args, dlogits_result, l2_bytes, num_sms, row_col_strides
from .logits_rows import row_logsumexp_entropy, row_tiles, tiles, vec_for, write_row_dlogits
from .token_loss_kernels import KIND_CISPO, KIND_CLIPPED, KIND_SAPO
from .token_terms import token_terms_at

# Per-row terms: w*l, m*kl, m*low, m*high, m*region, m*cispo_clipped (token_loss_kernels' sums), then m*entropy.
N_TERMS = 7
# 32-bit registers per SM on sm_80 and sm_90 (and per-thread limit).
REGISTERS_PER_SM, MAX_THREAD_REGISTERS = 65536, 255

triton, tl = import_triton()


# Why these are not specialized: a new batch shape or broadcast layout must not compile a new variant; V keeps its
# divisibility-by-16 class for the vectorized sweeps (logits_rows).
@triton.jit(do_not_specialize=["N", "T", "adv_stride_b", "adv_stride_t", "is_stride_b", "is_stride_t"])
def logits_loss_grad_in_forward(logits_ptr, dlogits_ptr, ids_ptr, mask_ptr, w_ptr, old_ptr, ref_ptr, adv_ptr,
                                is_ptr, h_scale_ptr, terms_ptr,
                                N, T, V, stride_b, stride_t, out_stride_b, out_stride_t,
                                adv_stride_b, adv_stride_t, is_stride_b, is_stride_t,
                                inv_temperature, eps_low, eps_high, delta, beta, sapo_t_pos, sapo_t_neg, softcap,
                                SOFTCAP: tl.constexpr, KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr,
                                HAS_IS: tl.constexpr, HAS_DELTA: tl.constexpr, USE_BETA: tl.constexpr,
                                BIAS_CORRECTION: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
                                BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    # Why softcap is the last runtime argument: the kernel without a cap keeps its parameter layout, hence its SASS.
    # Why persistent programs striding over rows: few rows in flight (one per program) keep each row in L2
    # between its two sweeps; consecutive programs take consecutive rows.
    h_scale = 0.0
    if HAS_ENTROPY_GRAD:
        h_scale = tl.load(h_scale_ptr)
    pid = tl.program_id(0).to(tl.int64)
    n_prog = tl.num_programs(0).to(tl.int64)
    for i in range(0, tl.cdiv(N - pid, n_prog)):
        row = pid + i * n_prog
        b = row // T
        t = row % T
        m = tl.load(mask_ptr + row)
        # Why `keep`: padded tokens read no logits; their d logits are written as zeros.
        keep = m != 0.0
        base = logits_ptr + b * stride_b + t * stride_t
        lse, h = row_logsumexp_entropy(base, V, keep, inv_temperature, softcap, SOFTCAP, BLOCK_V, VEC,
                                       "evict_last")
        target = tl.load(ids_ptr + row)
        # Why the raw target logit is kept in a register: in place, the second sweep overwrites it in memory.
        z_target = tl.load(base + target, mask=keep, other=0.0).to(tl.float32)
        # Why the barrier: a fast warp's second sweep may store the target's block while a slow warp has yet to read
        # it; every thread's read must be performed before any thread stores (bar.sync orders memory across the
        # block like a membar.cta). Once per row, outside the sweep loops.
        tl.debug_barrier()
        logp = soft_cap(z_target, softcap, SOFTCAP) * inv_temperature - lse
        w = tl.load(w_ptr + row)
        adv = tl.load(adv_ptr + b * adv_stride_b + t * adv_stride_t)
        policy, d_policy, kl, rho, rho1 = token_terms_at(logp, old_ptr, ref_ptr, is_ptr, row,
                                                         b * is_stride_b + t * is_stride_t, adv, eps_low, eps_high,
                                                         delta, beta, sapo_t_pos, sapo_t_neg, KIND, HAS_OLD,
                                                         HAS_REF, HAS_IS, HAS_DELTA, USE_BETA, BIAS_CORRECTION)
        # Why where and not a product: padded tokens may hold anything (inf), 0 * inf must not leak a NaN.
        g = tl.where(keep, w * d_policy, 0.0)
        g_h = tl.where(keep, h_scale * m, 0.0)
        write_row_dlogits(base, dlogits_ptr + b * out_stride_b + t * out_stride_t, V, keep, target, z_target, lse, h,
                          g, g_h, inv_temperature, softcap, SOFTCAP, HAS_ENTROPY_GRAD, BLOCK_V, VEC)

        low = tl.where((rho1 < 1.0 - eps_low) & (adv < 0), 1.0, 0.0)
        high = tl.where((rho1 > 1.0 + eps_high) & (adv > 0), 1.0, 0.0)
        out = terms_ptr + row * 7
        tl.store(out + 0, tl.where(keep, w * policy, 0.0))
        tl.store(out + 1, tl.where(keep, m * kl, 0.0))
        tl.store(out + 2, tl.where(keep, m * low, 0.0))
        tl.store(out + 3, tl.where(keep, m * high, 0.0))
        tl.store(out + 4, tl.where(keep, m * tl.maximum(low, high), 0.0))
        tl.store(out + 5, tl.where(keep, m * tl.where((rho > eps_high) & (adv > 0), 1.0, 0.0), 0.0))
        tl.store(out + 6, tl.where(keep, m * h, 0.0))


@triton.jit(do_not_specialize=["T"])
def scale_dlogits(dlogits_ptr, scale_ptr, mask_ptr, T, V, stride_b, stride_t, BLOCK_V: tl.constexpr):
    # Why a kernel that may do nothing: the incoming gradient is usually exactly 1 (the loss is the root); reading
    # it on the device skips the pass without a host sync. Padded rows hold exact zeros, which a finite scale keeps.
    s = tl.load(scale_ptr)
    row = tl.program_id(0).to(tl.int64)
    m = tl.load(mask_ptr + row)
    if (s != 1.0) & ((m != 0.0) | (tl.abs(s) == float("inf")) | (s != s)):
        base = dlogits_ptr + (row // T) * stride_b + (row % T) * stride_t
        cols = tl.arange(0, BLOCK_V)
        n_full = (V // BLOCK_V) * BLOCK_V
        for start in range(0, n_full, BLOCK_V):
            v = tl.multiple_of(start, BLOCK_V) + cols
            tl.store(base + v, (tl.load(base + v).to(tl.float32) * s).to(dlogits_ptr.dtype.element_ty))
        if n_full < V:
            v = n_full + cols
            x = tl.load(base + v, mask=v < V, other=0.0).to(tl.float32)
            tl.store(base + v, (x * s).to(dlogits_ptr.dtype.element_ty), mask=v < V)


# Rows in flight may fill at most this fraction of L2: the margin holds what else streams through it (the d-logits
# stores, the per-token terms) and absorbs the cache's set conflicts. Fewer programs than SMS_FLOOR of the SMs are not
# worth it: below half the SMs a sweep loses more bandwidth than the second sweep's re-read from DRAM costs
# (estimates: docs/kernels.md "Rows in flight", measured by benchmarks/gpu_check.sh).
L2_FRACTION = 0.8
SMS_FLOOR = 0.5


@dataclass(frozen=True)
class RowsInFlight:
    """The persistent kernel's grid: ``programs`` rows in flight (one per program), of ``row_bytes`` each, against
    an L2 of ``l2_bytes``; ``fits``: they stay within ``L2_FRACTION`` of it, so each row's second sweep reads L2."""

    programs: int
    row_bytes: int
    l2_bytes: int
    fits: bool

    @property
    def dram_bytes_per_row(self) -> int:
        """Expected DRAM traffic per row: one read and one d-logits write when the row stays in L2 between its two
        sweeps, one more read otherwise."""
        return (2 if self.fits else 3) * self.row_bytes


def rows_in_flight(N: int, V: int, dtype: torch.dtype, device: torch.device) -> RowsInFlight:
    """How many rows the gradient-in-forward kernel keeps in flight: one program per SM (the tile table's programs
    per SM), fewer when that many rows would not fit ``L2_FRACTION`` of the device's L2 (queried, with the
    generation table as fallback), never fewer than ``SMS_FLOOR`` of the SMs, never more than N."""
    t = row_tiles("grad_in_forward", dtype, V, device)
    sms, l2, row = num_sms(device), l2_bytes(device), V * dtype.itemsize
    full = max(1, t.programs_per_sm) * sms
    fit = int(L2_FRACTION * l2) // max(row, 1)
    programs = max(min(full, fit), max(1, int(SMS_FLOOR * sms)))
    programs = min(full, knobs().logits_programs or programs)
    return RowsInFlight(min(N, programs), row, l2, programs * row <= L2_FRACTION * l2)


def grad_in_forward(logits, ids, tokens, h_scale, cfg, transform, kind: int, inplace: bool, programs: int = 0):
    """One sweep pair per row: returns (d logits shaped like ``logits`` for a loss scaled by 1, per-row terms
    (B*T, N_TERMS) fp32). ``tokens``: an ``inputs.LossTokens`` (mask, weights, advantages, old / reference
    log-probs, importance weight); ``h_scale`` a one-element fp32 tensor
    ``-entropy_coef / max(n_valid, 1)`` or None; ``cfg`` the loss options (the policy's hyper-parameters);
    ``transform`` the logits transform (``config.LogitTransform``: temperature, soft cap); ``kind`` the policy term's
    index. With ``inplace`` the d logits overwrite the logits buffer, any non-overlapping view of it (through a
    private copy, copied back, only when the vocab dim is strided). programs: the rows in flight the plan chose
    (``rows_in_flight``; 0: chosen here the same way)."""
    x = as_btv(logits)
    B, T, V = x.shape
    N = B * T
    out = x if inplace else alloc((B, T, V), x.dtype, x.device)
    terms = alloc((N, N_TERMS), torch.float32, x.device)
    mask_f, weights = tokens.mask_f, tokens.weights
    adv, adv_sb, adv_st = row_col_strides(tokens.advantages, B, T)
    isr, is_sb, is_st = row_col_strides(tokens.is_ratio, B, T)
    old = None if tokens.old_logps is None else tokens.old_logps.float().contiguous()
    ref = None if tokens.ref_logps is None else tokens.ref_logps.float().contiguous()
    if N:
        cfg_t = tiles("grad_in_forward", x)
        grid = (min(N, programs or rows_in_flight(N, V, x.dtype, x.device).programs),)
        # Why a register cap at the program's share of the register file: with one resident program per SM, more
        # registers cost no occupancy, but left to itself ptxas targets 64 per thread at 16 warps and spilled there
        # (Triton 3.6, sm_80, bf16 / fp16 with every option and the soft cap: 4-8 B). The cap states the budget.
        maxnreg = min(MAX_THREAD_REGISTERS,
                      REGISTERS_PER_SM // (32 * cfg_t.num_warps * max(1, cfg_t.programs_per_sm)))
        launch(logits_loss_grad_in_forward, grid, x, out, ids.reshape(N).contiguous(), mask_f, weights,
               old if old is not None else weights, ref if ref is not None else weights, adv,
               isr if isr is not None else weights, h_scale if h_scale is not None else weights, terms,
               N, T, V, x.stride(0), x.stride(1), out.stride(0), out.stride(1), adv_sb, adv_st, is_sb, is_st,
               1.0 / transform.temperature, float(cfg.epsilon_low), float(cfg.epsilon_high),
               float(cfg.delta or 0.0), float(cfg.beta), float(cfg.sapo_temperature_pos),
               float(cfg.sapo_temperature_neg), **cap_args(transform.softcap, transform.round_logits), KIND=kind,
               HAS_OLD=old is not None,
               HAS_REF=ref is not None, HAS_IS=isr is not None,
               HAS_DELTA=cfg.delta is not None, USE_BETA=cfg.beta != 0.0,
               BIAS_CORRECTION=cfg.use_bias_correction_kl, HAS_ENTROPY_GRAD=h_scale is not None,
               BLOCK_V=cfg_t.block_v, VEC=vec_for(cfg_t.block_v, x.dtype), num_warps=cfg_t.num_warps,
               num_stages=cfg_t.num_stages, maxnreg=maxnreg)
    return dlogits_result(logits, x, out, inplace), terms


def scale_dlogits_(dlogits: torch.Tensor, scale: torch.Tensor, mask_f: torch.Tensor) -> torch.Tensor:
    """``dlogits *= scale`` in place (``scale`` a one-element tensor read on the device: nothing is read or written
    when it is 1, and padded rows (``mask_f`` 0, exact zeros) are skipped for a finite scale)."""
    x = as_btv(dlogits)
    B, T, V = x.shape
    if B * T:
        t = tiles("backward", x)
        launch(scale_dlogits, (B * T,), x, scale.reshape(1).float(), mask_f, T, V, x.stride(0), x.stride(1),
               BLOCK_V=t.block_v, num_warps=t.num_warps, num_stages=t.num_stages)
    return dlogits_result(dlogits, x, x, True)  # a strided vocab dim: the scaled copy is copied back


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the launchers above on small CPU tensors of the GPU shape class
    (V = 151936): bf16 with every option for each policy kind, plain bf16, and fp32 / fp16 with every option; the
    clipped ones also with the soft cap on (suffix _softcap: reported, not held to the budget of the others)."""
    from ..config import GRPOLossConfig
    from ..inputs import LossTokens

    def scenario(dtype, kind, full, softcap=None):
        def thunk():
            logits = torch.zeros(2, 3, 151936, dtype=dtype)
            bt = torch.zeros(2, 3)
            cfg = GRPOLossConfig(beta=0.04 if full else 0.0, delta=1.5 if full else None, softcap=softcap)
            tokens = LossTokens(torch.zeros(2), bt, bt, bt if full else None, bt if full else None,
                                bt if full else None)
            grad_in_forward(logits, torch.zeros(2, 3, dtype=torch.long), tokens, torch.zeros(1) if full else None,
                            cfg, cfg.transform, kind, inplace=True)
        return thunk

    names = {KIND_CLIPPED: "clipped", KIND_CISPO: "cispo", KIND_SAPO: "sapo"}
    scenarios = [(f"logits_loss_bf16_{names[k]}_all_options", scenario(torch.bfloat16, k, True)) for k in names]
    scenarios.append(("logits_loss_bf16_clipped_plain", scenario(torch.bfloat16, KIND_CLIPPED, False)))
    scenarios += [(f"logits_loss_bf16_clipped_{flags}_softcap", scenario(torch.bfloat16, KIND_CLIPPED, full, 30.0))
                  for flags, full in (("plain", False), ("all_options", True))]
    scenarios += [(f"logits_loss_{ty}_clipped_all_options{suffix}", scenario(dt, KIND_CLIPPED, True, cap))
                  for dt, ty in ((torch.float32, "fp32"), (torch.float16, "fp16")) for cap, suffix in ((None, ""),
                                                                                                      (30.0, "_softcap"))]
    for dt, ty in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        scenarios.append((f"logits_scale_{ty}", lambda dt=dt: scale_dlogits_(torch.zeros(2, 3, 151936, dtype=dt),
                                                                          torch.ones(1), torch.ones(2, 3))))
    return scenarios
