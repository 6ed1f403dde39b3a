"""The row sweeps of the two-head divergence's epilogue kernels (``distill_kernels.py``), @triton.jit helpers only
(inlined into the kernels that call them): both models' logits loaded and transformed, the online statistics of
sweep 1 (both logsumexps, the student's entropy sum, the KLs' gap sum), the JSD's sums of sweep 2, the gradient of
sweep 3, and the merge of two statistics (the vocabulary tiles of ``distill.light``).

Notation: y = soft_cap(scale * r(x + b)) per model (``model_logit``), c = log2(e) / T, u = y c; p = softmax(z_s),
q = softmax(z_t), z = y / T. Imported lazily with the kernel module (TRITON_INTERPRET set before the first launch
takes effect).
"""
from __future__ import annotations

from .._triton import import_triton
from .common import LN2, LOG2E, exp2, lane_fold_terms, lanes_to_row, round_logit, row_lse_entropy, soft_cap, \
    soft_cap_grad
from .linear_rows import lane_offsets
from .linear_tiles import to_input_dtype

triton, tl = import_triton()


@triton.jit
def model_logit(x, scale, softcap, CAP: tl.constexpr):
    """One model's y = soft_cap(scale * r(x)): r the rounding bits of CAP (``common.round_logit``), then the scale,
    then the cap (bit 1) before the temperature: TRL's order."""
    return soft_cap(round_logit(x, CAP) * scale, softcap, CAP & 1)


@triton.jit
def load_pair(s_row, t_row, bs_ptr, bt_ptr, cols, s_scale, s_cap, t_scale, t_cap, HAS_SB: tl.constexpr,
               HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr):
    """(y_student, y_teacher) at full-block columns ``cols`` (no mask: the main loops' 16-byte loads)."""
    xs = tl.load(s_row + cols)
    if HAS_SB:
        xs += tl.load(bs_ptr + cols).to(tl.float32)
    xt = tl.load(t_row + cols)
    if HAS_TB:
        xt += tl.load(bt_ptr + cols).to(tl.float32)
    return model_logit(xs, s_scale, s_cap, S_CAP), model_logit(xt, t_scale, t_cap, T_CAP)


