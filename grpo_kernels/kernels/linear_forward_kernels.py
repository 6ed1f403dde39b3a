"""Fused linear head, forward: per-token log-prob, logsumexp and entropy from hidden states and the lm_head weight,
without writing the N x V logits. Kernels and their launcher ``linear_logprobs_forward``; shared helpers and the
tile table in ``linear_tiles.py``.

Grid: n_m_blocks x n_splits programs, split fastest. A program keeps a (BLOCK_M, BLOCK_V) logit tile on chip
(tl.dot over H in BLOCK_K chunks; bias, soft cap and temperature applied there, ``linear_tiles.logits_tile``) and
folds it into per-token online statistics (max m, sum e^(z-m),
sum e^(z-m) (z-m), target z) over its vocab split; it writes them as fp32 partials (4, n_splits, N). n_splits is
chosen so the grid is about two waves of the GPU (N / BLOCK_M = 32 programs at N = 4k would leave 100 of 132 SMs
idle). A tiny merge kernel combines the splits in a fixed order: deterministic. Extra memory: 16 n_splits N bytes.
"""
from __future__ import annotations

import torch

from .._checks import alloc
from . import linear_tiles as tiles
from .common import LN2, LOG2E, lane_fold, lane_fold_sq
from .host import GENERATIONS, TRITON_DTYPES, cap_args, cdiv, check_inputs
from .launch import launch
from .linear_rows import extra_outputs
from .linear_tiles import NEG_BIG, logits_tile, tl, triton

MERGE_BLOCK_N = 256


@triton.jit(do_not_specialize=["N", "n_m_blocks", "n_splits", "v_per_split"])
def linear_fwd_partial_kernel(h_ptr, w_ptr, b_ptr, ids_ptr, part_ptr,
                              N, V, H, stride_h, stride_w, inv_temperature, n_m_blocks, n_splits, v_per_split,
                              softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr,
                              HAS_SQ: tl.constexpr = False, HAS_SUM: tl.constexpr = False,
                              HAS_TOP1: tl.constexpr = False):
    """Per (token block, vocab split): online logsumexp statistics over the split's vocab range, of the capped
    logits when SOFTCAP.

    part_ptr: fp32 (4 + HAS_SQ + HAS_SUM + HAS_TOP1, n_splits, N) = running max m, sum exp(z - m),
    sum exp(z - m) * (z - m), target z (0 in the splits that do not hold the target), then, each when its flag is
    on, sum exp(2 (z - m)), sum z, and the max of z over the split's columns before the target (-inf if none).
    1-D grid of n_m_blocks * n_splits programs.
    """
    # Why the split varies fastest: programs running together cover a few token blocks times all splits, so the
    # L2 working set is (their hidden blocks + one W tile per split), not the whole N x H hidden per step.
    pid = tl.program_id(0)
    pid_s = pid % n_splits
    pid_m = pid // n_splits
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows_c = tl.minimum(rows, N - 1)
    target = tl.load(ids_ptr + rows_c)
    m_i = tl.full((BLOCK_M,), NEG_BIG, dtype=tl.float32)
    s_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    a_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    t_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    q_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    y_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    b_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    # Why split the vocab sweep: N / BLOCK_M programs alone (32 at N = 4k) cannot fill 132 SMs; the launcher picks
    # n_splits so that n_m_blocks * n_splits is about two waves, and a tiny merge kernel combines the partials.
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < V
        z = logits_tile(h_ptr, w_ptr, b_ptr, rows_c, tl.minimum(cols, V - 1), H, stride_h, stride_w, inv_temperature,
                        softcap, HAS_BIAS, SOFTCAP, BLOCK_M, BLOCK_V, BLOCK_K, DOT_FP32)
        # Why a finite floor for the padded columns: exp gives exactly 0 there and e * (z - m) stays 0 * finite,
        # so no NaN needs masking (set after the cap, which would have made it -softcap).
        z = tl.where(col_ok[None, :], z, NEG_BIG)
        # The online logsumexp of the row sweeps (common.lane_fold), a tile row being a lane: running max m,
        # s = sum e^(z-m) and a = sum 2^u u with u = (z - m) log2(e) (z already includes 1 / temperature). Why
        # track (z - m) rather than z: entropy = log s - a / s then has no cancellation when |z| is large.
        if HAS_SQ:
            m_i, s_i, a_i, q_i = lane_fold_sq(z, m_i, s_i, a_i, q_i, LOG2E)
        else:
            m_i, s_i, a_i = lane_fold(z, m_i, s_i, a_i, LOG2E)
        # Why gather in the tile: the target logit is already on chip; exactly one split adds a non-zero.
        t_i += tl.sum(tl.where(cols[None, :] == target[:, None], z, 0.0), axis=1)
        # The extras on the same tile (a GEMM-bound kernel: a select and an add or a max per element are noise).
        if HAS_SUM:
            y_i += tl.sum(tl.where(col_ok[None, :], z, 0.0), axis=1)
        if HAS_TOP1:
            b_i = tl.maximum(b_i, tl.max(tl.where(cols[None, :] < target[:, None], z, float("-inf")), axis=1))
    row_ok = rows < N
    plane = N.to(tl.int64) * n_splits
    out = part_ptr + pid_s.to(tl.int64) * N + rows
    tl.store(out, m_i, mask=row_ok)
    tl.store(out + plane, s_i, mask=row_ok)
    tl.store(out + 2 * plane, a_i * LN2, mask=row_ok)  # natural-log units for the merge
    tl.store(out + 3 * plane, t_i, mask=row_ok)
    if HAS_SQ:
        tl.store(out + 4 * plane, q_i, mask=row_ok)
    if HAS_SUM:
        tl.store(out + (4 + HAS_SQ) * plane, y_i, mask=row_ok)
    if HAS_TOP1:
        tl.store(out + (4 + HAS_SQ + HAS_SUM) * plane, b_i, mask=row_ok)


