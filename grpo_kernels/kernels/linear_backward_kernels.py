"""Fused linear head, backward: d hidden, d weight and d bias from the per-token gradients of log-prob and entropy,
recomputing the logit tiles from the saved logsumexp. Kernels and their launcher ``linear_logprobs_backward``;
shared helpers and the tile table in ``linear_tiles.py``.

With a soft cap (``softcap``) every route recomputes the capped logits from the raw ones and multiplies d logits
by the cap's derivative (``linear_tiles.dlogits_tile``, the epilogue's ``dlogits_chunk``), so what reaches the
GEMMs is the gradient with respect to the raw logits h W^T + b.

``deterministic=True`` (the default): no float atomics anywhere. Rows run in blocks of ``row_block`` (all N when the
plan allows, ``planner.plan_head`` / ``backward_layout``); per block the vocab is cut into chunks of Vc columns; per
chunk a kernel writes d logits (Rb, Vc) in the input dtype (every program owns its output tile), then fixed-order
cuBLAS/torch ops finish the job: dW[chunk] = dl^T @ hidden (written by the first block, added to by the next ones
in the weight's dtype: one rounding per block), dbias[chunk] += column sum (fp32), dh[block] += dl @ W[chunk]
(accumulated over chunks in an fp32 buffer of the block by cuBLAS itself, beta = 1, for bf16/fp16: no
half-precision product in between). Vc is all V when a chunk of every column fits ``chunk_bytes``, else the largest
multiple of BLOCK_V within it (at least BLOCK_V; without a plan, 1% of the N x V fp32 logits,
``DETERMINISTIC_CHUNK_FRACTION``; the testing override's ``chunk_bytes`` caps it). cuBLAS is run-to-run
deterministic on a given GPU and library version (set CUBLAS_WORKSPACE_CONFIG=:4096:8 when streams vary). With fp32
inputs the matmuls follow torch's fp32 matmul precision setting ("highest" by default, i.e. no TF32).

``deterministic=False``: CCE-style grid n_m_blocks x n_v_blocks (GROUP_M swizzle, so that concurrent programs
share hidden and W blocks in L2); each program recomputes its logit tile, forms d logits in registers, then for
each H chunk adds dl @ W[vblock] into dh and dl^T @ h[mblock] into dW with relaxed fp32 atomics (dbias: column
sums of dl). dh, dW and dbias are each compiled in only when requested (NEED_* constexprs): a frozen / LoRA head
pays for neither the dW dot nor its atomics. Results vary in the last bits from run to run.

Extra device memory beyond inputs, outputs and the returned gradients (it = itemsize of the input dtype):
- atomic: fp32 accumulators cast to the input dtype at the end, for bf16/fp16 inputs only: 4 N H if dh is
  requested, 4 V H if dW, 4 V if dbias (2.5 GB of dW accumulator at V = 152k, H = 4096).
- deterministic: the d logits chunk, Rb * min(V, Vc) * it bytes (4 Rb min(V, Vc) when d logits come from cuBLAS
  fp32 logits + the row-sweep epilogue, ``dlogits_by_gemm``: CUDA bf16/fp16); plus 4 V (fp32 dbias) when dbias is
  requested; plus 4 Rb H (the block's fp32 dh accumulator) when dh is requested with bf16/fp16 and V needs more
  than one chunk (docs/memory.md).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._checks import alloc
from ..invariance import padded
from . import linear_tiles as tiles
from .._testing import knobs, override
from .host import TRITON_DTYPES, cap_args, cdiv, check_inputs, half_view, per_token
from .launch import as_cuda, launch
from .fp32_gemm import addmm_f32_, logits_f32
from .linear_epilogue_kernels import dlogits_chunk
from .linear_tiles import dlogits_tile, grouped_tile, logits_tile, mma, to_input_dtype, tl, triton

# d logits chunk of the deterministic backward when the caller gives no budget: this fraction of N x V fp32 logits.
DETERMINISTIC_CHUNK_FRACTION = 0.01


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_v_blocks"])
def linear_bwd_atomic_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr,
                             dh_ptr, dw_ptr, db_ptr,
                             N, V, H, stride_h, stride_w, inv_temperature, n_m_blocks, n_v_blocks, softcap,
                             HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, NEED_H: tl.constexpr,
                             NEED_W: tl.constexpr, NEED_B: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                             DOT_FP32: tl.constexpr):
    """One (token block, vocab block) tile of the backward; partial dh, dW, dbias go out by fp32 atomic adds.

    dh_ptr fp32 (N, H), dw_ptr fp32 (V, H), db_ptr fp32 (V,): zero-initialised, contiguous. 1-D grid of
    n_m_blocks * n_v_blocks programs (CCE-style). Not deterministic: the order of the float adds varies.
    """
    pid_m, pid_v = grouped_tile(tl.program_id(0), n_m_blocks, n_v_blocks, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < V
    rows_c = tl.minimum(rows, N - 1)
    cols_c = tl.minimum(cols, V - 1)
    # Why recompute the logit tile (2 * BLOCK_M * BLOCK_V * H FLOPs) instead of loading it: N x V logits are
    # never stored; recomputing is the price of O(N + V) extra memory.
    z = logits_tile(h_ptr, w_ptr, b_ptr, rows_c, cols_c, H, stride_h, stride_w, inv_temperature, softcap,
                    HAS_BIAS, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
    dl = dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temperature,
                      softcap, HAS_ENTROPY_GRAD, SOFTCAP)
    if NEED_B:
        tl.atomic_add(db_ptr + cols, tl.sum(dl, axis=0), mask=col_ok, sem="relaxed")
    if NEED_H or NEED_W:
        # Why round d logits to the input dtype: the tensor cores take bf16/fp16 operands (as eager PyTorch's
        # backward does, which keeps d logits in the logits dtype).
        dl_c = to_input_dtype(dl, h_ptr.dtype.element_ty, DOT_FP32)
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
                dh = mma(dl_c, w, tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32), DOT_FP32)
                tl.atomic_add(dh_rows + ks[None, :], dh, mask=row_ok[:, None] & k_ok, sem="relaxed")
            if NEED_W:
                h = tl.load(h_rows + ks[None, :], mask=k_ok, other=0.0)
                dw = mma(tl.trans(dl_c), h, tl.zeros((BLOCK_V, BLOCK_K), dtype=tl.float32), DOT_FP32)
                tl.atomic_add(dw_rows + ks[None, :], dw, mask=col_ok[:, None] & k_ok, sem="relaxed")


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_v_blocks", "v_begin", "v_end"])
def linear_dlogits_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, dl_ptr,
                          N, V, H, stride_h, stride_w, stride_dl, inv_temperature, n_m_blocks, n_v_blocks,
                          v_begin, v_end, softcap, HAS_BIAS: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr,
                          SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, DOT_FP32: tl.constexpr):
    """Deterministic backward, step 1: d logits for vocab columns [v_begin, v_end) of all N tokens.

    dl_ptr (N, v_end - v_begin) in the input dtype, row stride stride_dl; column j holds vocab v_begin + j.
    Each program owns one output tile, so there is no reduction here at all; the launcher turns the chunk into
    dh, dW and dbias with fixed-order matmuls/sums. 1-D grid of n_m_blocks * n_v_blocks,
    n_v_blocks = ceil((v_end - v_begin) / BLOCK_V).
    """
    pid_m, pid_v = grouped_tile(tl.program_id(0), n_m_blocks, n_v_blocks, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = v_begin + pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < N
    col_ok = cols < v_end
    rows_c = tl.minimum(rows, N - 1)
    z = logits_tile(h_ptr, w_ptr, b_ptr, rows_c, tl.minimum(cols, V - 1), H, stride_h, stride_w, inv_temperature,
                    softcap, HAS_BIAS, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
    dl = dlogits_tile(z, rows_c, cols, row_ok, col_ok, ids_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, inv_temperature,
                      softcap, HAS_ENTROPY_GRAD, SOFTCAP)
    out = dl_ptr + rows.to(tl.int64)[:, None] * stride_dl + (cols - v_begin)[None, :]
    tl.store(out, to_input_dtype(dl, dl_ptr.dtype.element_ty, DOT_FP32), mask=row_ok[:, None] & col_ok[None, :])


def linear_logprobs_backward(hidden, weight, bias, ids, stats, transform, needs: tuple,
                             deterministic: bool, chunk_bytes: int | None = None, row_block: int | None = None,
                             fixed_rows: bool = False):
    """(d_hidden | None, d_weight | None, d_bias | None) in hidden's / weight's / bias' dtype.

    Inputs as in ``linear_logprobs_forward`` plus ``stats`` (an ``inputs.LogprobGrads``: the forward's lse and
    entropy and the per-token grads grad_logp and grad_entropy, fp32 (N,); grad_entropy None: its term is then not
    compiled in); transform: the logits transform (``config.LogitTransform``: temperature, soft cap); needs:
    (d hidden, d weight, d bias) wanted.
    Per element dz_v = grad_logp (onehot_v - p_v) - grad_entropy p_v (log p_v + entropy), d logits =
    dz / temperature, times 1 - (y_v / softcap)^2 with a soft cap (y = softcap tanh(x / softcap); lse / entropy are
    the capped logits'). ``deterministic`` selects the atomic-free path (see the module docstring for both paths and
    their memory); chunk_bytes bounds its d-logits chunk (None: ``DETERMINISTIC_CHUNK_FRACTION`` of the N x V fp32
    logits) and row_block its rows (None: all N), both from the plan (``backward_layout``). ``fixed_rows`` (batch
    invariance): every block has exactly row_block rows, the last one padded with rows of zero gradient, so every
    GEMM and kernel of the backward has the same shape whatever N is (``invariance.py``).
    """
    temperature, softcap = transform.temperature, transform.softcap
    need_hidden, need_weight, need_bias = needs
    lse, entropy, grad_logp, grad_entropy = stats.lse, stats.entropy, stats.grad_logp, stats.grad_entropy
    N, V, H = check_inputs(hidden, weight, bias, ids)
    need_bias = bool(need_bias) and bias is not None
    dev = hidden.device
    f32 = torch.float32
    lse, grad_logp = per_token(lse, N), per_token(grad_logp, N)
    has_ent = grad_entropy is not None
    if has_ent:
        grad_entropy, entropy = per_token(grad_entropy, N), per_token(entropy, N)
    if N == 0 or not (need_hidden or need_weight or need_bias):
        return (torch.zeros_like(hidden) if need_hidden else None, torch.zeros_like(weight) if need_weight else None,
                torch.zeros_like(bias) if need_bias else None)
    common = dict(hidden=hidden, weight=weight, bias=bias, ids=ids, lse=lse, entropy=entropy if has_ent else lse,
                  grad_logp=grad_logp, grad_entropy=grad_entropy if has_ent else grad_logp,
                  inv_temperature=1.0 / temperature, has_ent=has_ent, softcap=softcap,
                  round_logits=transform.round_logits)
    if deterministic:
        if chunk_bytes is None:
            chunk_bytes = int(DETERMINISTIC_CHUNK_FRACTION * 4 * N * V)
        if knobs().chunk_bytes is not None:
            chunk_bytes = min(chunk_bytes, knobs().chunk_bytes)
        rows = N if row_block is None else max(1, row_block if fixed_rows else min(N, row_block))
        return _backward_row_blocks(common, N, V, H, (need_hidden, need_weight, need_bias), chunk_bytes, rows,
                                    fixed_rows)
    tile, _, dot_fp32 = tiles.launch_params("bwd", hidden.dtype, dev)
    dh = torch.zeros((N, H), dtype=f32, device=dev) if need_hidden else None
    dw = torch.zeros((V, H), dtype=f32, device=dev) if need_weight else None
    db = torch.zeros((V,), dtype=f32, device=dev) if need_bias else None
    n_m, n_v = cdiv(N, tile.block_m), cdiv(V, tile.block_v)
    launch(linear_bwd_atomic_kernel, (n_m * n_v,),
        hidden, weight, weight if bias is None else bias, ids, common["lse"], common["entropy"], grad_logp,
        common["grad_entropy"], lse if dh is None else dh, lse if dw is None else dw, lse if db is None else db,
        N, V, H, hidden.stride(0), weight.stride(0), common["inv_temperature"], n_m, n_v,
        HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=has_ent, NEED_H=need_hidden, NEED_W=need_weight,
        NEED_B=need_bias, BLOCK_M=tile.block_m, BLOCK_V=tile.block_v, BLOCK_K=tile.block_k, GROUP_M=tiles.GROUP_M,
        DOT_FP32=dot_fp32,
        num_warps=tile.num_warps, num_stages=tile.num_stages, **cap_args(softcap, transform.round_logits))
    return (None if dh is None else dh.to(hidden.dtype), None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype))


def _chunk_cols(chunk_bytes: int, rows: int, V: int, esize: int, block_v: int) -> int:
    """Vocab columns of a d-logits chunk of ``rows`` rows within chunk_bytes: all V when they fit, else a multiple
    of the tile's block (at least one block)."""
    cols = chunk_bytes // max(1, rows * esize)
    if cols >= V:
        return V
    return max(block_v, cols // block_v * block_v)


def _dlogits_geometry(dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    """(bytes per d-logits element of the chunk buffer, vocab block of the d-logits tile kernel)."""
    by_gemm = dlogits_by_gemm(dtype, device)
    if device.type == "meta":  # a plan made without data: the sm_90 table
        block_v = tiles.TILES[(90, "dlogits", "fp32" if dtype == torch.float32 else "half")].block_v
    else:
        block_v = tiles.launch_params("dlogits", dtype, device)[0].block_v
    return (4 if by_gemm else dtype.itemsize), block_v


@dataclass(frozen=True)
class BackwardLayout:
    """The light path's backward geometry: rows per block, d-logits chunk bytes per block, and what it allocates
    beyond its inputs and returned gradients (``items``: (what, bytes))."""

    row_block: int
    chunk_bytes: int | None
    items: tuple

    @property
    def transient_bytes(self) -> int:
        return sum(b for _, b in self.items)


def backward_layout(N, V, H, dtype, device, room, need_hidden, need_weight, need_bias, deterministic):
    """The backward's geometry within ``room`` bytes (None: the smallest one), or None when even that does not fit.

    One block of all N rows when its fp32 d hidden accumulator fits beside a chunk of at least one tile block;
    else blocks of fewer rows (d weight is then summed over blocks in the weight's dtype)."""
    half = dtype != torch.float32
    db = 4 * V if need_bias and half else 0
    if not deterministic:
        items = (("fp32 d hidden accumulator", 4 * N * H if need_hidden and half else 0),
                 ("fp32 d weight accumulator", 4 * V * H if need_weight and half else 0), ("fp32 d bias", db))
        layout = BackwardLayout(max(N, 1), None, items)
        return layout if room is None or layout.transient_bytes <= room else None
    esize, block_v = _dlogits_geometry(dtype, device)

    def layout(rows, cols):
        n_chunks = -(-V // cols)
        dh = 4 * rows * H if need_hidden and half and n_chunks > 1 else 0
        return BackwardLayout(rows, rows * cols * esize, (("d logits chunk", rows * min(cols, V) * esize),
                                                          ("fp32 d hidden of a row block", dh), ("fp32 d bias", db)))

    N1 = max(N, 1)
    if room is None:
        return layout(1, min(V, block_v))
    if db + N1 * V * esize <= room:
        return layout(N1, V)
    dh_all = 4 * N1 * H if need_hidden and half else 0
    cols = _chunk_cols(room - db - dh_all, N1, V, esize, block_v) if room - db - dh_all > 0 else 0
    if cols and N1 * cols * esize + dh_all + db <= room:
        return layout(N1, cols)
    target = min(V, max(block_v, 1024 // block_v * block_v))
    per_row = (4 * H if need_hidden and half else 0) + target * esize
    rows = (room - db) // per_row if room > db else 0
    if rows < 1:
        per_row = (4 * H if need_hidden and half else 0) + min(V, block_v) * esize
        rows = (room - db) // per_row if room > db else 0
        if rows < 1:
            return None
    rows = min(rows, N1)
    rows = -(-N1 // -(-N1 // rows))  # evenly spread blocks
    left = room - db - (4 * rows * H if need_hidden and half else 0)
    best = layout(rows, _chunk_cols(max(left, 0), rows, V, esize, block_v))
    return best if best.transient_bytes <= room else None


def _backward_row_blocks(c: dict, N: int, V: int, H: int, needs: tuple, chunk_bytes: int, row_block: int,
                         fixed_rows: bool = False):
    """The deterministic backward over blocks of ``row_block`` rows: each block's d hidden is complete when the
    block ends; d weight and d bias accumulate over blocks (in the weight's dtype / fp32). ``fixed_rows``: a last
    short block is padded to row_block rows of zero gradient (``invariance.padded``); its d hidden rows past N are
    dropped and it adds exact zeros to d weight / d bias."""
    need_hidden, need_weight, need_bias = needs
    hidden, weight, bias = c["hidden"], c["weight"], c["bias"]
    dev = hidden.device
    d_hidden = alloc((N, H), hidden.dtype, dev) if need_hidden else None
    d_weight = alloc(tuple(weight.shape), weight.dtype, dev) if need_weight else None
    db32 = torch.zeros((V,), dtype=torch.float32, device=dev) if need_bias else None
    for r0 in range(0, N, row_block):
        r1 = min(N, r0 + row_block)
        rows = row_block if fixed_rows else r1 - r0
        block = dict(c, **{k: padded(c[k], r0, r1, rows) for k in
                           ("hidden", "ids", "lse", "entropy", "grad_logp", "grad_entropy")})
        dh_block = None if d_hidden is None else (d_hidden[r0:r1] if rows == r1 - r0 else
                                                  alloc((rows, H), hidden.dtype, dev))
        _backward_chunked(block, rows, V, H, chunk_bytes, dh_block, d_weight, db32, accumulate=r0 > 0)
        if dh_block is not None and rows != r1 - r0:
            d_hidden[r0:r1] = dh_block[: r1 - r0]
    return d_hidden, d_weight, None if db32 is None else db32.to(bias.dtype)


def _backward_chunked(c: dict, N: int, V: int, H: int, chunk_bytes: int, d_hidden, d_weight, db32,
                      accumulate: bool) -> None:
    """Deterministic backward of one row block: d logits per vocab chunk, then fixed-order matmuls and sums into
    d_hidden (this block's rows), d_weight (written, or added to when ``accumulate``) and db32 (added to).

    d logits come from the Triton tile kernel, or (``dlogits_by_gemm``) from cuBLAS fp32 logits of the chunk plus
    the row-sweep epilogue that rewrites them in place: the chunk's buffer is then 4 N Vc bytes instead of it N Vc.
    """
    hidden, weight, bias = c["hidden"], c["weight"], c["bias"]
    dtype, dev = hidden.dtype, hidden.device
    tile, _, dot_fp32 = tiles.launch_params("dlogits", dtype, dev)
    by_gemm = dlogits_by_gemm(dtype, dev)
    chunk = _chunk_cols(chunk_bytes, N, V, 4 if by_gemm else hidden.element_size(), tile.block_v)
    n_chunks = cdiv(V, chunk)
    if by_gemm:
        zflat = alloc((N * min(chunk, V),), torch.float32, dev)
    else:
        buf = alloc((N, min(chunk, V)), dtype, dev)
    dh32 = None
    if d_hidden is not None and n_chunks > 1:
        if dtype == torch.float32:
            d_hidden.zero_()
        else:
            dh32 = torch.zeros((N, H), dtype=torch.float32, device=dev)
    for v0 in range(0, V, chunk):
        v1 = min(V, v0 + chunk)
        if by_gemm:
            z = zflat[: N * (v1 - v0)].view(N, v1 - v0)
            logits_f32(hidden, weight[v0:v1], z)
            dl = half_view(z, dtype)
            dlogits_chunk(z, dl, bias, c["ids"], c["lse"], c["entropy"], c["grad_logp"],
                          c["grad_entropy"] if c["has_ent"] else None, v0, c["inv_temperature"], softcap=c["softcap"],
                          round_logits=c["round_logits"])
        else:
            dl = buf[:, : v1 - v0]
            dlogits_tiles(c, buf, tile, dot_fp32, N, V, H, v0, v1)
        # Why these ops are deterministic: each is a fixed-shape cuBLAS GEMM or a torch reduction, and every output
        # element is produced by exactly one of them per chunk and block, in a fixed order (no float atomics).
        if d_weight is not None:
            if accumulate:
                d_weight[v0:v1].addmm_(dl.t(), hidden)
            else:
                torch.mm(dl.t(), hidden, out=d_weight[v0:v1])
        if db32 is not None:
            db32[v0:v1] += dl.sum(dim=0, dtype=torch.float32)
        if d_hidden is not None:
            w_chunk = weight[v0:v1]
            if n_chunks == 1:
                torch.mm(dl, w_chunk, out=d_hidden)
            elif dh32 is None:
                d_hidden.addmm_(dl, w_chunk)
            else:
                addmm_f32_(dh32, dl, w_chunk)
    if dh32 is not None:
        d_hidden.copy_(dh32)


def dlogits_tiles(c: dict, buf, tile, dot_fp32: int, N: int, V: int, H: int, v0: int, v1: int) -> None:
    """d logits of vocab columns [v0, v1) into buf[:, :v1 - v0] with the Triton tile kernel (recomputed logits)."""
    hidden, weight, bias = c["hidden"], c["weight"], c["bias"]
    n_m, n_v = cdiv(N, tile.block_m), cdiv(v1 - v0, tile.block_v)
    launch(linear_dlogits_kernel, (n_m * n_v,),
           hidden, weight, weight if bias is None else bias, c["ids"], c["lse"], c["entropy"], c["grad_logp"],
           c["grad_entropy"], buf, N, V, H, hidden.stride(0), weight.stride(0), buf.stride(0), c["inv_temperature"],
           n_m, n_v, v0, v1, HAS_BIAS=bias is not None, HAS_ENTROPY_GRAD=c["has_ent"], BLOCK_M=tile.block_m,
           BLOCK_V=tile.block_v, BLOCK_K=tile.block_k, GROUP_M=tiles.GROUP_M, DOT_FP32=dot_fp32,
           num_warps=tile.num_warps, num_stages=tile.num_stages, **cap_args(c["softcap"], c["round_logits"]))


def dlogits_by_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the deterministic backward forms d logits as cuBLAS fp32 logits + the row-sweep epilogue.

    On CUDA for bf16/fp16, where cuBLAS runs the recompute GEMM faster than the Triton tile kernel (60-70% of cuBLAS
    measured on an H200); fp32 keeps the tile kernel (IEEE fp32 either way). The testing override's
    ``dlogits_by_gemm`` forces either route.
    """
    if knobs().dlogits_by_gemm is not None:
        return knobs().dlogits_by_gemm
    return as_cuda(device) and dtype != torch.float32




def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``, recorded as a CUDA run launches them (``launch.recording``):
    both backward modes per dtype, bias and entropy gradient; the atomic kernel also per combination of requested
    gradients (each is a separate compiled variant); and the tile kernels of both modes, heaviest flags, with the
    soft cap on (``_softcap``). fp32 scenarios are recorded under TF32 too (``tools.aot.module_configs``: ``_tf32``).

    The deterministic mode's d logits come, on a GPU, from the Triton tile kernel for fp32 (``linear_dlogits_*``)
    and from cuBLAS fp32 logits + ``head_dlogits_kernel`` for bf16 / fp16 (``head_dlogits_light_*``, every bias /
    entropy / cap combination); the bf16 / fp16 tile kernel is reached only through the testing knob
    ``dlogits_by_gemm=False`` (``linear_dlogits_bf16_*``, ``linear_dlogits_fp16_*``: recorded with it)."""
    from ..config import LogitTransform
    from ..inputs import LogprobGrads

    def scenario(dtype, has_bias, has_ent, need, deterministic, softcap=None, by_gemm=None):
        def thunk():
            hidden, weight, bias, ids = tiles.aot_inputs(dtype, has_bias)
            x = torch.zeros(hidden.shape[0])
            # Why the chunk budget: two vocab chunks of 1024 columns (the variants do not depend on the chunk
            # count; the recorded route's CPU GEMMs per chunk would dominate the recording time).
            with override(dlogits_by_gemm=by_gemm):
                linear_logprobs_backward(hidden, weight, bias, ids, LogprobGrads(x, x, x, x if has_ent else None),
                                         LogitTransform(1.0, softcap), need, deterministic,
                                         chunk_bytes=4 * 1024 * hidden.shape[0])
        return thunk

    scenarios = []
    for dtype, ty in TRITON_DTYPES.items():
        half = dtype != torch.float32
        for has_bias in (False, True):
            b = "bias" if has_bias else "nobias"
            for has_ent in (False, True):
                e = "ent" if has_ent else "noent"
                need = (True, True, has_bias)
                scenarios.append((f"linear_dlogits_{ty}_{b}_{e}",
                                  scenario(dtype, has_bias, has_ent, need, True, by_gemm=False if half else None)))
                if half:
                    for cap in (None, 30.0):
                        scenarios.append((f"head_dlogits_light_{ty}_{b}_{e}{'_softcap' if cap else ''}",
                                          scenario(dtype, has_bias, has_ent, need, True, cap)))
                for need in _need_combos(has_bias):
                    flags = "".join(n for n, f in zip("hwb", need) if f)
                    scenarios.append((f"linear_bwd_atomic_{ty}_{b}_{e}_{flags}",
                                      scenario(dtype, has_bias, has_ent, need, False)))
    for dtype, ty in TRITON_DTYPES.items():
        if ty != "fp16":  # the fp16 tile kernel (testing knob only) is bf16's with another store type
            scenarios.append((f"linear_dlogits_{ty}_bias_ent_softcap",
                              scenario(dtype, True, True, (True, True, True), True, 30.0,
                                       by_gemm=False if dtype != torch.float32 else None)))
        scenarios.append((f"linear_bwd_atomic_{ty}_bias_ent_hwb_softcap",
                          scenario(dtype, True, True, (True, True, True), False, 30.0)))
    return scenarios


def _need_combos(has_bias: bool):
    """(need_hidden, need_weight, need_bias) combinations the atomic backward is launched with (at least one)."""
    bias_opts = (False, True) if has_bias else (False,)
    return [(h, w, b) for h in (False, True) for w in (False, True) for b in bias_opts if h or w or b]