@triton.jit
def load_pair_tail(s_row, t_row, bs_ptr, bt_ptr, cols, Vc, s_scale, s_cap, t_scale, t_cap, HAS_SB: tl.constexpr,
                    HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr):
    """(y_student, y_teacher, ok) at the tail's columns; past Vc the (finite) logits of a raw 0, which the callers
    give weight 0 (the fold: -inf there, ``tail_weights``), drop from their sums or do not store. Why finite values
    there: -inf - -inf would make NaN in the gap and JSD terms (harmless once dropped, but not computed at all)."""
    ok = cols < Vc
    xs = tl.load(s_row + cols, mask=ok, other=0.0)
    if HAS_SB:
        xs += tl.load(bs_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    xt = tl.load(t_row + cols, mask=ok, other=0.0)
    if HAS_TB:
        xt += tl.load(bt_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    return model_logit(xs, s_scale, s_cap, S_CAP), model_logit(xt, t_scale, t_cap, T_CAP), ok


@triton.jit
def tail_weights(y, ok):
    """The tail's logits for the online sums: -inf (weight 0) past Vc. Why after the transform: the cap maps a
    masked -inf to -cap, a finite logit that would count."""
    return tl.where(ok, y, float("-inf"))


@triton.jit
def fold_block(ys, yt, ds, dt, m_s, s_s, a_s, m_t, s_t, gap, c, MODE: tl.constexpr):
    """Fold a (lanes, k) block of both models' logits into the lanes' online statistics: the student's
    (``common.lane_fold``: max, sum, entropy sum of ys), the teacher's max and sum of yt, and for the KLs the gap sum
    in base-2 units, sum 2^u_t (dt - ds) c relative to the teacher's max (forward) or sum 2^u_s (ds - dt) c
    relative to the student's (reverse), u = y c. ds, dt: the logits the differences are taken of (ys, yt in full
    blocks; finite stand-ins past the tail's end, where the weights are 0). Why the select on the weight: a term of
    weight 0 (a -inf logit) adds 0, not 0 * inf = NaN; a NaN logit still reaches the sums through the weights."""
    m_s, s_s, a_s, alpha_s, e_s = lane_fold_terms(ys, m_s, s_s, a_s, c)
    m_new = tl.maximum(m_t, tl.max(yt, axis=1))
    ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha_t = exp2((m_t - ref) * c)
    e_t = exp2((yt - ref[:, None]) * c)
    s_t = alpha_t * s_t + tl.sum(e_t, axis=1)
    if MODE == 0:
        gap = alpha_t * gap + tl.sum(tl.where(e_t > 0.0, e_t * ((dt - ds) * c), 0.0), axis=1)
    elif MODE == 1:
        gap = alpha_s * gap + tl.sum(tl.where(e_s > 0.0, e_s * ((ds - dt) * c), 0.0), axis=1)
    return m_s, s_s, a_s, m_new, s_t, gap


@triton.jit
def lanes_weights(m, c):
    """(row max, each lane's weight 2^((m_lane - max) c)) to combine lanes re-centred on the row max."""
    m_row = tl.max(m, axis=0)
    ref = tl.where(m_row == float("-inf"), 0.0, m_row)
    return m_row, exp2((m - ref) * c)


@triton.jit
def fold_row(s_row, t_row, bs_ptr, bt_ptr, Vc, c, s_scale, s_cap, t_scale, t_cap, HAS_SB: tl.constexpr,
              HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr, MODE: tl.constexpr,
              BLOCK: tl.constexpr):
    """Sweep 1 over columns [0, Vc) of both rows: (m_s, s_s, a_s, m_t, s_t, gap) of the row, the student's max /
    sum / entropy sum and the teacher's max / sum in ``lane_fold``'s units, the gap sum as ``fold_block``."""
    LANE: tl.constexpr = 8 if (HAS_SB and bs_ptr.dtype.element_ty.primitive_bitwidth == 16) or \
        (HAS_TB and bt_ptr.dtype.element_ty.primitive_bitwidth == 16) else 4
    offs = lane_offsets(BLOCK, LANE)
    m_s = tl.full([BLOCK // LANE], float("-inf"), tl.float32)
    s_s = tl.zeros([BLOCK // LANE], tl.float32)
    a_s = tl.zeros([BLOCK // LANE], tl.float32)
    m_t = tl.full([BLOCK // LANE], float("-inf"), tl.float32)
    s_t = tl.zeros([BLOCK // LANE], tl.float32)
    gap = tl.zeros([BLOCK // LANE], tl.float32)
    v_main = (Vc // BLOCK) * BLOCK
    # Why an unmasked main loop and one masked tail: full blocks need no predicate, so loads are 16-byte vectors.
    for v0 in range(0, v_main, BLOCK):
        ys, yt = load_pair(s_row, t_row, bs_ptr, bt_ptr, v0 + offs, s_scale, s_cap, t_scale, t_cap, HAS_SB,
                            HAS_TB, S_CAP, T_CAP)
        m_s, s_s, a_s, m_t, s_t, gap = fold_block(ys, yt, ys, yt, m_s, s_s, a_s, m_t, s_t, gap, c, MODE)
    ys, yt, ok = load_pair_tail(s_row, t_row, bs_ptr, bt_ptr, v_main + offs, Vc, s_scale, s_cap, t_scale, t_cap,
                                HAS_SB, HAS_TB, S_CAP, T_CAP)
    m_s, s_s, a_s, m_t, s_t, gap = fold_block(tail_weights(ys, ok), tail_weights(yt, ok), ys, yt, m_s, s_s, a_s,
                                              m_t, s_t, gap, c, MODE)
    # Why the gap's lane weights are its model's: it is summed relative to that model's running max.
    if MODE == 0:
        _m, w_gap = lanes_weights(m_t, c)
    else:
        _m, w_gap = lanes_weights(m_s, c)
    m_tr, w_t = lanes_weights(m_t, c)
    m_sr, s_sr, a_sr = lanes_to_row(m_s, s_s, a_s, c)
    return m_sr, s_sr, a_sr, m_tr, tl.sum(w_t * s_t, axis=0), tl.sum(w_gap * gap, axis=0)


@triton.jit
def finish(m_s, s_s, a_s, m_t, s_t, gap, inv_temperature, MODE: tl.constexpr):
    """(lse_s, entropy, lse_t, KL) in natural units from a row's statistics; the KL of MODE 0 / 1 (0 for the
    JSD, whose sums need a second sweep): ln 2 gap / s - lse_(weight model) + lse_(other)."""
    lse_s, ent = row_lse_entropy(m_s, s_s, a_s, inv_temperature)
    lse_t = tl.where(m_t == float("-inf"), 0.0, m_t) * inv_temperature + tl.log(s_t)
    kl = 0.0
    if MODE == 0:
        kl = LN2 * gap / s_t - lse_t + lse_s
    elif MODE == 1:
        kl = LN2 * gap / s_s - lse_s + lse_t
    return lse_s, ent, lse_t, kl


@triton.jit
def log2_mix(ls, lt, log2_1mb, log2_b):
    """log2 m of m = (1 - beta) p + beta q from log2 p, log2 q: a log-sum-exp of two terms, exact where both are tiny
    (no underflow of m); -inf where both weights are 0."""
    a = ls + log2_1mb
    b = lt + log2_b
    hi = tl.maximum(a, b)
    lo = tl.minimum(a, b)
    return tl.where(hi == float("-inf"), float("-inf"), hi + tl.log2(1.0 + exp2(lo - hi)))


@triton.jit
def log2_probs(ys, yt, lse_s, lse_t, inv_temperature):
    """(log2 p, log2 q). Why ``y / T - lse`` before the base-2 scale: lse holds the rounded max / T, so the difference
    is exact at the row maximum (``common.dlogits_values``)."""
    return (ys * inv_temperature - lse_s) * LOG2E, (yt * inv_temperature - lse_t) * LOG2E


@triton.jit
def jsd_terms(ys, yt, lse_s, lse_t, inv_temperature, log2_1mb, log2_b):
    """Per element (p (log2 p - log2 m), q (log2 q - log2 m)), 0 where the weight is 0."""
    ls, lt = log2_probs(ys, yt, lse_s, lse_t, inv_temperature)
    lm = log2_mix(ls, lt, log2_1mb, log2_b)
    p = exp2(ls)
    q = exp2(lt)
    return tl.where(p == 0.0, 0.0, p * (ls - lm)), tl.where(q == 0.0, 0.0, q * (lt - lm))


@triton.jit
def jsd_row(s_row, t_row, bs_ptr, bt_ptr, Vc, lse_s, lse_t, inv_temperature, log2_1mb, log2_b, s_scale, s_cap,
             t_scale, t_cap, HAS_SB: tl.constexpr, HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr,
             BLOCK: tl.constexpr):
    """Sweep 2 (the JSD) over columns [0, Vc): (KL(p || m), KL(q || m)) in natural units. Why a flat block and
    block-shaped sums reduced once: nothing is reduced inside the loop."""
    offs = tl.arange(0, BLOCK)
    kl_p = tl.zeros([BLOCK], tl.float32)
    kl_q = tl.zeros([BLOCK], tl.float32)
    v_main = (Vc // BLOCK) * BLOCK
    for v0 in range(0, v_main, BLOCK):
        ys, yt = load_pair(s_row, t_row, bs_ptr, bt_ptr, v0 + offs, s_scale, s_cap, t_scale, t_cap, HAS_SB,
                            HAS_TB, S_CAP, T_CAP)
        tp, tq = jsd_terms(ys, yt, lse_s, lse_t, inv_temperature, log2_1mb, log2_b)
        kl_p += tp
        kl_q += tq
    ys, yt, ok = load_pair_tail(s_row, t_row, bs_ptr, bt_ptr, v_main + offs, Vc, s_scale, s_cap, t_scale, t_cap,
                                HAS_SB, HAS_TB, S_CAP, T_CAP)
    tp, tq = jsd_terms(ys, yt, lse_s, lse_t, inv_temperature, log2_1mb, log2_b)
    kl_p += tl.where(ok, tp, 0.0)
    kl_q += tl.where(ok, tq, 0.0)
    return LN2 * tl.sum(kl_p, axis=0), LN2 * tl.sum(kl_q, axis=0)


@triton.jit
def grad_values(ys, yt, lse_s, lse_t, aux, g_t, one_m_beta, inv_temperature, log2_1mb, log2_b, s_scale, s_cap,
                 S_CAP: tl.constexpr, MODE: tl.constexpr):
    """d loss / d raw student logit per element (fp32): g_t = g / T times d D / d z_s (docs/DESIGN.md:
    p - q; p (log p - log q - D); (1 - beta) p (log p - log m - KL(p || m))), times the cap's derivative at y_s and
    the scale (the rounding is straight-through). 0 where p is 0 (a -inf logit)."""
    ls, lt = log2_probs(ys, yt, lse_s, lse_t, inv_temperature)
    p = exp2(ls)
    if MODE == 0:
        d = p - exp2(lt)
    elif MODE == 1:
        d = tl.where(p == 0.0, 0.0, p * ((ls - lt) * LN2 - aux))
    else:
        lm = log2_mix(ls, lt, log2_1mb, log2_b)
        d = tl.where(p == 0.0, 0.0, one_m_beta * p * ((ls - lm) * LN2 - aux))
    return soft_cap_grad(d * g_t, ys, s_cap, S_CAP & 1) * s_scale


@triton.jit
def grad_row(s_row, out_row, t_row, bs_ptr, bt_ptr, Vc, lse_s, lse_t, aux, g, one_m_beta, inv_temperature,
              log2_1mb, log2_b, s_scale, s_cap, t_scale, t_cap, HAS_SB: tl.constexpr, HAS_TB: tl.constexpr,
              S_CAP: tl.constexpr, T_CAP: tl.constexpr, MODE: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
              BLOCK: tl.constexpr):
    """Sweep 3: the student's row [0, Vc) rewritten as d raw logits in ``out_row``'s dtype.

    Why the barriers (half precision only): a half row written in place over its fp32 row stores block j into fp32
    elements [j B / 2, (j + 1) B / 2); once every thread has read blocks 0 .. k, stores up to block 2k + 1 touch read
    data only, so a barrier at k = 0, 2, 6, 14, ... orders every store after the reads it could clobber
    (``linear_epilogue_kernels._dlogits_row``). fp32 rows are rewritten element by element by the thread that read
    them; one barrier before the sweep orders the earlier sweeps' reads (other lanes) before any store."""
    offs = tl.arange(0, BLOCK)
    g_t = g * inv_temperature
    HALF: tl.constexpr = out_row.dtype.element_ty != tl.float32
    tl.debug_barrier()
    v_main = (Vc // BLOCK) * BLOCK
    for v0 in range(0, v_main, BLOCK):
        ys, yt = load_pair(s_row, t_row, bs_ptr, bt_ptr, v0 + offs, s_scale, s_cap, t_scale, t_cap, HAS_SB,
                            HAS_TB, S_CAP, T_CAP)
        dz = to_input_dtype(grad_values(ys, yt, lse_s, lse_t, aux, g_t, one_m_beta, inv_temperature, log2_1mb,
                                         log2_b, s_scale, s_cap, S_CAP, MODE), out_row.dtype.element_ty,
                            ROUND_BY_HAND)
        if HALF:
            k = v0 // BLOCK
            if ((k + 2) & (k + 1)) == 0:
                tl.debug_barrier()
        tl.store(out_row + v0 + offs, dz)
    ys, yt, ok = load_pair_tail(s_row, t_row, bs_ptr, bt_ptr, v_main + offs, Vc, s_scale, s_cap, t_scale, t_cap,
                                 HAS_SB, HAS_TB, S_CAP, T_CAP)
    dz = to_input_dtype(grad_values(ys, yt, lse_s, lse_t, aux, g_t, one_m_beta, inv_temperature, log2_1mb, log2_b,
                                     s_scale, s_cap, S_CAP, MODE), out_row.dtype.element_ty, ROUND_BY_HAND)
    # Why a barrier before the tail's store: its block index may be due one.
    tl.debug_barrier()
    tl.store(out_row + v_main + offs, dz, mask=ok)


@triton.jit
def merge(M, S, A, m, s, a, c):
    """Two (max, sum, entropy sum) statistics of ``lane_fold``'s units combined, re-centred on the larger max (A,
    a may be dummies where no entropy is kept). Returns (max, sum, entropy sum, weight of the first, of the
    second)."""
    new = tl.maximum(M, m)
    ref = tl.where(new == float("-inf"), 0.0, new)
    sa = (M - ref) * c
    sb = (m - ref) * c
    wa = exp2(sa)
    wb = exp2(sb)
    # Why the selects before the products: an empty statistic has max -inf and sum 0, and -inf * 0 is NaN
    A = wa * (A + tl.where(S > 0.0, sa, 0.0) * S) + wb * (a + tl.where(s > 0.0, sb, 0.0) * s)
    return new, wa * S + wb * s, A, wa, wb