@triton.jit(do_not_specialize=["N", "n_splits"])
def linear_fwd_merge_kernel(part_ptr, logp_ptr, lse_ptr, ent_ptr, N, n_splits, BLOCK_N: tl.constexpr,
                            sq_ptr=None, mean_ptr=None, top1_ptr=None, inv_V=None, HAS_SQ: tl.constexpr = False,
                            HAS_SUM: tl.constexpr = False, HAS_TOP1: tl.constexpr = False):
    """Merge the n_splits partials of each token into logp, lse, entropy (fp32 (N,)), in a fixed split order; with
    the extras' flags, log sum p^2 (fp32), the mean logit (fp32, sum z * inv_V) and is_top1 (bool).

    Why a separate kernel rather than atomics in the partial kernel: a fixed-order merge is deterministic and
    costs 16 * n_splits bytes per token (4 more per extra statistic).
    """
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    plane = N.to(tl.int64) * n_splits
    m = tl.full((BLOCK_N,), NEG_BIG, dtype=tl.float32)
    for sp in range(0, n_splits):
        m = tl.maximum(m, tl.load(part_ptr + sp * N + rows, mask=row_ok, other=0.0))
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    a = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    q = tl.zeros((BLOCK_N,), dtype=tl.float32)
    y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    b = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
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
        if HAS_SQ:  # sum e^(2 (z - m_s)) re-centred: times c^2
            q += c * c * tl.load(p + 4 * plane, mask=row_ok, other=0.0)
        if HAS_SUM:
            y += tl.load(p + (4 + HAS_SQ) * plane, mask=row_ok, other=0.0)
        if HAS_TOP1:
            b = tl.maximum(b, tl.load(p + (4 + HAS_SQ + HAS_SUM) * plane, mask=row_ok, other=0.0))
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(lse_ptr + rows, lse, mask=row_ok)
    tl.store(logp_ptr + rows, t - lse, mask=row_ok)
    tl.store(ent_ptr + rows, log_s - a / s, mask=row_ok)
    if HAS_SQ:
        tl.store(sq_ptr + rows, tl.log(q) - 2.0 * log_s, mask=row_ok)
    if HAS_SUM:
        tl.store(mean_ptr + rows, y * inv_V, mask=row_ok)
    if HAS_TOP1:
        # TRL's rule on z: the target reaches the row max and no column before it does (the first maximum wins)
        tl.store(top1_ptr + rows, (t >= m) & (t > b) & (t - lse == t - lse), mask=row_ok)


def forward_splits(N: int, V: int, dtype: torch.dtype, device: torch.device,
                   kind: str = "fwd") -> tuple[int, int]:
    """(vocab columns per split, number of splits) of the forward's (token block, vocab split) grid; kind: the tile
    table's "fwd", or "fwd_extras" for a forward with extra statistics."""
    if device.type == "meta":  # a plan made without data: the sm_90 table on 132 SMs
        tile, sms = tiles.TILES[(90, kind, "fp32" if dtype == torch.float32 else "half")], GENERATIONS[90].sms
    else:
        tile, sms, _ = tiles.launch_params(kind, dtype, device)
    n_m = max(1, cdiv(N, tile.block_m))  # N = 0 (every row masked): the splits of one block, never a zero divisor
    n_vb = cdiv(V, tile.block_v)
    # Why: enough (token block, vocab split) programs for ~tiles.WAVES waves, each split at least one vocab block.
    v_per_split = cdiv(n_vb, min(n_vb, max(1, cdiv(tiles.WAVES * sms, n_m)))) * tile.block_v
    return v_per_split, cdiv(V, v_per_split)


def forward_partial_bytes(N: int, V: int, dtype: torch.dtype, device: torch.device, extra_planes: int = 0) -> int:
    """Bytes of the forward's fp32 (4 + extra_planes, n_splits, N) partial statistics: its only memory beyond the
    outputs (one plane more per extra statistic, ``config.TokenExtras``)."""
    kind = "fwd_extras" if extra_planes else "fwd"
    splits = forward_splits(N, V, dtype, device, kind)[1]
    return 4 * (4 + extra_planes) * splits * N if N else 0


