"""Fused linear head on cuBLAS GEMMs: row-sweep epilogues over a chunk of fp32 logits, and the chunk loops around
them (docs/DESIGN.md section 3).

Per chunk of R hidden rows, cuBLAS writes the logits z = h W^T as an fp32 (R, V) buffer (``fp32_gemm.logits_f32``); one
Triton program per row then sweeps that row:
- ``head_fold_kernel`` (log-probs, no gradient): online logsumexp / entropy over the row, target logit -> logp,
  lse, entropy, and the extra statistics ``config.TokenExtras`` asks for (log sum p^2, mean logit, is_top1) from
  the same sweep. ``head_logprobs_chunked`` is the no-grad old / reference-policy pass: GEMM + fold, 2NHV.
  The row sweeps themselves are in ``linear_rows.py``.
- ``head_loss_grad_kernel`` (the gradient-in-forward path): the same fold, then ``token_terms`` (ratio, clipping,
  KL, per-token loss and d loss / d logp) with the precomputed reduction weight, per-row metric terms, and a
  second sweep that rewrites the row in place as d logits in the GEMM input dtype. cuBLAS then forms
  dH[chunk] = dZ W and accumulates dW += dZ^T h into an fp32 buffer (never a per-chunk bf16 rounding), dbias
  likewise: 6NHV for a trainable head, 4NHV for a frozen one (no dW GEMM at all).

Bias, the soft cap and 1 / temperature are applied in the epilogue (z = soft_cap(x + b) * inv_temperature), so the
GEMM is a plain ``h @ W.T``. The soft cap (``common.soft_cap``, a SOFTCAP constexpr: no instruction when off) is
recomputed in every sweep from the raw logit, never stored; the d-logits sweep multiplies each value by its
derivative (``common.soft_cap_grad``). A raw -inf (a -inf bias entry) is capped to -softcap, as ``torch.tanh``
does.

Why one program per row: a row of V fp32 logits is a contiguous stream; each program reads it with 16-byte vector
loads in an unmasked main loop plus one masked tail block, keeps per-lane online statistics (no cross-lane
reduction inside the loop) and combines the lanes once at the end.

Why d logits in place: a bf16/fp16 d-logits row needs half the bytes of the fp32 logits row, so it is written
into the first half of the same row (a strided (R, V) view with row stride 2V); block k of the write covers only
fp32 elements below the end of block k of the read, and barriers at blocks 0, 2, 6, 14, ... (``_dlogits_row``)
order every store after the reads it could clobber across warps. fp32 inputs overwrite each element with its own
d logit. The target's column is written last, by one scalar store (no per-element id compare).

Determinism: every output element is produced by one program or one GEMM per chunk, chunks run in a fixed
order, metric terms are summed by torch in a fixed order. cuBLAS GEMMs are run-to-run deterministic for a fixed
GPU, library version and stream configuration (set CUBLAS_WORKSPACE_CONFIG=:4096:8 when streams vary).
"""
from __future__ import annotations

import torch

from .._checks import alloc
from ..invariance import padded
from ..inputs import HeadTokens
from .._triton import import_triton, interpreting
from .common import dlogits_values, soft_cap, soft_cap_grad
from .fp32_gemm import addmm_f32_, logits_f32
from .host import TRITON_DTYPES, cap_args, half_view
from .launch import launch, target_arch
from .linear_rows import extra_outputs, head_row_lse_entropy, head_row_stats, store_extras, target_logit
from .linear_tiles import to_input_dtype
from .token_terms import token_terms_at

triton, tl = import_triton()

# fp32 elements per block of the row sweep: 8 warps x 32 threads x 8 elements (two 16-byte loads per thread;
# under 48 registers on sm_90, so four programs share an SM and keep enough loads in flight).
ROW_BLOCK = 2048
ROW_WARPS = 8
# Register cap (the ``maxnreg`` launch option) of the loss-gradient epilogue by d-logits dtype; absent: ptxas' own
# choice (32-48 registers for bf16 / fp16). Why a cap for fp32 rows: left to itself ptxas targets 48 registers for
# that kernel and spills there (4 B with Triton 3.6 on sm_90, every option; 8 B with Triton 3.9 on sm_80, every option
# and the soft cap). Why 72: the smallest cap tried under which no fp32 variant spills on either Triton version and
# architecture (64 still spilled 8 B in the latter); the variants take 55-72 registers, three or four 8-warp programs
# per SM. (A cap on the half-precision variants would only raise them from 32-48 registers to 48-64, for nothing.)
LOSS_GRAD_MAXNREG = {torch.float32: 72}
# Under TRITON_INTERPRET: a small block, so that small test rows cross the main-loop / tail boundary.
INTERPRET_ROW_BLOCK = 16
N_ROW_TERMS = 8  # w*l, kl, clip low, clip high, clip region, cispo clipped, (2 unused: 32-byte rows)
# Rows per chunk of the no-grad log-prob pass: an fp32 (R, V) chunk of at most this many bytes (256 MiB).
LOGPROBS_CHUNK_BYTES = 256 << 20


