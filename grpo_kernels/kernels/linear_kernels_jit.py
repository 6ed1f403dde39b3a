"""The @triton.jit kernels of the fused linear head; launchers, design notes and memory costs are in
``linear_kernels.py``.

This module is imported lazily, on the first launch (``linear_kernels._jit()``), so ``TRITON_INTERPRET`` set any time
before then takes effect (DESIGN.md section 4). The kernels live at module level rather than in a factory closure
because Triton's interpreter re-executes a kernel's source against its module globals only: helpers captured
from an enclosing function would be invisible to it.

Notation: hidden h (N, H), weight W (V, H), optional bias b (V,), logits = h W^T + b, z = logits * inv_temp.
Pointers to hidden/weight/bias share one dtype (fp32, bf16 or fp16); every statistic and accumulator is fp32.
N, V, H, strides and inv_temp are runtime arguments (a new length or temperature does not recompile); only block
sizes and HAS_* / NEED_* / DOT_FP32 flags are constexpr. Row/column offsets are int64 (N*V and V*H exceed 2^31).
"""
from __future__ import annotations

from .._triton import import_triton

triton, tl = import_triton()

# Why -1e30 and not -inf as the empty running max: the rescale `alpha * (a - (m_new - m) * s)` would turn into
# 0 * inf = NaN on the first block; with a finite floor it is exactly 0 * 0.
_NEG_BIG = tl.constexpr(-1e30)


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b with fp32 accumulation.

    DOT_FP32: upcast both tiles to fp32 and multiply with IEEE fp32 (no TF32). It is set for fp32 inputs (the fp32
    contract needs it on GPU) and, under TRITON_INTERPRET only, for bf16 (the interpreter's bf16 tl.dot is
    wrong); compiled bf16/fp16 dots stay native so they lower to HGMMA/HMMA.
    """
    if DOT_FP32:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _to_input_dtype(x, dtype: tl.constexpr, DOT_FP32: tl.constexpr):
    """fp32 ``x`` rounded to nearest-even into ``dtype`` (the hidden/weight dtype).

    Why by hand for bf16 under DOT_FP32: that pair occurs only under TRITON_INTERPRET, whose fp32 -> bf16 cast
    truncates (and whose "rtne" mode drops the carry into the exponent); compiled code casts with cvt.rn.
    """
    if DOT_FP32 and dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, H, stride_h, stride_w, inv_temp,
                 HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT_FP32: tl.constexpr):
    """z tile (BLOCK_M, BLOCK_V) fp32 = (h[rows_c] @ W[cols_c]^T + b[cols_c]) * inv_temp.

    rows_c / cols_c are already clamped into [0, N) / [0, V): out-of-range lanes recompute a valid row or column
    (discarded by the caller) instead of carrying a mask on every load, so only the H tail is masked.
    """
    # Why int64 row offsets: V * H and N * H exceed 2^31 at real sizes (V = 262144, H = 8192).
    h_rows = h_ptr + rows_c.to(tl.int64)[:, None] * stride_h
    w_rows = w_ptr + cols_c.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_M, BLOCK_V), dtype=tl.float32)
    # Why a K loop inside each vocab tile: the (BLOCK_M, BLOCK_V) logit tile lives only in registers; N x V logits
    # are never written to memory.
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = (ks < H)[None, :]
        h = tl.load(h_rows + ks[None, :], mask=k_ok, other=0.0)
        w = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0)
        acc = _mma(h, tl.trans(w), acc, DOT_FP32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols_c).to(tl.float32)[None, :]
    return acc * inv_temp


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_splits", "v_per_split"])
def linear_fwd_partial_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, part_ptr,
                              N, V, H, stride_h, stride_w, inv_temp, n_m_blocks, n_splits, v_per_split,
                              HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr,
                              BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Per (token block, vocab split): online logsumexp statistics over the split's vocab range.

    part_ptr: fp32 (4, n_splits, N) = running max m, sum exp(z - m), sum exp(z - m) * (z - m), target z
    (0 in the splits that do not hold the target). 1-D grid of n_m_blocks * n_splits programs.
    """
    # Why the split varies fastest: programs running together cover a few token blocks times all splits, so the
    # L2 working set is (their hidden blocks + one W tile per split), not the whole N x H hidden per step.
    pid = tl.program_id(0)
    pid_s = pid % n_splits
    pid_m = pid // n_splits
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, N - 1)
    target = tl.load(ids_ptr + rows_c)
    m_i = tl.full((BLOCK_M,), _NEG_BIG, dtype=tl.float32)
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    # Why split the vocab sweep: N / BLOCK_M programs alone (32 at N = 4k) cannot fill 132 SMs; the launcher picks
    # n_splits so that n_m_blocks * n_splits is about two waves, and a tiny merge kernel combines the partials.
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, tl.minimum(cols, V - 1), H, stride_h, stride_w, inv_temp,
                         HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
        # Why a finite floor for the padded columns: exp gives exactly 0 there and e * (z - m) stays 0 * finite,
        # so no NaN needs masking.
        z = tl.where(col_ok[None, :], z, _NEG_BIG)
        # Why track a = sum e^(z-m) (z-m) rather than sum e^(z-m) z: entropy = log s - a / s then has no
        # cancellation between two large numbers when |z| is large.
        m_new = tl.maximum(m_i, tl.max(z, axis=1))
        alpha = tl.exp(m_i - m_new)
        u = z - m_new[:, None]
        e = tl.exp(u)
        # Why the guard: a -inf logit (a banned token's -inf bias) has e = 0 but u = -inf, and 0 * -inf is NaN.
        a_i = alpha * (a_i - (m_new - m_i) * s_i) + tl.sum(tl.where(e > 0.0, e * u, 0.0), axis=1)
        s_i = alpha * s_i + tl.sum(e, axis=1)
        # Why gather in the tile: the target logit is already on chip; exactly one split adds a non-zero.
        t_i += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        m_i = m_new
    row_ok = rows < N
    plane = N.to(tl.int64) * n_splits
    out = part_ptr + pid_s.to(tl.int64) * N + rows
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + plane, s_i, mask=row_ok)
    tl.store(out + 2 * plane, a_i, mask=row_ok)
    tl.store(out + 3 * plane, t_i, mask=row_ok)


