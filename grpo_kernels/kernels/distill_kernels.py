"""The two-head divergence on cuBLAS GEMMs: row-sweep epilogues over both models' fp32 logits, and the chunk loops
around them (docs/DESIGN.md, "Distillation"; docs/kernels.md, "Distillation epilogue").

Per chunk of R rows cuBLAS writes both models' raw logits x = h W^T as fp32 buffers (``fp32_gemm.logits_f32``); one
Triton program per row then streams both rows at once. Each model's logit is y = soft_cap(scale * r(x + b)) (r the
rounding of ``round_logits``), z = y / T, p = softmax(z_student), q = softmax(z_teacher):

- ``distill_row_kernel`` (whole rows: ``distill.fast``, and the no-grad / light forward when the vocabulary fits
  one tile): sweep 1 folds both online logsumexps, the student's entropy sum and, for the KLs, the weighted gap
  sum_v q (z_t - z_s) (forward) or sum_v p (z_s - z_t) (reverse), so the KL needs no second sweep; the JSD's sweep 2
  sums KL(p || m) and KL(q || m) with both logsumexps known; with WRITE_GRAD sweep 3 rewrites the student's row in
  place as d loss / d raw logit (the per-token weight g, 1 / T, the cap's derivative and the scale chained), in the
  student's dtype (half precision into the first half of the fp32 row, as ``linear_epilogue_kernels``).
- ``distill_fold_kernel`` / ``distill_jsd_kernel`` / ``distill_grad_kernel``: the same three sweeps over one vocabulary
  tile of the rows (``distill.light`` / ``distill.no_grad`` when V is tiled): the fold merges the tile into per-token
  online statistics kept between tiles, the JSD pass adds the tile's sums, the gradient rewrites the tile.

Then cuBLAS forms dH = dZ W_s and accumulates dW_s += dZ^T h_s (and d bias) in fp32 (``chunk_gradients``).

Kernel habits: beta, temperature, scales and caps are runtime scalars (constexpr only for block sizes, MODE, the
HAS_* flags and the cap / rounding bits), V is not specialized (a new vocabulary does not recompile) and the
main loops are unmasked, so row loads are 16-byte vectors; offsets are int64; every statistic is fp32. Why one
program per row: each row pair is a contiguous stream read with vector loads, per-lane online statistics (no
cross-lane reduction inside a loop), lanes combined once per row.

Determinism: every output element is written by one program (or one GEMM per chunk) in a fixed order; no atomics.
"""
from __future__ import annotations

import math

import torch

from .._checks import alloc
from .._triton import import_triton, interpreting
from ..distill_config import JSD
from ..invariance import padded
from .common import LOG2E
from .distill_rows import finish, fold_row, grad_row, jsd_row, merge
from .fp32_gemm import addmm_f32_, logits_f32
from .host import TRITON_DTYPES, cap_args, half_view
from .launch import launch, target_arch
from .linear_epilogue_kernels import chunk_gradients

triton, tl = import_triton()

# fp32 elements per block of a sweep: 8 warps x 32 threads x 8 elements (two 16-byte loads per thread and row).
ROW_BLOCK = 2048
ROW_WARPS = 8
# Under TRITON_INTERPRET: a small block, so that small test rows cross the main-loop / tail boundary.
INTERPRET_ROW_BLOCK = 16
# Per-token online statistics between vocabulary tiles: student max, sum, entropy sum; teacher max, sum; gap sum.
N_STATE = 6
# Register caps (the ``maxnreg`` launch option) of the whole-row kernel: a KL mode, the JSD (its three sweeps keep
# the most values live). Why: left to itself ptxas aims lower and can spill (80 registers and 4 B for the JSD's
# bias-free bf16 variant with Triton 3.6 on sm_80; 64 and 4 B for the fp32 reverse KL with Triton 3.9 on sm_90 after a
# one-select change in the shared logsumexp). Under these caps no variant spills with Triton 3.6 or 3.9 on sm_80 /
# sm_90 (2026-12-06): the KLs take 64-80 registers (three 8-warp programs per SM), the JSD 88-128 (two).
ROW_KL_MAXNREG = 80
ROW_JSD_MAXNREG = 128


