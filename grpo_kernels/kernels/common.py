"""The @triton.jit helpers every kernel module shares, defined once: the fast ``exp2``, the soft cap, the one
online logsumexp of the row sweeps (docs/kernels.md). Their host-side counterparts (the GPU-generation table, launch
arguments, tensor layouts) are in ``host.py``.

- ``exp2``: ``ex2.approx.ftz.f32`` (one MUFU instruction) in compiled code; Triton's ``tl.exp2`` lowers to the
  non-FTZ form, four instructions with its denormal rescaling. Flushing a result below 2^-126 to 0 changes no
  logsumexp (the row maximum contributes 1 to the sum).
- ``soft_cap`` / ``soft_cap_grad``: the logit soft cap ``c tanh(x / c)`` and its derivative, the one Triton
  definition (``reference.soft_cap`` is the PyTorch one); a constexpr flag compiles them away when off.
  ``soft_cap`` first rounds the raw fp32 logit to bf16 / fp16 when the flag says so (``round_logit``, the
  sampler's recipe, docs/numerics.md "Rounding the logits"); the backward takes the rounding as the identity.
- ``lane_fold`` / ``lanes_to_row``: the online logsumexp + entropy statistics in base-2 units, kept per lane
  (one running max, sum and entropy sum per row of a ``(lanes, k)`` tile, all inside one thread) and combined
  across lanes once per row. Used by the logits sweeps, the head epilogue and the fused-linear forward's tiles.
"""
from __future__ import annotations

from .._triton import import_triton, interpreting

triton, tl = import_triton()


# ---------------------------------------------------------------------------------------------- Triton helpers

# Why a module constant: inline PTX cannot run in the interpreter, which gets tl.exp2 (exact there anyway).
FAST_EXP2 = tl.constexpr(not interpreting())
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
# Floor of a base-2 exponent in the entropy products: 2^-1e4 is 0, and 0 * -1e4 is 0 where 0 * -inf is NaN.
EXP2_FLOOR = tl.constexpr(-1.0e4)


@triton.jit
def exp2(x):
    """2^x in fp32, results below 2^-126 flushed to 0 (one MUFU.EX2 compiled); 2^-inf = 0, 2^NaN = NaN."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return tl.exp2(x)


@triton.jit
def rcp(x):
    """1 / x in fp32 (``rcp.approx.ftz.f32``, one MUFU instruction compiled: a relative error of ~1 ulp, which the
    soft cap's ``tanh`` needs no better than); 1 / inf = 0."""
    if FAST_EXP2:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return 1.0 / x


# The SOFTCAP constexpr every kernel takes is the logits transform's switch (``host.cap_args``): False / True (cap off /
# on) when the raw logits are not rounded, the same kernels as without the rounding option; with it an int, CAP_ON |
# ROUND_BF16 or CAP_ON | ROUND_FP16 (bits 1, 2, 4). Why one constexpr and not two: every kernel and helper already
# carries it to each place a raw logit is transformed, so the rounding reaches them all with no signature changed.
# Why the bits are literals in the tests below: the interpreter passes SOFTCAP as a plain bool, which cannot be
# combined with a tl.constexpr global.
# Why by hand under the interpreter: its fp32 -> bf16 cast truncates (docs/DESIGN.md section 6, ``to_input_dtype``);
# compiled code casts with cvt.rn.
ROUND_BY_HAND = tl.constexpr(interpreting())


@triton.jit
def round_logit(x, SOFTCAP: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even to bf16 / fp16 and back (x itself, no instruction, unless SOFTCAP says so).
    NaN stays NaN, +-inf stays +-inf, a value past the format's largest rounds to +-inf, as a real cast does."""
    if SOFTCAP & 2:  # ROUND_BF16
        if ROUND_BY_HAND:
            # Why the select: adding the rounding bias to a NaN's bits can carry into an inf (or wrap to 0).
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
            return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))
        else:
            return x.to(tl.bfloat16).to(tl.float32)
    elif SOFTCAP & 4:  # ROUND_FP16
        # numpy's (the interpreter's) fp32 -> fp16 cast rounds to nearest-even, as cvt.rn does.
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def soft_cap(x, softcap, SOFTCAP: tl.constexpr):
    """The soft cap of fp32 logits, ``softcap * tanh(x / softcap)`` (x itself when SOFTCAP is off: no instruction),
    of x first rounded to bf16 / fp16 when SOFTCAP says so (``round_logit``).

    Why ``c - 2c / (2^(2 x log2(e) / c) + 1)``: one MUFU.EX2, one MUFU.RCP and three FMA-class instructions per
    element, exact at both ends (x = +inf gives c, x = -inf gives -c, as torch's tanh) and NaN for NaN; its absolute
    error near 0 is ~c 2^-22, far below what a bf16 logit carries. The caller keeps masked-out entries at -inf
    after the cap where a sweep needs them there (they would otherwise be -c)."""
    x = round_logit(x, SOFTCAP)
    if SOFTCAP & 1:  # CAP_ON
        e = exp2(x * ((2.0 * LOG2E) / softcap))
        return softcap - (2.0 * softcap) * rcp(e + 1.0)
    else:
        return x


@triton.jit
def soft_cap_grad(dz, capped, softcap, SOFTCAP: tl.constexpr):
    """d loss / d raw logit from d loss / d capped logit: ``dz (1 - (capped / softcap)^2)`` (dz when SOFTCAP is
    off). Two instructions per element; the capped value is recomputed by ``soft_cap``, never stored. The rounding
    of ``soft_cap`` has derivative 1 here (straight-through, as autograd's cast): d raw logit = d rounded logit."""
    if SOFTCAP & 1:  # CAP_ON
        t = capped * (1.0 / softcap)
        return dz * (1.0 - t * t)
    else:
        return dz