def linear_logprobs_forward(hidden: torch.Tensor, weight: torch.Tensor, bias, ids: torch.Tensor,
                            temperature: float, softcap: float | None = None, extras=None,
                            round_logits: str | None = None):
    """(logp, lse, entropy), each fp32 (N,), of z = soft_cap(hidden @ weight.T + bias) / temperature at ``ids``
    (``softcap * tanh(x / softcap)``; no cap when softcap is None; the fp32 raw logits rounded to ``round_logits``
    first when given). With ``extras`` (a truthy
    ``config.TokenExtras``), a fourth item (log_sum_sq_probs fp32 | None, mean_logits fp32 | None, is_top1 bool |
    None), (N,) each, from the same sweep.

    hidden (N, H) and weight (V, H) of one dtype (fp32/bf16/fp16), bias (V,) or None, ids (N,) int64 in [0, V).
    lse = logsumexp(z); entropy = lse - sum softmax(z) * z. Extra memory: 4 (4 + k) n_splits N bytes, k the
    number of extras. Not batch-invariant (the splits follow N): under ``batch_invariant`` the memory-light path's
    forward is ``head_logprobs_chunked``'s, the one every head path shares (``head/light.py``).
    """

    N, V, H = check_inputs(hidden, weight, bias, ids)
    dev = hidden.device
    logp, lse, ent = (alloc((N,), torch.float32, dev) for _ in range(3))
    more = extra_outputs(N, dev, extras) if extras else None
    if N == 0:
        return (logp, lse, ent) if more is None else (logp, lse, ent, more)
    kind = "fwd" if more is None else "fwd_extras"
    tile, _, dot_fp32 = tiles.launch_params(kind, hidden.dtype, dev)
    n_m = cdiv(N, tile.block_m)
    v_per_split, n_splits = forward_splits(N, V, hidden.dtype, dev, kind)
    flags = {} if more is None else {"HAS_SQ": more[0] is not None, "HAS_SUM": more[1] is not None,
                                     "HAS_TOP1": more[2] is not None}
    part = alloc((4 + sum(flags.values()), n_splits, N), torch.float32, dev)
    launch(linear_fwd_partial_kernel, (n_m * n_splits,),
        hidden, weight, weight if bias is None else bias, ids, part,
        N, V, H, hidden.stride(0), weight.stride(0), 1.0 / temperature, n_m, n_splits, v_per_split,
        HAS_BIAS=bias is not None, BLOCK_M=tile.block_m, BLOCK_V=tile.block_v, BLOCK_K=tile.block_k,
        DOT_FP32=dot_fp32, num_warps=tile.num_warps, num_stages=tile.num_stages, **cap_args(softcap, round_logits),
        **flags)
    outputs = {} if more is None else {"sq_ptr": more[0], "mean_ptr": more[1], "top1_ptr": more[2],
                                       "inv_V": 1.0 / V if flags["HAS_SUM"] else None, **flags}
    launch(linear_fwd_merge_kernel, (cdiv(N, MERGE_BLOCK_N),), part, logp, lse, ent, N, n_splits,
           BLOCK_N=MERGE_BLOCK_N, num_warps=4, **outputs)
    return (logp, lse, ent) if more is None else (logp, lse, ent, more)


def aot_launches():
    """(name, thunk) scenarios for ``tools/aot.py``: the forward launcher per dtype, with and without bias, and with
    bias and the soft cap on (``_softcap``); with bias and every extra statistic per dtype (``_extras``), and in bf16
    the sets TRL's trainers ask for (``EXTRAS_SETS``: SFT's ``_top1``, KTO's ``_mean``, DPO's ``_mean_top1``); fp32
    ones are recorded under TF32 too (``_tf32``)."""
    from ..config import TokenExtras

    def scenario(dtype, has_bias, softcap=None, extras=None):
        return lambda: linear_logprobs_forward(*tiles.aot_inputs(dtype, has_bias), 1.0, softcap=softcap,
                                               extras=None if extras is None else TokenExtras.of(extras))

    return [(f"linear_fwd_{ty}_{'bias' if has_bias else 'nobias'}", scenario(dtype, has_bias))
            for dtype, ty in TRITON_DTYPES.items() for has_bias in (False, True)] + \
        [(f"linear_fwd_{ty}_bias_softcap", scenario(dtype, True, 30.0)) for dtype, ty in TRITON_DTYPES.items()] + \
        [(f"linear_fwd_{ty}_bias_extras", scenario(dtype, True, extras=EXTRAS_SETS["extras"]))
         for dtype, ty in TRITON_DTYPES.items()] + \
        [(f"linear_fwd_bf16_bias_{name}", scenario(torch.bfloat16, True, extras=names))
         for name, names in EXTRAS_SETS.items() if name != "extras"]


# The extra-statistics sets the AOT scenarios compile (``config.EXTRA_OUTPUTS``): every one, and those TRL's
# trainers ask for (SFT: is_top1; KTO: mean_logits; DPO: both; DPO with WPO weights: every one).
EXTRAS_SETS = {"extras": ("log_sum_sq_probs", "mean_logits", "is_top1"), "top1": ("is_top1",),
               "mean": ("mean_logits",), "mean_top1": ("mean_logits", "is_top1")}