@triton.jit(do_not_specialize=["N", "n_splits"])
def linear_fwd_merge_kernel(part_ptr, logp_ptr, lse_ptr, ent_ptr, N, n_splits, BLOCK_N: tl.constexpr):
    """Merge the n_splits partials of each token into logp, lse, entropy (fp32 (N,)), in a fixed split order.

    Why a separate kernel rather than atomics in the partial kernel: a fixed-order merge is deterministic and
    costs 16 * n_splits bytes per token.
    """
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    plane = N.to(tl.int64) * n_splits
    m = tl.full((BLOCK_N,), _NEG_BIG, dtype=tl.float32)
    for sp in range(0, n_splits):
        m = tl.maximum(m, tl.load(part_ptr + sp * N + rows, mask=row_ok, other=0.0))
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for sp in range(0, n_splits):
        p = part_ptr + sp * N + rows
        m_s = tl.load(p, mask=row_ok, other=0.0)
        s_s = tl.load(p + plane, mask=row_ok, other=1.0)
        a_s = tl.load(p + 2 * plane, mask=row_ok, other=0.0)
        c = tl.exp(m_s - m)
        # Re-centre each split's sum e^(z-m_s)(z-m_s) on the global max m.
        s += c * s_s
        a += c * (a_s + (m_s - m) * s_s)
        t += tl.load(p + 3 * plane, mask=row_ok, other=0.0)
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(logp_ptr + rows, t - lse, mask=row_ok)
    tl.store(ent_ptr + rows, log_s - a / s, mask=row_ok)


