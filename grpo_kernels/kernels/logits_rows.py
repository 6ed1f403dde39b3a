"""Vocab-row sweeps shared by the logits kernels (``logits_kernels``, ``logits_loss_kernels``), and their tile table.

Why these helpers exist: a kernel that streams a vocab row is bound by memory traffic, so each load and store must
be a 16-byte vector (``LDG.E.128`` / ``STG.E.128`` for 8 bf16 values). Triton emits vectors only when it can prove
16-byte alignment and a mask that is constant over 16-byte groups. So every sweep here is a main loop over the full
``BLOCK_V`` blocks (offsets ``tl.multiple_of`` the block, masks all-or-nothing per block: no per-element bound) plus
one masked tail block, and ``V`` is a specialized argument (Triton's divisibility-by-16 class): with ``V % 16 == 0``
(every real vocabulary) the tail mask is constant per 16 values and vectorizes too; with ``V % 16 != 0`` the main
loop stays vectorized where the row start is aligned, and the tail is scalar. Row strides and pointers keep the
JIT's 16-divisibility specialization (no ``do_not_specialize`` on them) so the row start is provably aligned.
Variants per kernel, dtype and flag set: V % 16 == 0 or not (V == 1 is a third, trivial one), times the alignment
class of the strides; T, the vocab size within its class, the temperature and every loss hyper-parameter are runtime
values (``tools/aot.py`` and ``tests/kernels/test_aot.py`` check the vector widths in the compiled SASS).

Why a block is a (lanes, VEC) tile: VEC = 16 bytes of values, so a lane is one 16-byte vector and Triton's
coalesced layout puts each lane wholly in one thread. The online logsumexp then keeps its running max and sums per
lane (``common.lane_fold``: register ops, no shuffle, no barrier inside the loop) and combines the lanes once per
row; the d-logits sweep writes ``-g p`` everywhere and fixes the target's column with one scalar store after the
row (no per-element id compare). Instruction budget and measurements: docs/kernels.md.

Soft cap (``softcap`` runtime value, ``SOFTCAP`` constexpr): every sweep caps each loaded logit first
(``common.soft_cap``, ``c tanh(x / c)``) and works on the capped value as it would on a raw one; the d-logits sweep
multiplies each value it writes by the cap's derivative (``common.soft_cap_grad``). With ``SOFTCAP`` false both
compile to nothing, so the sweeps are the same code as without a cap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import import_triton
from .._testing import knobs
from .common import LOG2E, dlogits_values, lane_fold, lanes_to_row, row_lse_entropy, soft_cap, soft_cap_grad
from .host import generation

triton, tl = import_triton()


@dataclass(frozen=True)
class RowTiles:
    """Launch configuration of one row-sweeping kernel: vocab block, warps, software-pipeline stages and (for the
    persistent gradient-in-forward kernel) resident programs per SM."""

    block_v: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0  # 0: one program per row (no persistent loop)


# The tile table, chosen at launch from the GPU generation (``common.GENERATIONS``: its ``tiles`` key, 90 or 80;
# no autotuning). Keys: (tiles key, kernel, bytes per logit). Chosen without a GPU from first principles; the
# H200 run of 2026-11-29 measured the forward sweep at BLOCK_V 8192 (2.00 ms) ahead of 4096 (2.23 ms) and the
# backward at 4096 / 8 warps (2.74 ms), both vectorized.
# - forward (read only): many rows in flight keep HBM busy; 8192 bf16 values = 16 KB per block and program,
#   32 values (four 16-byte loads) per thread at 8 warps.
# - backward (read + write): the measured 4096 / 8 warps (16 values, two 16-byte loads and stores per thread).
# - gradient in forward (read, then re-read + write the same row): the second sweep should hit L2 (50 MB on
#   H100/H200, 40 MB on A100), so rows in flight are capped at one persistent program per SM (132 rows of
#   V = 151936 bf16 = 40 MB) and each program is made wide (16 warps, 16 KB blocks) to keep bytes in flight
#   without more rows; the second sweep runs the row backwards so the blocks read last are rewritten first.
# fp32 logits use half the block (same bytes per block). Registers stay under 128 per thread at 16 warps (the
# AOT report prints them; tests/kernels/test_aot.py fails on spills).
_TABLE = {
    (90, "forward", 2): RowTiles(8192, 8, 3),
    (90, "forward", 4): RowTiles(4096, 8, 3),
    (90, "backward", 2): RowTiles(4096, 8, 3),
    (90, "backward", 4): RowTiles(2048, 8, 3),
    (90, "grad_in_forward", 2): RowTiles(8192, 16, 3, programs_per_sm=1),
    (90, "grad_in_forward", 4): RowTiles(4096, 16, 3, programs_per_sm=1),
    (80, "forward", 2): RowTiles(4096, 8, 3),
    (80, "forward", 4): RowTiles(2048, 8, 3),
    (80, "backward", 2): RowTiles(4096, 8, 3),
    (80, "backward", 4): RowTiles(2048, 8, 3),
    (80, "grad_in_forward", 2): RowTiles(8192, 16, 3, programs_per_sm=1),
    (80, "grad_in_forward", 4): RowTiles(4096, 8, 3, programs_per_sm=1),  # 16 warps spilled 20 B with Triton 3.6
}


def row_tiles(kernel: str, dtype: torch.dtype, V: int, device: torch.device, block_v: int | None = None) -> RowTiles:
    """The table's tiles for ``kernel`` ("forward", "backward", "grad_in_forward"), the block capped at V's power of
    two (a short vocabulary needs no 8192-wide block and its warps), and at ``block_v`` or the testing override's
    ``max_block_v`` when given (multi-block rows and tails at small V)."""
    tiles = _TABLE[(generation(device).tiles, kernel, 2 if dtype.itemsize <= 2 else 4)]
    block = min(tiles.block_v, triton.next_power_of_2(V), block_v or knobs().max_block_v or tiles.block_v)
    # Why at least 256 values per warp: 8 per thread, one 16-byte vector of bf16 (two of fp32).
    warps = max(1, min(tiles.num_warps, block // 256))
    return RowTiles(block, warps, tiles.num_stages, tiles.programs_per_sm)


@triton.jit
def _block_offsets(BLOCK_V: tl.constexpr, VEC: tl.constexpr):
    """(BLOCK_V // VEC, VEC) offsets 0 .. BLOCK_V - 1, row-major: one 16-byte vector per lane."""
    return tl.arange(0, BLOCK_V // VEC)[:, None] * VEC + tl.arange(0, VEC)[None, :]


@triton.jit
def row_logsumexp_entropy(base, V, keep, inv_temperature, softcap, SOFTCAP: tl.constexpr, BLOCK_V: tl.constexpr,
                          VEC: tl.constexpr, EVICTION: tl.constexpr):
    """(lse, entropy) of ``z = soft_cap(row) / temperature`` for the row at ``base`` (unit stride; the cap only when
    SOFTCAP); a row with ``keep`` false reads nothing and returns (0, 0). A NaN anywhere in the row makes both NaN
    (the sum carries it). VEC: values per 16 bytes (``vec_width``). EVICTION: the L2 hint of the loads,
    "evict_last" when the row is swept again right after, else ""."""
    offs = _block_offsets(BLOCK_V, VEC)
    c = inv_temperature * LOG2E
    m = tl.full([BLOCK_V // VEC], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK_V // VEC], tl.float32)
    a = tl.zeros([BLOCK_V // VEC], tl.float32)
    n_blocks = tl.where(keep, V // BLOCK_V, 0)
    # Why full blocks at multiples of BLOCK_V under all-or-nothing masks: from an aligned row start they load as
    # 16-byte vectors. Why the next block is loaded before the current one is folded: the loads of two blocks
    # are in flight at once (a GPU warp stalls at the first use of a load, so without it each block's latency
    # would be paid in turn).
    x_next = tl.load(base + offs, mask=offs < tl.where(n_blocks > 0, BLOCK_V, 0), other=float("-inf"),
                     eviction_policy=EVICTION)
    for i in range(0, n_blocks):
        # Why the cap needs no mask here: every lane of a full block is a real logit (a real -inf caps to -c,
        # as reference.soft_cap).
        x = soft_cap(x_next.to(tl.float32), softcap, SOFTCAP)
        start = tl.multiple_of((i + 1) * BLOCK_V, BLOCK_V)
        x_next = tl.load(base + start + offs, mask=offs < tl.where(i + 1 < n_blocks, BLOCK_V, 0),
                         other=float("-inf"), eviction_policy=EVICTION)
        m, s, a = lane_fold(x, m, s, a, c)
    n_full = n_blocks * BLOCK_V
    if keep & (n_full < V):
        v = n_full + offs
        x = tl.load(base + v, mask=v < V, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
        if SOFTCAP:
            # Why back to -inf past the row's end: the cap would make those lanes -c, a weight exp(-c / T) each.
            x = tl.where(v < V, soft_cap(x, softcap, SOFTCAP), float("-inf"))
        m, s, a = lane_fold(x, m, s, a, c)
    m_row, s_row, a_row = lanes_to_row(m, s, a, c)
    lse, entropy = row_lse_entropy(m_row, s_row, a_row, inv_temperature)
    return tl.where(keep, lse, 0.0), tl.where(keep, entropy, 0.0)


@triton.jit
def dlogits_coefficients(keep, lse, h, g, g_h, inv_temperature):
    """(lse, A, B, g') of a row's d logits: with ``u = (x / temperature - lse) log2(e)`` (log2 p of a raw logit x),
    ``d z = 2^u (B + A max(u, floor)) + g' onehot`` equals ``(g (onehot - p) - g_h p (log p + H)) / temperature``.
    Why the selects: a row that is not kept reads -inf everywhere and must get exact zeros even when its saved
    lse / entropy are NaN (0 * NaN is NaN)."""
    g_t = tl.where(keep, g * inv_temperature, 0.0)
    gh_t = tl.where(keep, g_h * inv_temperature, 0.0)
    coef_b = tl.where(keep, -g_t - gh_t * h, 0.0)
    return tl.where(keep, lse, 0.0), -gh_t * 0.6931471805599453, coef_b, g_t


@triton.jit
def _dlogits_of_raw(x, inv_temperature, softcap, lse, coef_a, coef_b, SOFTCAP: tl.constexpr,
                    HAS_ENTROPY_GRAD: tl.constexpr):
    """d logits (fp32) of raw logits ``x`` off the target column: ``common.dlogits_values`` at the capped logit,
    times the cap's derivative there (x and dlogits_values alone when SOFTCAP is off).

    Why no -inf mask after the cap (unlike the logsumexp sweep): lanes past the row's end are not stored, and a row
    that is not kept has zero coefficients, so its capped lanes (-c, finite) give exact zeros; -inf there would
    make the derivative 1 - inf^2 and 0 * -inf = NaN."""
    capped = soft_cap(x, softcap, SOFTCAP)
    dz = dlogits_values(capped, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD)
    return soft_cap_grad(dz, capped, softcap, SOFTCAP)


@triton.jit
def write_row_dlogits(base, out, V, keep, target, z_target, lse, h, g, g_h, inv_temperature, softcap,
                      SOFTCAP: tl.constexpr, HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr,
                      VEC: tl.constexpr):
    """Write ``d loss / d logits`` of one row to ``out`` (unit stride) in ``out``'s dtype, from the row's lse /
    entropy and per-token gradients ``g = d loss / d logp``, ``g_h = d loss / d entropy``; ``z_target`` is the
    target's raw logit, read before the sweep (``out`` may be the logits row itself). A row with ``keep`` false
    reads nothing and gets zeros. With SOFTCAP the statistics are those of the capped row and every value written
    is d loss / d raw logit (the cap's derivative applied).

    Why backwards (tail first, then the full blocks from the last): right after a forward sweep of the same row
    the blocks read last are the likeliest to still be in L2."""
    offs = _block_offsets(BLOCK_V, VEC)
    lse, coef_a, coef_b, g_t = dlogits_coefficients(keep, lse, h, g, g_h, inv_temperature)
    n_full = (V // BLOCK_V) * BLOCK_V
    if n_full < V:
        v = n_full + offs
        x = tl.load(base + v, mask=v < tl.where(keep, V, 0), other=float("-inf")).to(tl.float32)
        dz = _dlogits_of_raw(x, inv_temperature, softcap, lse, coef_a, coef_b, SOFTCAP, HAS_ENTROPY_GRAD)
        tl.store(out + v, dz.to(out.dtype.element_ty), mask=v < V)
    # Why these masks: constant over the block (all or nothing), so loads stay predicated 16-byte vectors; and
    # as in the first sweep the next block's load is issued before the current block is computed and stored.
    # Why evict_first: the row is dead after this sweep (the stores write it back).
    n_blocks = V // BLOCK_V
    x_next = tl.load(base + n_full - BLOCK_V + offs, mask=offs < tl.where(keep & (n_blocks > 0), BLOCK_V, 0),
                     other=float("-inf"), eviction_policy="evict_first")
    for i in range(0, n_blocks):
        start = tl.multiple_of(n_full - (i + 1) * BLOCK_V, BLOCK_V)
        x = x_next.to(tl.float32)
        more = keep & (i + 1 < n_blocks)
        x_next = tl.load(base + start - BLOCK_V + offs, mask=offs < tl.where(more, BLOCK_V, 0),
                         other=float("-inf"), eviction_policy="evict_first")
        dz = _dlogits_of_raw(x, inv_temperature, softcap, lse, coef_a, coef_b, SOFTCAP, HAS_ENTROPY_GRAD)
        tl.store(out + start + offs, dz.to(out.dtype.element_ty))
    # The target's column: g' (onehot) on top of its -g' p value, computed from the logit read before the sweep,
    # the whole value times the cap's derivative at the target.
    # Why the barrier: another thread stored the block holding it; one barrier per row orders the two stores.
    tl.debug_barrier()
    capped_t = soft_cap(z_target, softcap, SOFTCAP)
    dz_t = soft_cap_grad(g_t + dlogits_values(capped_t, inv_temperature, lse, coef_a, coef_b, HAS_ENTROPY_GRAD),
                         capped_t, softcap, SOFTCAP)
    tl.store(out + target, dz_t.to(out.dtype.element_ty), mask=keep & (target >= 0) & (target < V))


def vec_width(dtype: torch.dtype) -> int:
    """Values per 16-byte vector of ``dtype`` (the VEC constexpr of the sweeps)."""
    return 16 // dtype.itemsize


def vec_for(block_v: int, dtype: torch.dtype) -> int:
    """VEC for a sweep of ``block_v`` values: a 16-byte vector, or the whole block when it is narrower."""
    return min(vec_width(dtype), block_v)


def tiles(kernel: str, x: torch.Tensor, block_v: int | None = None) -> RowTiles:
    """The tile table's launch configuration for ``kernel`` on ``x``'s device and dtype, the vocab block capped
    by ``block_v`` (or the testing override's ``max_block_v``) when given."""
    return row_tiles(kernel, x.dtype, x.shape[-1], x.device, block_v)