def _row_block() -> int:
    return INTERPRET_ROW_BLOCK if target_arch() is None and interpreting() else ROW_BLOCK


# ---------------------------------------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["row0", "V"])
def distill_row_kernel(s_ptr, out_ptr, t_ptr, bs_ptr, bt_ptr, g_ptr, div_ptr, ent_ptr, lse_s_ptr, lse_t_ptr,
                       aux_ptr, row0, V, stride_s, stride_out, stride_t, inv_temperature, beta, log2_1mb, log2_b,
                       s_scale, s_cap, t_scale, t_cap, MODE: tl.constexpr, HAS_SB: tl.constexpr,
                       HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr, WRITE_GRAD: tl.constexpr,
                       ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of a chunk of whole rows: both logsumexps, the divergence, the student's entropy (token row0 + r), and
    with WRITE_GRAD the student's row rewritten in place as g * d D / d raw logits (g: the token's weight g_ptr).
    Stores divergence, entropy, both logsumexps and aux (the KL, or KL(p || m) for the JSD: what a recompute
    backward needs) at the token."""
    r = tl.program_id(0)
    tok = row0 + r
    s_row = s_ptr + r.to(tl.int64) * stride_s
    t_row = t_ptr + r.to(tl.int64) * stride_t
    c = inv_temperature * LOG2E
    m_s, s_s, a_s, m_t, s_t, gap = fold_row(s_row, t_row, bs_ptr, bt_ptr, V, c, s_scale, s_cap, t_scale, t_cap,
                                             HAS_SB, HAS_TB, S_CAP, T_CAP, MODE, BLOCK)
    lse_s, ent, lse_t, div = finish(m_s, s_s, a_s, m_t, s_t, gap, inv_temperature, MODE)
    aux = div
    if MODE == 2:
        # Why a second sweep: the mixture m needs both logsumexps, known only after sweep 1.
        kl_p, kl_q = jsd_row(s_row, t_row, bs_ptr, bt_ptr, V, lse_s, lse_t, inv_temperature, log2_1mb, log2_b,
                              s_scale, s_cap, t_scale, t_cap, HAS_SB, HAS_TB, S_CAP, T_CAP, BLOCK)
        div = beta * kl_q + (1.0 - beta) * kl_p
        aux = kl_p
    tl.store(div_ptr + tok, div)
    tl.store(ent_ptr + tok, ent)
    tl.store(lse_s_ptr + tok, lse_s)
    tl.store(lse_t_ptr + tok, lse_t)
    tl.store(aux_ptr + tok, aux)
    if WRITE_GRAD:
        # Why a sweep more rather than the row on chip: two rows of V fp32 logits do not fit; the re-read is the
        # price of d logits without a recompute GEMM.
        grad_row(s_row, out_ptr + r.to(tl.int64) * stride_out, t_row, bs_ptr, bt_ptr, V, lse_s, lse_t, aux,
                  tl.load(g_ptr + tok), 1.0 - beta, inv_temperature, log2_1mb, log2_b, s_scale, s_cap, t_scale,
                  t_cap, HAS_SB, HAS_TB, S_CAP, T_CAP, MODE, ROUND_BY_HAND, BLOCK)


@triton.jit(do_not_specialize=["row0", "Vc"])
def distill_fold_kernel(s_ptr, t_ptr, bs_ptr, bt_ptr, state_ptr, row0, Vc, stride_s, stride_t, inv_temperature,
                        s_scale, s_cap, t_scale, t_cap, MODE: tl.constexpr, HAS_SB: tl.constexpr,
                        HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of a vocabulary tile (Vc columns; bs_ptr / bt_ptr at the tile's first column): its sweep-1 statistics
    merged into the token's running ones, ``state_ptr`` (N, N_STATE) fp32 (m_s, s_s, a_s, m_t, s_t, gap; start
    from -inf, 0, 0, -inf, 0, 0)."""
    r = tl.program_id(0)
    st = state_ptr + (row0 + r).to(tl.int64) * 6
    c = inv_temperature * LOG2E
    m_s, s_s, a_s, m_t, s_t, gap = fold_row(s_ptr + r.to(tl.int64) * stride_s, t_ptr + r.to(tl.int64) * stride_t,
                                             bs_ptr, bt_ptr, Vc, c, s_scale, s_cap, t_scale, t_cap, HAS_SB, HAS_TB,
                                             S_CAP, T_CAP, MODE, BLOCK)
    M_s, S_s, A_s, wa_s, wb_s = merge(tl.load(st + 0), tl.load(st + 1), tl.load(st + 2), m_s, s_s, a_s, c)
    M_t, S_t, _A, wa_t, wb_t = merge(tl.load(st + 3), tl.load(st + 4), 0.0, m_t, s_t, 0.0, c)
    G = tl.load(st + 5)
    if MODE == 0:
        G = wa_t * G + wb_t * gap
    elif MODE == 1:
        G = wa_s * G + wb_s * gap
    tl.store(st + 0, M_s)
    tl.store(st + 1, S_s)
    tl.store(st + 2, A_s)
    tl.store(st + 3, M_t)
    tl.store(st + 4, S_t)
    tl.store(st + 5, G)