@triton.jit
def _grouped_tile(pid, n_m_blocks, n_v_blocks, GROUP_M: tl.constexpr):
    """(token block, vocab block) of program ``pid``, GROUP_M token blocks at a time (matmul-style swizzle).

    Why: programs running together then form a roughly square patch of tiles and share both their hidden
    blocks and their W blocks through L2, instead of streaming all of W (or all of hidden) per wave.
    """
    per_group = GROUP_M * n_v_blocks
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(n_m_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_m, (pid % per_group) // group_m


@triton.jit
def _dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temp,
                  HAS_ENTROPY_GRAD: tl.constexpr):
    """d loss / d logits tile (fp32) from the z tile: (g (onehot - p) - g_H p (log p + H)) * inv_temp.

    Zero outside the valid rows and columns, so padded lanes add nothing to dW, dbias or dh.
    """
    lse = tl.load(lse_ptr + rows_c)
    g = tl.load(gl_ptr + rows_c)
    target = tl.load(ids_ptr + rows_c)
    # Why recompute p from the saved lse: the softmax is never stored; one exp per element.
    logp = z - lse[:, None]
    p = tl.exp(logp)
    dz = tl.where(cols[None, :] == target[:, None], g[:, None], 0.0) - g[:, None] * p
    if HAS_ENTROPY_GRAD:
        # Why a constexpr: without an entropy bonus this term (two loads, three FLOPs per element) is not compiled.
        g_h = tl.load(ge_ptr + rows_c)
        ent = tl.load(ent_ptr + rows_c)
        dz -= g_h[:, None] * p * tl.where(p > 0.0, logp + ent[:, None], 0.0)
    return tl.where(row_ok[:, None] & col_ok[None, :], dz * inv_temp, 0.0)


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_v_blocks"])
def linear_bwd_atomic_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr,
                             dh_ptr, dw_ptr, db_ptr,
                             N, V, H, stride_h, stride_w, inv_temp, n_m_blocks, n_v_blocks,
                             HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, NEED_H: tl.constexpr,
                             NEED_W: tl.constexpr, NEED_B: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             DOT_FP32: tl.constexpr):
    """One (token block, vocab block) tile of the backward; partial dh, dW, dbias go out by fp32 atomic adds.

    dh_ptr fp32 (N, H), dw_ptr fp32 (V, H), db_ptr fp32 (V,): zero-initialised, contiguous. 1-D grid of
    n_m_blocks * n_v_blocks programs (CCE-style). Not deterministic: the order of the float adds varies.
    """
    pid_m, pid_v = _grouped_tile(tl.program_id(0), n_m_blocks, n_v_blocks, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    rows_c = tl.minimum(rows, N - 1)
    cols_c = tl.minimum(cols, V - 1)
    # Why recompute the logit tile (2 * BLOCK_M * BLOCK_V * H FLOPs) instead of loading it: N x V logits are
    # never stored; recomputing is the price of O(N + V) extra memory.
    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, H, stride_h, stride_w, inv_temp,
                     HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
    dl = _dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temp,
                       HAS_ENTROPY_GRAD)
    if NEED_B:
        tl.atomic_add(db_ptr + cols, tl.sum(dl, axis=0), mask=col_ok, sem="relaxed")
    if NEED_H or NEED_W:
        # Why round d logits to the input dtype: the tensor cores take bf16/fp16 operands (as eager PyTorch's
        # backward does, which keeps d logits in the logits dtype).
        dl_c = _to_input_dtype(dl, h_ptr.dtype.element_ty, DOT_FP32)
        h_rows = h_ptr + rows_c.to(tl.int64)[:, None] * stride_h
        w_rows = w_ptr + cols_c.to(tl.int64)[:, None] * stride_w
        dh_rows = dh_ptr + rows.to(tl.int64)[:, None] * H
        dw_rows = dw_ptr + cols.to(tl.int64)[:, None] * H
        # Why a second K loop: dh = dl @ W and dW = dl^T @ h consume the finished dl tile chunk by chunk of H;
        # relaxed atomics (no fences) since the sums are read only after the kernel ends.
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = (ks < H)[None, :]
            if NEED_H:
                w = tl.load(w_rows + ks[None, :], mask=k_ok, other=0.0)
                dh = _mma(dl_c, w, tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32), DOT_FP32)
                tl.atomic_add(dh_rows + ks[None, :], dh, mask=row_ok[:, None] & k_ok, sem="relaxed")
            if NEED_W:
                h = tl.load(h_rows + ks[None, :], mask=k_ok, other=0.0)
                dw = _mma(tl.trans(dl_c), h, tl.zeros((BLOCK_V, BLOCK_K), dtype=tl.float32), DOT_FP32)
                tl.atomic_add(dw_rows + ks[None, :], dw, mask=col_ok[:, None] & k_ok, sem="relaxed")


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_v_blocks", "v_begin", "v_end"])
def linear_dlogits_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, dl_ptr,
                          N, V, H, stride_h, stride_w, stride_dl, inv_temp, n_m_blocks, n_v_blocks, v_begin, v_end,
                          HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                          DOT_FP32: tl.constexpr):
    """Deterministic backward, step 1: d logits for vocab columns [v_begin, v_end) of all N tokens.

    dl_ptr (N, v_end - v_begin) in the input dtype, row stride stride_dl; column j holds vocab v_begin + j.
    Each program owns one output tile, so there is no reduction here at all; the launcher turns the chunk into
    dh, dW and dbias with fixed-order matmuls/sums. 1-D grid of n_m_blocks * n_v_blocks,
    n_v_blocks = ceil((v_end - v_begin) / BLOCK_V).
    """
    pid_m, pid_v = _grouped_tile(tl.program_id(0), n_m_blocks, n_v_blocks, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = v_begin + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < v_end
    rows_c = tl.minimum(rows, N - 1)
    z = _logits_tile(h_ptr, w_ptr, b_ptr, rows_c, tl.minimum(cols, V - 1), H, stride_h, stride_w, inv_temp,
                     HAS_BIAS, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
    dl = _dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temp,
                       HAS_ENTROPY_GRAD)
    out = dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + (cols - v_begin)[None, :]
    tl.store(out, _to_input_dtype(dl, dl_ptr.dtype.element_ty, DOT_FP32), mask=row_ok[:, None] & col_ok[None, :])