def _row_block() -> int:
    return INTERPRET_ROW_BLOCK if target_arch() is None and interpreting() else ROW_BLOCK


@triton.jit
def _dlogits_row(z_row, out_row, b_ptr, target, y_target, lse, ent, g, g_h, V, inv_temperature, softcap,
                 HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, SOFTCAP: tl.constexpr,
                 ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    """A row's d logits (g (onehot - p) - g_H p (log p + H)) * inv_temperature over columns [0, V), times the soft
    cap's derivative 1 - (y / softcap)^2 at y = soft_cap(x) when SOFTCAP, stored in ``out_row``'s dtype: -g p (and
    the entropy term) in unmasked full blocks and one masked tail, then the target column (``y_target``: its capped
    logit, read before the sweep) by one scalar store.

    Why the barriers, and why so few: a half-precision row written in place over its fp32 row (see the module
    docstring) stores block j into fp32 elements [j B / 2, (j + 1) B / 2). Once every thread has read blocks
    0 .. k (a barrier after the loads of block k), the stores of blocks up to 2k + 1 touch only read data. So a
    barrier at k = 0, 2, 6, 14, ... (k + 2 a power of two) orders every store after all reads it could clobber:
    log2(V / B) barriers per row instead of one per block. fp32 rows are rewritten element by element by the
    thread that read them and need none inside the sweep; one before it orders the target's read (y_target).
    Why a flat block here (no lanes): nothing is reduced, and eight contiguous values per thread store as one
    16-byte half-precision vector."""
    offs = tl.arange(0, BLOCK)
    g_t = g * inv_temperature
    gh_t = g_h * inv_temperature
    coef_a = -gh_t * 0.6931471805599453
    coef_b = -g_t - gh_t * ent
    HALF: tl.constexpr = out_row.dtype.element_ty != tl.float32
    if out_row.dtype.element_ty == tl.float32:
        # Why a barrier before an fp32 row's sweep: its elements are rewritten by the threads that read them, but the
        # target's logit (y_target) was read by every thread before the sweep, and the sweep may overwrite it; the
        # barrier performs those reads before any store. (A half-precision row's first barrier, at block 0, or the
        # tail's when V < BLOCK, does the same.)
        tl.debug_barrier()
    v_main = (V // BLOCK) * BLOCK
    for v0 in range(0, v_main, BLOCK):
        x = tl.load(z_row + v0 + offs)
        if HAS_BIAS:
            x += tl.load(b_ptr + v0 + offs).to(tl.float32)
        y = soft_cap(x, softcap, SOFTCAP)
        dz = to_input_dtype(soft_cap_grad(dlogits_values(y, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD),
                                          y, softcap, SOFTCAP), out_row.dtype.element_ty, ROUND_BY_HAND)
        if HALF:
            k = v0 // BLOCK
            if ((k + 2) & (k + 1)) == 0:
                tl.debug_barrier()
        tl.store(out_row + v0 + offs, dz)
    cols = v_main + offs
    ok = cols < V
    x = tl.load(z_row + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        x += tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    # (masked lanes hold 0, a finite capped value, and are not stored)
    y = soft_cap(x, softcap, SOFTCAP)
    dz = to_input_dtype(soft_cap_grad(dlogits_values(y, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD),
                                      y, softcap, SOFTCAP), out_row.dtype.element_ty, ROUND_BY_HAND)
    # Why a barrier here too: the tail's block index may be due one, and the target's column below was stored
    # by whichever thread held it.
    tl.debug_barrier()
    tl.store(out_row + cols, dz, mask=ok)
    tl.debug_barrier()
    dz_t = soft_cap_grad(g_t + dlogits_values(y_target, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD),
                         y_target, softcap, SOFTCAP)
    tl.store(out_row + target, to_input_dtype(dz_t, out_row.dtype.element_ty, ROUND_BY_HAND),
             mask=(target >= 0) & (target < V))


@triton.jit(do_not_specialize=["row0", "V"])
def head_fold_kernel(z_ptr, b_ptr, ids_ptr, logp_ptr, lse_ptr, ent_ptr, row0, V, stride_z, inv_temperature,
                     softcap, sq_ptr, mean_ptr, top1_ptr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                     HAS_SQ: tl.constexpr, HAS_SUM: tl.constexpr, HAS_TOP1: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the fp32 chunk z_ptr (row stride stride_z) -> logp, lse, entropy of token row0 + r (softcap: the
    cap of the raw logits when SOFTCAP, any value otherwise); with HAS_SQ / HAS_SUM / HAS_TOP1, its log sum p^2
    (fp32), mean logit (fp32) and is_top1 (bool) too, from the same sweep (``head_row_stats``)."""
    r = tl.program_id(0)
    tok = row0 + r
    z_row = z_ptr + r.to(tl.int64) * stride_z
    # Why the id is read twice: the sweep needs it only for is_top1; without it the kernel is the log-prob fold as
    # it was (same SASS), which reads the id after the sweep.
    target = 0
    if HAS_TOP1:
        target = tl.load(ids_ptr + tok)
    lse, ent, s_row, s2_row, y_sum, m_row, y_before = head_row_stats(z_row, b_ptr, V, target, inv_temperature,
                                                                     softcap, HAS_BIAS, SOFTCAP, HAS_SQ, HAS_SUM,
                                                                     HAS_TOP1, BLOCK)
    zt = target_logit(z_row, b_ptr, tl.load(ids_ptr + tok), True, softcap, HAS_BIAS, SOFTCAP) * inv_temperature
    tl.store(lse_ptr + tok, lse)
    tl.store(logp_ptr + tok, zt - lse)
    tl.store(ent_ptr + tok, ent)
    store_extras(sq_ptr, mean_ptr, top1_ptr, tok, zt - lse, zt, s_row, s2_row, y_sum, m_row, y_before, V,
                 inv_temperature, HAS_SQ, HAS_SUM, HAS_TOP1)


@triton.jit(do_not_specialize=["row0", "V"])
def head_loss_grad_kernel(z_ptr, out_ptr, b_ptr, ids_ptr, old_ptr, ref_ptr, adv_ptr, isr_ptr, w_ptr, ge_ptr,
                          logp_ptr, ent_ptr, terms_ptr, row0, V, stride_z, stride_out, inv_temperature,
                          eps_low, eps_high, delta, beta, sapo_t_pos, sapo_t_neg, softcap,
                          KIND: tl.constexpr, HAS_OLD: tl.constexpr, HAS_REF: tl.constexpr, HAS_IS: tl.constexpr,
                          HAS_DELTA: tl.constexpr, USE_BETA: tl.constexpr, BIAS_CORRECTION: tl.constexpr,
                          HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, WRITE_GRAD: tl.constexpr,
                          SOFTCAP: tl.constexpr, ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of the chunk: fold, per-token loss terms and gradient, then (WRITE_GRAD) d logits in place.

    Per-token inputs (old, ref, adv, isr, reduction weight w) are fp32 (N,) indexed by token row0 + r; ge_ptr holds
    d loss / d entropy (one fp32 value for every valid token); a row whose weight is 0 is padding (``capturable``):
    its terms, entropy and gradient are 0. Writes logp, entropy, the token's 8 metric terms and
    d logits = (g (onehot - p) - g_H p (log p + H)) * inv_temperature to out_ptr's row r (row stride stride_out),
    times the soft cap's derivative when SOFTCAP.
    """
    r = tl.program_id(0)
    tok = row0 + r
    z_row = z_ptr + r.to(tl.int64) * stride_z
    lse, ent = head_row_lse_entropy(z_row, b_ptr, V, inv_temperature, softcap, HAS_BIAS, SOFTCAP, BLOCK)
    target = tl.load(ids_ptr + tok)
    y_target = target_logit(z_row, b_ptr, target, True, softcap, HAS_BIAS, SOFTCAP)
    logp = y_target * inv_temperature - lse
    # The per-token GRPO maths, defined once (token_terms.py); the reduction is the precomputed weight w.
    adv = tl.load(adv_ptr + tok)
    w = tl.load(w_ptr + tok)
    # Why a row is valid where its weight is not 0: every reduction weights a valid token by a positive number and a
    # padded one by 0. Padded rows reach this kernel only when the call keeps them (``capturable``): whatever their
    # old / ref log-probs hold, they add exact zeros to every sum and gradient (per row, not per element).
    valid = w != 0.0
    tl.store(logp_ptr + tok, logp)
    tl.store(ent_ptr + tok, tl.where(valid, ent, 0.0))

    policy, d_policy, kl, rho, rho1 = token_terms_at(logp, old_ptr, ref_ptr, isr_ptr, tok, tok, adv, eps_low,
                                                     eps_high, delta, beta, sapo_t_pos, sapo_t_neg, KIND, HAS_OLD,
                                                     HAS_REF, HAS_IS, HAS_DELTA, USE_BETA, BIAS_CORRECTION)
    low = tl.where((rho1 < 1.0 - eps_low) & (adv < 0), 1.0, 0.0)
    high = tl.where((rho1 > 1.0 + eps_high) & (adv > 0), 1.0, 0.0)
    terms = terms_ptr + tok.to(tl.int64) * 8
    # Why the select: a NaN log-prob (NaN hidden / weight at a valid row) must reach the loss, even where the
    # policy term's clamps and minimum would drop it (advantage 0, a clipped ratio).
    tl.store(terms + 0, tl.where(valid, tl.where(logp != logp, logp, w * policy), 0.0))
    tl.store(terms + 1, tl.where(valid, kl, 0.0))
    tl.store(terms + 2, tl.where(valid, low, 0.0))
    tl.store(terms + 3, tl.where(valid, high, 0.0))
    tl.store(terms + 4, tl.where(valid, tl.maximum(low, high), 0.0))
    tl.store(terms + 5, tl.where(valid & (rho > eps_high) & (adv > 0), 1.0, 0.0))
    tl.store(terms + 6, 0.0)
    tl.store(terms + 7, 0.0)

    if WRITE_GRAD:
        g = tl.where(valid, w * d_policy, 0.0)
        g_h = 0.0
        if HAS_ENTROPY_GRAD:
            g_h = tl.where(valid, tl.load(ge_ptr), 0.0)
        # Why a second sweep rather than keeping the row on chip: V fp32 logits (600 KB at V = 152k) do not fit;
        # the second read of the row is the price of writing d logits without a recompute GEMM.
        _dlogits_row(z_row, out_ptr + r.to(tl.int64) * stride_out, b_ptr, target, y_target, lse, ent, g, g_h, V,
                     inv_temperature, softcap, HAS_BIAS, HAS_ENTROPY_GRAD, SOFTCAP, ROUND_BY_HAND, BLOCK)


@triton.jit(do_not_specialize=["v0", "Vc"])
def head_dlogits_kernel(z_ptr, out_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, v0, Vc, stride_z,
                        stride_out, inv_temperature, softcap, HAS_BIAS: tl.constexpr,
                        HAS_ENTROPY_GRAD: tl.constexpr, SOFTCAP: tl.constexpr, ROUND_BY_HAND: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Light-path backward: row r of an fp32 (N, Vc) logits chunk (vocab v0 .. v0 + Vc) -> its d logits in place.

    From the forward's saved lse / entropy and the per-token gradients g = d loss / d logp (gl_ptr) and
    g_H = d loss / d entropy (ge_ptr): d logits = (g (onehot - p) - g_H p (log p + H)) * inv_temperature, written
    in out_ptr's dtype to its row r (row stride stride_out; out may alias z, see the module docstring), times the
    soft cap's derivative when SOFTCAP (p then from the capped logits). b_ptr points at bias[v0].
    """
    r = tl.program_id(0)
    z_row = z_ptr + r.to(tl.int64) * stride_z
    out_row = out_ptr + r.to(tl.int64) * stride_out
    lse = tl.load(lse_ptr + r)
    g = tl.load(gl_ptr + r)
    local_target = tl.load(ids_ptr + r) - v0
    y_target = target_logit(z_row, b_ptr, local_target, (local_target >= 0) & (local_target < Vc), softcap,
                            HAS_BIAS, SOFTCAP)
    g_h = 0.0
    ent = 0.0
    if HAS_ENTROPY_GRAD:
        g_h = tl.load(ge_ptr + r)
        ent = tl.load(ent_ptr + r)
    _dlogits_row(z_row, out_row, b_ptr, local_target, y_target, lse, ent, g, g_h, Vc, inv_temperature, softcap,
                 HAS_BIAS, HAS_ENTROPY_GRAD, SOFTCAP, ROUND_BY_HAND, BLOCK)


# ---------------------------------------------------------------------------------------------- launchers


def chunk_rows(budget_bytes: int, V: int, N: int) -> int:
    """Rows of an fp32 (rows, V) chunk within ``budget_bytes``, spread evenly over the chunks (0 if none fit)."""
    max_rows = budget_bytes // (4 * V)
    if max_rows <= 0 or N == 0:
        return max(0, min(N, max_rows))
    n_chunks = -(-N // max_rows)
    return -(-N // n_chunks)


def fold_chunk(z, bias, ids, logp, lse, ent, row0: int, temperature: float,
               softcap: float | None = None, extras: tuple = (None, None, None),
               round_logits: str | None = None) -> None:
    """logp / lse / entropy of tokens row0 .. row0 + len(z) from their fp32 raw logits rows z (R, V), of
    z = soft_cap(x + bias) / temperature (no cap when softcap is None; x + bias rounded to ``round_logits`` first
    when given); extras: the (N,) outputs (log_sum_sq_probs
    fp32, mean_logits fp32, is_top1 bool) to fill too, None for one not wanted."""
    R, V = z.shape
    if R == 0:
        return
    sq, mean, top1 = (lse if t is None else t for t in extras)  # an unused pointer: any tensor
    launch(head_fold_kernel, (R,), z, z if bias is None else bias, ids, logp, lse, ent, row0, V, z.stride(0),
           1.0 / temperature, HAS_BIAS=bias is not None, BLOCK=_row_block(), num_warps=ROW_WARPS,
           **cap_args(softcap, round_logits), **_extras_args(sq, mean, top1, extras))


def _extras_args(sq, mean, top1, extras: tuple) -> dict:
    """The fold kernel's extra output pointers and flags (the pointers after the cap's runtime argument)."""
    return {"sq_ptr": sq, "mean_ptr": mean, "top1_ptr": top1, "HAS_SQ": extras[0] is not None,
            "HAS_SUM": extras[1] is not None, "HAS_TOP1": extras[2] is not None}


def dlogits_chunk(z, out, bias, ids, lse, entropy, grad_logp, grad_entropy, v0: int, inv_temperature: float,
                  softcap: float | None = None, round_logits: str | None = None) -> None:
    """d logits of vocab columns v0 .. v0 + Vc for every token from their fp32 raw logits z (N, Vc), into ``out``
    (N, Vc) in the input dtype (``half_view(z)`` to write in place). grad_entropy None: no entropy term. softcap:
    lse / entropy are those of the capped logits, and d logits is taken through the cap (its derivative included).
    round_logits: the forward's; its rounding passes d logits through unchanged (straight-through)."""
    N, Vc = z.shape
    if N == 0:
        return
    has_ent = grad_entropy is not None
    launch(head_dlogits_kernel, (N,), z, out, z if bias is None else bias[v0:], ids, lse,
           entropy if has_ent else lse, grad_logp, grad_entropy if has_ent else lse, v0, Vc, z.stride(0),
           out.stride(0), inv_temperature, HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=has_ent,
           ROUND_BY_HAND=interpreting() and target_arch() is None, BLOCK=_row_block(), num_warps=ROW_WARPS,
           **cap_args(softcap, round_logits))


def head_logprobs_chunked(hidden, weight, bias, ids, temperature: float, chunk_bytes: int | None = None,
                          softcap: float | None = None, extras=None, fixed_rows: int = 0,
                          round_logits: str | None = None):
    """(logp, lse, entropy), fp32 (N,) of z = soft_cap(hidden @ weight.T + bias) / temperature (the raw logits
    rounded to ``round_logits`` first when given): per row chunk,
    cuBLAS logits (fp32) + the fold kernel; no gradient work. With ``extras`` (a truthy ``config.TokenExtras``) a
    fourth item, ``extra_outputs``' tuple filled by the same fold. ``fixed_rows`` (batch invariance): chunks of
    exactly that many rows, the last GEMM on a zero-padded block (``invariance.padded``), folded for its real rows.

    Extra memory: one fp32 (R, V) chunk, R = rows within ``chunk_bytes`` (at least one row)."""
    N, V = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    logp, lse, ent = (alloc((N,), torch.float32, dev) for _ in range(3))
    more = extra_outputs(N, dev, extras) if extras else (None, None, None)
    R = fixed_rows or max(1, chunk_rows(LOGPROBS_CHUNK_BYTES if chunk_bytes is None else chunk_bytes, V, N))
    buf = alloc((R if fixed_rows else min(R, N), V), torch.float32, dev)
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        z = buf if fixed_rows else buf[: r1 - r0]
        logits_f32(padded(hidden, r0, r1, R) if fixed_rows else hidden[r0:r1], weight, z)
        fold_chunk(z[: r1 - r0], bias, ids, logp, lse, ent, r0, temperature, softcap, more, round_logits)
    return (logp, lse, ent, more) if extras else (logp, lse, ent)


def head_loss_and_grads(hidden, weight, bias, ids, tokens, cfg, transform, kind: int, rows: int, needs: tuple):
    """The gradient-in-forward pass over row chunks of ``rows`` tokens (with ``cfg.batch_invariant`` every chunk's
    GEMMs run on exactly ``rows`` rows, the last block zero-padded: its padded rows get no loss and zero d logits).

    tokens: an ``inputs.HeadTokens`` (fp32 (N,) per-token advantage, reduction weight, optional old / ref / is_ratio,
    and the entropy bonus' d loss / d entropy); cfg: the loss options; transform: the logits transform
    (``config.LogitTransform``: temperature, soft cap); needs: (d hidden, d weight, d bias) wanted. Returns
    (logp, entropy, terms (N, 8) fp32, d_hidden in hidden's dtype | None, d_weight fp32 | None, d_bias fp32 | None);
    d_weight and d_bias accumulate over chunks in fp32. Extra memory: the fp32 (rows, V) chunk, plus the fp32 dW /
    dbias accumulators.
    """
    N, H = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    need_hidden, need_weight, need_bias = needs
    need_bias = need_bias and bias is not None
    write_grad = need_hidden or need_weight or need_bias
    logp, ent = alloc((N,), torch.float32, dev), alloc((N,), torch.float32, dev)
    terms = alloc((N, N_ROW_TERMS), torch.float32, dev)
    d_hidden = alloc((N, H), dtype, dev) if need_hidden else None
    dw32 = torch.zeros((V, H), dtype=torch.float32, device=dev) if need_weight else None
    db32 = torch.zeros((V,), dtype=torch.float32, device=dev) if need_bias else None
    if N == 0:
        return logp, ent, terms, d_hidden, dw32, db32
    fixed = cfg.batch_invariant
    R = max(1, rows if fixed else min(rows, N))
    buf = alloc((R, V), torch.float32, dev)
    dbuf = half_view(buf, dtype)
    adv = tokens.adv
    opt = {k: getattr(tokens, k) for k in ("old", "ref", "isr")}
    old, ref, isr = (adv if opt[k] is None else opt[k] for k in ("old", "ref", "isr"))
    ge = tokens.ge
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        if fixed:  # the GEMMs on R rows; the epilogue on the real ones, the padded rows' d logits zeroed
            z, dz, h = buf, dbuf, padded(hidden, r0, r1, R)
            dz[r1 - r0:].zero_()
        else:
            z, dz, h = buf[: r1 - r0], dbuf[: r1 - r0], hidden[r0:r1]
        logits_f32(h, weight, z)
        launch(head_loss_grad_kernel, (r1 - r0,),
               z, dz, z if bias is None else bias, ids, old, ref, adv, isr, tokens.w, adv if ge is None else ge,
               logp, ent, terms, r0, V, z.stride(0), dz.stride(0),
               1.0 / transform.temperature, float(cfg.epsilon_low), float(cfg.epsilon_high),
               float(cfg.delta or 0.0), float(cfg.beta), float(cfg.sapo_temperature_pos),
               float(cfg.sapo_temperature_neg), KIND=kind, HAS_OLD=opt["old"] is not None, HAS_REF=opt["ref"] is not None,
               HAS_IS=opt["isr"] is not None, HAS_DELTA=cfg.delta is not None, USE_BETA=cfg.beta != 0.0,
               BIAS_CORRECTION=cfg.use_bias_correction_kl, HAS_BIAS=bias is not None,
               HAS_ENTROPY_GRAD=ge is not None, WRITE_GRAD=write_grad,
               ROUND_BY_HAND=interpreting() and target_arch() is None, BLOCK=_row_block(), num_warps=ROW_WARPS,
               **({"maxnreg": LOSS_GRAD_MAXNREG[dtype]} if dtype in LOSS_GRAD_MAXNREG else {}),
               **cap_args(transform.softcap, transform.round_logits))
        if write_grad:
            chunk_gradients(dz, h, weight, d_hidden, dw32, db32, r0, r1)
    return logp, ent, terms, d_hidden, dw32, db32


def chunk_gradients(dz, h, weight, d_hidden, dw32, db32, r0: int, r1: int | None = None) -> None:
    """From the d logits dz (R, V) of hidden rows h = hidden[r0:r0 + R]: d_hidden[r0:r0 + R] = dz W, dw32 += dz^T h,
    db32 += column sums (each only when not None). r1: the end of the real rows when dz is a padded block (its
    rows past r1 - r0 are zero: d hidden keeps the real rows, d weight / d bias get exact zeros from the others).

    Why deterministic and unbiased: fixed shapes in a fixed chunk order; dW and dbias accumulate in fp32 across
    chunks (cuBLAS beta = 1), never rounding a per-chunk product to bf16."""
    n = dz.shape[0] if r1 is None else r1 - r0
    if d_hidden is not None and n == dz.shape[0]:
        torch.mm(dz, weight, out=d_hidden[r0:r0 + n])
    elif d_hidden is not None:
        d_hidden[r0:r0 + n] = torch.mm(dz, weight)[:n]
    if dw32 is not None:
        addmm_f32_(dw32, dz.t(), h)
    if db32 is not None:
        db32 += dz.sum(0, dtype=torch.float32)


def head_sequence_grads(hidden, weight, bias, ids, bounds, token_grads, transform, needs: tuple, grad_ids=None):
    """The gradient-in-forward pass for losses whose per-token gradient needs more than the token: chunks of rows
    whose gradients ``token_grads`` forms from the chunk's statistics (whole sequences for GSPO's sequence ratio,
    vespo's row weights, the off-policy row mask; the vocab-parallel head combines the shards' statistics there).

    bounds: row offsets [0, ..., N] of the chunks. Per chunk: cuBLAS fp32 logits, the fold kernel (logp, lse,
    entropy of ``ids``), ``token_grads(r0, r1, logp, lse, entropy)`` -> (d loss / d logp, d loss / d entropy or
    None), fp32 for rows r0 .. r1 (it receives views and may overwrite them, e.g. with statistics over the whole
    vocabulary), then the d-logits epilogue in place (its one-hot at ``grad_ids``, default ``ids``; an id outside
    [0, V) adds none) and the cuBLAS gradient GEMMs. transform: the logits transform (temperature, soft cap: the
    logits are capped in both kernels, and the statistics ``token_grads`` receives are those of the capped logits);
    needs: (d hidden, d weight, d bias) wanted. Returns (logp, entropy, d_hidden | None,
    d_weight fp32 | None, d_bias fp32 | None).
    """
    N, H = hidden.shape
    V = weight.shape[0]
    dev, dtype = hidden.device, hidden.dtype
    grad_ids = ids if grad_ids is None else grad_ids
    need_hidden, need_weight, need_bias = needs
    need_bias = need_bias and bias is not None
    temperature, softcap = transform.temperature, transform.softcap
    write_grad = need_hidden or need_weight or need_bias
    logp, lse, ent = (alloc((N,), torch.float32, dev) for _ in range(3))
    d_hidden = alloc((N, H), dtype, dev) if need_hidden else None
    dw32 = torch.zeros((V, H), dtype=torch.float32, device=dev) if need_weight else None
    db32 = torch.zeros((V,), dtype=torch.float32, device=dev) if need_bias else None
    R = max([1] + [r1 - r0 for r0, r1 in zip(bounds[:-1], bounds[1:])])
    buf = alloc((R, V), torch.float32, dev)
    dbuf = half_view(buf, dtype)
    for r0, r1 in zip(bounds[:-1], bounds[1:]):
        if r1 == r0:
            continue
        z, dz, h = buf[: r1 - r0], dbuf[: r1 - r0], hidden[r0:r1]
        logits_f32(h, weight, z)
        fold_chunk(z, bias, ids, logp, lse, ent, r0, temperature, softcap, round_logits=transform.round_logits)
        g, g_h = token_grads(r0, r1, logp[r0:r1], lse[r0:r1], ent[r0:r1])
        if write_grad:
            dlogits_chunk(z, dz, bias, grad_ids[r0:r1], lse[r0:r1], ent[r0:r1], g.contiguous(),
                          None if g_h is None else g_h.contiguous(), 0, 1.0 / temperature, softcap=softcap,
                          round_logits=transform.round_logits)
            chunk_gradients(dz, h, weight, d_hidden, dw32, db32, r0)
    return logp, ent, d_hidden, dw32, db32


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the fold kernel without bias and with a bias of each dtype,
    and with the extra statistics (``_extras`` and TRL's trainers' sets: ``_top1``, ``_mean``, ``_mean_top1``);
    the d-logits epilogue for every (dtype, bias, entropy) combination; the loss-gradient epilogue per policy kind
    in bf16, plain and with every option (old, ref, is_ratio, delta, bias, entropy), and per other dtype the plain
    and the every-option clipped one; each of these kernels also with the soft cap on (names ending in
    ``_softcap``: their cost is reported, the instruction budget is that of the cap off)."""
    from ..config import GRPOLossConfig
    from ..loss_types import POLICY_TERMS
    from .linear_tiles import aot_inputs

    from ..config import TokenExtras
    from .linear_forward_kernels import EXTRAS_SETS

    def fold(dtype, has_bias, softcap=None, extras=None):
        def thunk():
            hidden, weight, bias, ids = aot_inputs(dtype, has_bias)
            head_logprobs_chunked(hidden, weight, bias, ids, 0.7, chunk_bytes=64 * 4 * weight.shape[0],
                                  softcap=softcap, extras=None if extras is None else TokenExtras.of(extras))
        return thunk

    def loss(dtype, kind, full, softcap=None):
        def thunk():
            hidden, weight, bias, ids = aot_inputs(dtype, full)
            N = hidden.shape[0]
            x = torch.zeros(N)
            tokens = HeadTokens(adv=x, w=x)
            if full:
                tokens = HeadTokens(adv=x, w=x, old=x, ref=x, isr=x, ge=torch.zeros(1))
            cfg = GRPOLossConfig(beta=0.04 if full else 0.0, delta=1.5 if full else None, softcap=softcap)
            head_loss_and_grads(hidden, weight, bias, ids, tokens, cfg, cfg.transform, kind, 64, (True, False, full))
        return thunk

    def dlogits(dtype, has_ent, has_bias=True, softcap=None):
        def thunk():
            hidden, weight, bias, ids = aot_inputs(dtype, has_bias)
            N, V = hidden.shape[0], weight.shape[0]
            z, x = torch.zeros(N, V), torch.zeros(N)
            dlogits_chunk(z, half_view(z, dtype), bias, ids, x, x, x, x if has_ent else None, 0, 1.0,
                          softcap=softcap)
        return thunk

    # The fold with the extra statistics (``_extras``: every one; in bf16 also TRL's trainers' sets, EXTRAS_SETS)
    scenarios = [(f"head_fold_{base}_{name}", fold(dtype, has_bias, None, names))
                 for base, dtype, has_bias in (("nobias", torch.bfloat16, False), ("bias", torch.bfloat16, True),
                                               ("bias_fp16", torch.float16, True), ("bias_fp32", torch.float32, True))
                 for name, names in EXTRAS_SETS.items() if name == "extras" or base == "bias"]
    scenarios.append(("head_fold_bias_softcap_extras", fold(torch.bfloat16, True, 30.0, EXTRAS_SETS["extras"])))
    for cap, suffix in ((None, ""), (30.0, "_softcap")):
        # The fold reads fp32 logits whatever the dtype; only the bias' dtype makes a variant (no suffix: bf16).
        scenarios += [(f"head_fold_nobias{suffix}", fold(torch.bfloat16, False, cap))]
        scenarios += [(f"head_fold_bias{'' if ty == 'bf16' else '_' + ty}{suffix}", fold(dtype, True, cap))
                      for dtype, ty in TRITON_DTYPES.items()]
        # d logits: the sequence-level gradient-in-forward path (and the light backward) launch every combination
        scenarios += [(f"head_dlogits_{ty}_{'bias' if b else 'nobias'}_{'ent' if e else 'noent'}{suffix}",
                       dlogits(dtype, e, b, cap))
                      for dtype, ty in TRITON_DTYPES.items() for b in (False, True) for e in (False, True)]
        for dtype, ty in TRITON_DTYPES.items():
            for name in ("clipped", "cispo", "sapo"):
                for full in (False, True):
                    if ty != "bf16" and name != "clipped":
                        continue  # fp32 / fp16 change only the d-logits store and the bias load
                    if cap and name != "clipped":
                        continue  # the cap changes the sweeps, not the policy term
                    scenarios.append((f"head_loss_grad_{ty}_{name}_{'all_options' if full else 'plain'}{suffix}",
                                      loss(dtype, POLICY_TERMS.index(name), full, cap)))
    return scenarios