@triton.jit(do_not_specialize=["row0", "Vc"])
def distill_jsd_kernel(s_ptr, t_ptr, bs_ptr, bt_ptr, lse_s_ptr, lse_t_ptr, kl_ptr, row0, Vc, stride_s, stride_t,
                       inv_temperature, log2_1mb, log2_b, s_scale, s_cap, t_scale, t_cap, HAS_SB: tl.constexpr,
                       HAS_TB: tl.constexpr, S_CAP: tl.constexpr, T_CAP: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of a vocabulary tile: its KL(p || m), KL(q || m) added to the token's (kl_ptr (N, 2) fp32)."""
    r = tl.program_id(0)
    tok = (row0 + r).to(tl.int64)
    kl_p, kl_q = jsd_row(s_ptr + r.to(tl.int64) * stride_s, t_ptr + r.to(tl.int64) * stride_t, bs_ptr, bt_ptr, Vc,
                          tl.load(lse_s_ptr + tok), tl.load(lse_t_ptr + tok), inv_temperature, log2_1mb, log2_b,
                          s_scale, s_cap, t_scale, t_cap, HAS_SB, HAS_TB, S_CAP, T_CAP, BLOCK)
    tl.store(kl_ptr + tok * 2, tl.load(kl_ptr + tok * 2) + kl_p)
    tl.store(kl_ptr + tok * 2 + 1, tl.load(kl_ptr + tok * 2 + 1) + kl_q)


@triton.jit(do_not_specialize=["row0", "Vc"])
def distill_grad_kernel(s_ptr, out_ptr, t_ptr, bs_ptr, bt_ptr, lse_s_ptr, lse_t_ptr, aux_ptr, g_ptr, row0, Vc,
                        stride_s, stride_out, stride_t, inv_temperature, beta, log2_1mb, log2_b, s_scale, s_cap,
                        t_scale, t_cap, MODE: tl.constexpr, HAS_SB: tl.constexpr, HAS_TB: tl.constexpr,
                        S_CAP: tl.constexpr, T_CAP: tl.constexpr, ROUND_BY_HAND: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of a vocabulary tile rewritten as g * d D / d raw student logits from the forward's per-token
    logsumexps and aux (the recompute backward of ``distill.light``)."""
    r = tl.program_id(0)
    tok = (row0 + r).to(tl.int64)
    grad_row(s_ptr + r.to(tl.int64) * stride_s, out_ptr + r.to(tl.int64) * stride_out,
              t_ptr + r.to(tl.int64) * stride_t, bs_ptr, bt_ptr, Vc, tl.load(lse_s_ptr + tok), tl.load(lse_t_ptr + tok),
              tl.load(aux_ptr + tok), tl.load(g_ptr + tok), 1.0 - beta, inv_temperature, log2_1mb, log2_b, s_scale,
              s_cap, t_scale, t_cap, HAS_SB, HAS_TB, S_CAP, T_CAP, MODE, ROUND_BY_HAND, BLOCK)


# ---------------------------------------------------------------------------------------------- launchers


def _scalars(cfg) -> dict:
    """The runtime scalars and transform constexprs every distillation kernel takes (``cfg``: a
    ``DistillLossConfig``). Why finite placeholders for the KLs' log2(beta) / log2(1 - beta): they are read only by
    the JSD."""
    s, t = cfg.student, cfg.teacher
    sc, tc = cap_args(s.softcap, s.round_logits), cap_args(t.softcap, t.round_logits)
    jsd = cfg.mode == JSD
    return dict(inv_temperature=1.0 / cfg.temperature, log2_1mb=math.log2(1.0 - cfg.beta) if jsd else 0.0,
                log2_b=math.log2(cfg.beta) if jsd else 0.0, s_scale=float(s.scale), s_cap=sc["softcap"],
                t_scale=float(t.scale), t_cap=tc["softcap"], S_CAP=sc["SOFTCAP"], T_CAP=tc["SOFTCAP"])


def _bias_args(sb, tb, v0: int, like: torch.Tensor) -> dict:
    """The bias pointers at column v0 (any tensor where there is none) and their flags."""
    return dict(bs_ptr=like if sb is None else sb[v0:], bt_ptr=like if tb is None else tb[v0:],
                HAS_SB=sb is not None, HAS_TB=tb is not None)


def _launch_opts() -> dict:
    return dict(BLOCK=_row_block(), num_warps=ROW_WARPS)


def _tile_buffers(rows: int, cols: int, device):
    """Two flat fp32 buffers of rows x cols: each tile's (n, vc) view is contiguous (a cuBLAS output)."""
    return alloc((rows * cols,), torch.float32, device), alloc((rows * cols,), torch.float32, device)


def _view(buf: torch.Tensor, n: int, vc: int) -> torch.Tensor:
    return buf[: n * vc].view(n, vc)


def _rows_of(t, r0: int, r1: int, R: int, fixed: bool):
    return padded(t, r0, r1, R) if fixed else t[r0:r1]


def distill_row_chunks(student, teacher, cfg, rows: int, g=None, needs=(False, False, False),
                       fixed_rows: bool = False):
    """Chunks of ``rows`` whole rows (``fixed_rows``: every chunk exactly that many, the last zero-padded): per
    chunk cuBLAS fp32 logits of both heads and ``distill_row_kernel``; with ``g`` ((N,) fp32, d loss / d divergence
    per token) the student's gradients ``needs`` = (hidden, weight, bias) made in the same pass (``distill.fast``).

    student / teacher: (hidden (N, H), weight (V, H), bias | None) in their compute dtypes. Returns (divergence,
    entropy, lse_s, lse_t, aux) fp32 (N,) and (d hidden in hidden's dtype | None, d weight fp32 | None, d bias fp32
    | None). Extra memory: two fp32 (rows, V) chunks and the fp32 accumulators."""
    (sh, sw, sb), (th, tw, tb) = student, teacher
    N, H = sh.shape
    V, dev = sw.shape[0], sh.device
    write = g is not None and any(needs)
    need_h, need_w, need_b = needs if write else (False, False, False)
    outs = [alloc((N,), torch.float32, dev) for _ in range(5)]
    dh = alloc((N, H), sh.dtype, dev) if need_h else None
    dw32 = torch.zeros((V, H), dtype=torch.float32, device=dev) if need_w else None
    db32 = torch.zeros((V,), dtype=torch.float32, device=dev) if need_b and sb is not None else None
    if N == 0:
        return (*outs, dh, dw32, db32)
    R = max(1, rows if fixed_rows else min(rows, N))
    sbuf, tbuf = _tile_buffers(R, V, dev)
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        n = R if fixed_rows else r1 - r0
        zs, zt = _view(sbuf, n, V), _view(tbuf, n, V)
        hs = _rows_of(sh, r0, r1, R, fixed_rows)
        logits_f32(hs, sw, zs)
        logits_f32(_rows_of(th, r0, r1, R, fixed_rows), tw, zt)
        dz = half_view(zs, sh.dtype)
        if write and n > r1 - r0:  # the padded rows: no epilogue, zero d logits (after the GEMM wrote them)
            dz[r1 - r0:].zero_()
        div, ent, lse_s, lse_t, aux = outs
        launch(distill_row_kernel, (r1 - r0,), s_ptr=zs, out_ptr=dz, t_ptr=zt, g_ptr=div if g is None else g,
               div_ptr=div, ent_ptr=ent, lse_s_ptr=lse_s, lse_t_ptr=lse_t, aux_ptr=aux, row0=r0, V=V,
               stride_s=zs.stride(0), stride_out=dz.stride(0), stride_t=zt.stride(0), beta=float(cfg.beta),
               MODE=cfg.mode, WRITE_GRAD=write, ROUND_BY_HAND=interpreting() and target_arch() is None,
               **_scalars(cfg), **_bias_args(sb, tb, 0, zs), **_launch_opts(),
               maxnreg=ROW_JSD_MAXNREG if cfg.mode == JSD else ROW_KL_MAXNREG)
        if write:
            chunk_gradients(dz, hs, sw, dh, dw32, db32, r0, r1)
    return (*outs, dh, dw32, db32)


def _finish_state(state: torch.Tensor, cfg):
    """(lse_s, entropy, lse_t, KL) (N,) of the tiles' merged statistics (``distill_fold_kernel``), in natural units:
    ``finish``'s formulas on the host side of the tiles (torch ops on (N,) values)."""
    m_s, s_s, a_s, m_t, s_t, gap = state.unbind(1)
    inv_t = 1.0 / cfg.temperature
    log_s = torch.log(s_s)
    lse_s = torch.where(m_s == float("-inf"), 0.0, m_s) * inv_t + log_s
    ent = log_s - math.log(2.0) * a_s / s_s
    lse_t = torch.where(m_t == float("-inf"), 0.0, m_t) * inv_t + torch.log(s_t)
    if cfg.mode == 0:
        kl = math.log(2.0) * gap / s_t - lse_t + lse_s
    else:
        kl = math.log(2.0) * gap / s_s - lse_s + lse_t
    return lse_s, ent, lse_t, kl


def distill_tile_forward(student, teacher, cfg, rows: int, tile: int):
    """(divergence, entropy, lse_s, lse_t, aux) fp32 (N,) over tiles of ``rows`` rows x ``tile`` vocabulary columns:
    per tile both heads' cuBLAS fp32 logits and ``distill_fold_kernel``; for the JSD a second pass over the tiles
    (``distill_jsd_kernel``, both logsumexps known). Extra memory: two fp32 (rows, tile) buffers and 8 fp32 values
    per token."""
    (sh, sw, sb), (th, tw, tb) = student, teacher
    N, V, dev = sh.shape[0], sw.shape[0], sh.device
    state = torch.tensor([float("-inf"), 0.0, 0.0, float("-inf"), 0.0, 0.0], device=dev).repeat(N, 1)
    R = max(1, min(rows, N))
    sbuf, tbuf = _tile_buffers(R, min(tile, V), dev)
    common = dict(**_scalars(cfg), **_launch_opts())
    fold_scalars = {k: v for k, v in common.items() if k not in ("log2_1mb", "log2_b")}

    def tiles(r0, r1):
        for v0 in range(0, V, tile):
            v1 = min(V, v0 + tile)
            zs, zt = _view(sbuf, r1 - r0, v1 - v0), _view(tbuf, r1 - r0, v1 - v0)
            logits_f32(sh[r0:r1], sw[v0:v1], zs)
            logits_f32(th[r0:r1], tw[v0:v1], zt)
            yield v0, v1, zs, zt

    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        for v0, v1, zs, zt in tiles(r0, r1):
            launch(distill_fold_kernel, (r1 - r0,), s_ptr=zs, t_ptr=zt, state_ptr=state, row0=r0, Vc=v1 - v0,
                   stride_s=zs.stride(0), stride_t=zt.stride(0), MODE=cfg.mode, **_bias_args(sb, tb, v0, zs),
                   **fold_scalars)
    lse_s, ent, lse_t, kl = _finish_state(state, cfg)
    if cfg.mode != JSD:
        return kl, ent, lse_s, lse_t, kl.clone()
    sums = torch.zeros((N, 2), dtype=torch.float32, device=dev)
    lse_s, lse_t = lse_s.contiguous(), lse_t.contiguous()
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        for v0, v1, zs, zt in tiles(r0, r1):
            launch(distill_jsd_kernel, (r1 - r0,), s_ptr=zs, t_ptr=zt, **_bias_args(sb, tb, v0, zs), lse_s_ptr=lse_s,
                   lse_t_ptr=lse_t, kl_ptr=sums, row0=r0, Vc=v1 - v0, stride_s=zs.stride(0), stride_t=zt.stride(0),
                   **common)
    kl_p, kl_q = sums.unbind(1)
    return cfg.beta * kl_q + (1.0 - cfg.beta) * kl_p, ent, lse_s, lse_t, kl_p.contiguous()


def distill_tile_backward(student, teacher, cfg, stats, g, rows: int, tile: int, needs: tuple,
                          fixed_rows: bool = False):
    """The recompute backward of ``distill.light``: per vocabulary tile of ``tile`` columns (the outer loop) and
    chunk of ``rows`` rows, both heads' cuBLAS fp32 logits again, ``distill_grad_kernel`` (the student's tile
    rewritten as g * d D / d raw logits, from the forward's ``stats`` = (lse_s, lse_t, aux)), then dH += dZ W_s[tile]
    into an fp32 (N, H) accumulator and dW_s[tile] += dZ^T h_s into an fp32 (tile, H) one, handed to d weight (in
    the weight's dtype) when the tile's rows are done: no V x H fp32 accumulator. ``fixed_rows``: every GEMM on
    exactly ``rows`` rows (the last block zero-padded, its padded rows' d logits zero). Returns (d hidden fp32,
    d weight in the weight's dtype, d bias fp32), None where not wanted."""
    (sh, sw, sb), (th, tw, tb) = student, teacher
    N, H = sh.shape
    V, dev = sw.shape[0], sh.device
    need_h, need_w, need_b = needs
    dh = torch.zeros((N, H), dtype=torch.float32, device=dev) if need_h else None
    dw = alloc((V, H), sw.dtype, dev) if need_w else None
    db = torch.zeros((V,), dtype=torch.float32, device=dev) if need_b and sb is not None else None
    if N == 0:
        return dh, None if dw is None else dw.zero_(), db
    lse_s, lse_t, aux = (t.float().contiguous() for t in stats)
    g = g.float().contiguous()
    R = max(1, rows if fixed_rows else min(rows, N))
    tile = min(tile, V)
    sbuf, tbuf = _tile_buffers(R, tile, dev)
    dw_tile = torch.empty((tile, H), dtype=torch.float32, device=dev) if need_w and sw.dtype != torch.float32 \
        else None
    common = dict(**_scalars(cfg), **_launch_opts())
    for v0 in range(0, V, tile):
        v1 = min(V, v0 + tile)
        acc_w = None if dw is None else (dw[v0:v1] if dw_tile is None else dw_tile[: v1 - v0])
        if acc_w is not None:
            acc_w.zero_()
        for r0 in range(0, N, R):
            r1 = min(N, r0 + R)
            n = R if fixed_rows else r1 - r0
            hs = _rows_of(sh, r0, r1, R, fixed_rows)
            zs, zt = _view(sbuf, n, v1 - v0), _view(tbuf, n, v1 - v0)
            logits_f32(hs, sw[v0:v1], zs)
            logits_f32(_rows_of(th, r0, r1, R, fixed_rows), tw[v0:v1], zt)
            dz = half_view(zs, sh.dtype)
            if n > r1 - r0:
                dz[r1 - r0:].zero_()
            launch(distill_grad_kernel, (r1 - r0,), s_ptr=zs, out_ptr=dz, t_ptr=zt, lse_s_ptr=lse_s, lse_t_ptr=lse_t,
                   aux_ptr=aux, g_ptr=g, row0=r0, Vc=v1 - v0, stride_s=zs.stride(0), stride_out=dz.stride(0),
                   stride_t=zt.stride(0), beta=float(cfg.beta), MODE=cfg.mode,
                   ROUND_BY_HAND=interpreting() and target_arch() is None, **_bias_args(sb, tb, v0, zs), **common)
            if dh is not None:
                _add_hidden_grad(dh, dz, sw[v0:v1], r0, r1)
            if acc_w is not None:
                addmm_f32_(acc_w, dz.t(), hs)
            if db is not None:
                db[v0:v1] += dz.sum(0, dtype=torch.float32)
        if dw_tile is not None:
            dw[v0:v1] = acc_w
    return dh, dw, db


def _add_hidden_grad(dh, dz, w_tile, r0: int, r1: int) -> None:
    """dh[r0:r1] += dZ W_tile in fp32 (dz may be a padded block: its rows past r1 - r0 are dropped)."""
    n = r1 - r0
    if dz.shape[0] == n:
        addmm_f32_(dh[r0:r1], dz, w_tile)
    else:
        part = torch.zeros((dz.shape[0], dh.shape[1]), dtype=torch.float32, device=dh.device)
        addmm_f32_(part, dz, w_tile)
        dh[r0:r1] += part[:n]


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the whole-row epilogue per divergence mode with its gradient in
    each dtype (``distill_row_{fwdkl,revkl,jsd}_{fp32,bf16,fp16}``, biases of the student's dtype on both models),
    without biases and without the gradient in bf16, and with both soft caps (``_softcap``); the tile kernels
    (fold per KL mode, the JSD pass, the gradient per mode and dtype) with biases, and bf16 with the caps."""
    from ..distill_config import DistillLossConfig
    from .linear_tiles import aot_inputs

    modes = {"fwdkl": 0.0, "revkl": 1.0, "jsd": 0.5}

    def heads(dtype, has_bias):
        sh, sw, sb, _ = aot_inputs(dtype, has_bias)
        th, tw, tb, _ = aot_inputs(dtype, has_bias, H=128)
        return (sh, sw, sb), (th, tw, tb)

    def row(dtype, beta, has_bias=True, grad=True, cap=None):
        def thunk():
            s, t = heads(dtype, has_bias)
            cfg = DistillLossConfig(beta=beta, student_softcap=cap, teacher_softcap=cap)
            g = torch.zeros(s[0].shape[0]) if grad else None
            distill_row_chunks(s, t, cfg, 64, g, (True, True, has_bias))
        return thunk

    def tiles(dtype, beta, backward, cap=None):
        def thunk():
            s, t = heads(dtype, True)
            cfg = DistillLossConfig(beta=beta, student_softcap=cap, teacher_softcap=cap)
            N = s[0].shape[0]
            if backward:
                x = torch.zeros(N)
                distill_tile_backward(s, t, cfg, (x, x, x), x, 64, 1024, (True, True, True))
            else:
                distill_tile_forward(s, t, cfg, 64, 1024)
        return thunk

    scenarios = []
    for cap, suffix in ((None, ""), (30.0, "_softcap")):
        for mode, beta in modes.items():
            for dtype, ty in TRITON_DTYPES.items():
                if cap is None or ty == "bf16":
                    scenarios.append((f"distill_row_{mode}_{ty}{suffix}", row(dtype, beta, cap=cap)))
                    scenarios.append((f"distill_tile_bwd_{mode}_{ty}{suffix}", tiles(dtype, beta, True, cap)))
            if cap is None:
                scenarios.append((f"distill_row_{mode}_bf16_nobias", row(torch.bfloat16, beta, has_bias=False)))
                scenarios.append((f"distill_row_{mode}_bf16_nograd", row(torch.bfloat16, beta, grad=False)))
            scenarios.append((f"distill_tile_fwd_{mode}_bf16{suffix}", tiles(torch.bfloat16, beta, False, cap)))
    return scenarios