@triton.jit
def lane_fold_terms(x, m, s, a, c):
    """``lane_fold``'s statistics (m, s, a) and the terms it formed them from: alpha = 2^((m_old - m) c) (lanes,)
    and e = 2^u (lanes, k), for the folds that add sums of their own (``lane_fold_sq``)."""
    m_new = tl.maximum(m, tl.max(x, axis=1))
    # Why the reference point: a lane that has seen only -inf keeps weight 0 with no -inf - -inf = NaN.
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    shift = (m - ref) * c  # -inf for a lane that was empty: alpha = 0, and its s, a are 0
    alpha = exp2(shift)
    u = (x - ref[:, None]) * c
    e = exp2(u)
    # Why select the shift before the product: an empty lane has shift -inf and s 0, and (-inf) * 0 is NaN even
    # where it would be selected away (the interpreter's numpy warns on it); a lane with s > 0 has a finite shift.
    a = alpha * (a + tl.where(s > 0.0, shift, 0.0) * s) + tl.sum(e * tl.maximum(u, EXP2_FLOOR), axis=1)
    s = alpha * s + tl.sum(e, axis=1)
    return m_new, s, a, alpha, e


@triton.jit
def lane_fold(x, m, s, a, c):
    """Fold a (lanes, k) fp32 tile ``x`` of raw logits into per-lane statistics (lanes,): running max ``m`` of x,
    ``s = sum 2^u`` and ``a = sum 2^u u`` with ``u = (x - m) c`` (``c = log2(e) / temperature > 0``).

    Why per lane: a lane's k values sit in one thread, so the max and sums here are register ops; the lanes are
    combined once per row (``lanes_to_row``), never per block. Per element: max, subtract, multiply, MUFU, add,
    clamp, FFMA. Why ``(x - m) c`` and not one FFMA ``x c - m c``: the difference is exact near the maximum (the
    maximum itself gets weight exactly 1), whatever the magnitude of x / temperature.
    Masked-out entries must hold -inf (weight 0); a NaN in x makes s NaN. Start from m = -inf, s = a = 0."""
    m_new, s, a, _alpha, _e = lane_fold_terms(x, m, s, a, c)
    return m_new, s, a


@triton.jit
def lane_fold_sq(x, m, s, a, s2, c):
    """``lane_fold`` plus ``s2 = sum 2^(2u) = sum e^2`` per lane (start from 0), rescaled by alpha^2 as s is by
    alpha: ``log sum p^2 = log s2 - 2 log s`` in natural units (2^(2u) = e^(2 (z - m))). Per element one FFMA more;
    e^2 below 2^-126 flushes to 0, as e does (the row maximum contributes 1 to s2)."""
    m_new, s, a, alpha, e = lane_fold_terms(x, m, s, a, c)
    return m_new, s, a, alpha * alpha * s2 + tl.sum(e * e, axis=1)


@triton.jit
def lanes_to_row(m, s, a, c):
    """(max, sum, entropy sum) of a row from its lanes' ``lane_fold`` statistics, re-centred on the row max."""
    m_row = tl.max(m, axis=0)
    ref = tl.where(m_row == float("-inf"), 0.0, m_row)
    shift = (m - ref) * c
    w = exp2(shift)
    s_row = tl.sum(w * s, axis=0)
    a_row = tl.sum(w * (a + tl.where(s > 0.0, shift, 0.0) * s), axis=0)  # shift selected first: lane_fold_terms
    return m_row, s_row, a_row


@triton.jit
def lanes_sq_to_row(m, s2, c):
    """The row's ``s2`` of ``lane_fold_sq`` from its lanes', re-centred on the row max (weights squared)."""
    m_row = tl.max(m, axis=0)
    ref = tl.where(m_row == float("-inf"), 0.0, m_row)
    w = exp2((m - ref) * c)
    return tl.sum(w * w * s2, axis=0)


@triton.jit
def row_lse_entropy(m_row, s_row, a_row, inv_temperature):
    """(logsumexp, entropy) of ``z = x / temperature`` from ``lanes_to_row``'s statistics (natural log)."""
    log_s = tl.log(s_row)
    lse = tl.where(m_row == float("-inf"), 0.0, m_row) * inv_temperature + log_s
    return lse, log_s - LN2 * a_row / s_row


@triton.jit
def dlogits_values(x, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD: tl.constexpr):
    """d logits (fp32) of raw logits ``x`` off the target column: -g' p, minus the entropy term when present.
    Per element: FFMA, FMUL, MUFU, FMUL (+ clamp and FFMA for the entropy term).

    Why ``x / T - lse`` before the base-2 scale, not ``x c - lse log2(e)`` in one FFMA: lse holds the rounded
    ``max / T``, so the difference cancels exactly at the row maximum (p = 1 where only the target is finite, and
    no 1e-4 relative error at temperature 1e-3, where x / T is in the thousands)."""
    u = (x * inv_temperature - lse) * LOG2E
    p = exp2(u)
    if HAS_ENTROPY_GRAD:
        # Why the clamp: p = 0 at a -inf logit, and 0 * -inf would be NaN.
        return p * (coef_b + coef_a * tl.maximum(u, EXP2_FLOOR))
    else:
        return p * coef_b
