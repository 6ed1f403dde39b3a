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
values (``tools/aot.py`` and ``tests/test_aot.py`` check the vector widths in the compiled SASS).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .._triton import import_triton
from .launch import target_arch

triton, tl = import_triton()


@dataclass(frozen=True)
class RowTiles:
    """Launch configuration of one row-sweeping kernel: vocab block, warps, software-pipeline stages and (for the
    persistent gradient-in-forward kernel) resident programs per SM."""

    block_v: int
    num_warps: int
    num_stages: int
    programs_per_sm: int = 0  # 0: one program per row (no persistent loop)


# The tile table, chosen at launch from the GPU generation (no autotuning). Keys: (sm major class, kernel, bytes per
# logit). Chosen without a GPU from first principles; the H200 run of 2026-11-29 measured the forward sweep at
# BLOCK_V 8192 (2.00 ms) ahead of 4096 (2.23 ms) and the backward at 4096 / 8 warps (2.74 ms), both vectorized.
# - forward (read only): many rows in flight keep HBM busy; 8192 bf16 values = 16 KB per block and program,
#   32 values (four 16-byte loads) per thread at 8 warps.
# - backward (read + write): the measured 4096 / 8 warps (16 values, two 16-byte loads and stores per thread).
# - gradient in forward (read, then re-read + write the same row): the second sweep should hit L2 (50 MB on
#   H100/H200, 40 MB on A100), so rows in flight are capped at one persistent program per SM (132 rows of
#   V = 151936 bf16 = 40 MB) and each program is made wide (16 warps, 16 KB blocks) to keep bytes in flight
#   without more rows; the second sweep runs the row backwards so the blocks read last are rewritten first.
# fp32 logits use half the block (same bytes per block). Registers stay under 128 per thread at 16 warps (the
# AOT report prints them; tests/test_aot.py fails on spills).
_TABLE = {
    (9, "forward", 2): RowTiles(8192, 8, 3),
    (9, "forward", 4): RowTiles(4096, 8, 3),
    (9, "backward", 2): RowTiles(4096, 8, 3),
    (9, "backward", 4): RowTiles(2048, 8, 3),
    (9, "grad_in_forward", 2): RowTiles(8192, 16, 3, programs_per_sm=1),
    (9, "grad_in_forward", 4): RowTiles(4096, 16, 3, programs_per_sm=1),
    (8, "forward", 2): RowTiles(4096, 8, 3),
    (8, "forward", 4): RowTiles(2048, 8, 3),
    (8, "backward", 2): RowTiles(4096, 8, 3),
    (8, "backward", 4): RowTiles(2048, 8, 3),
    (8, "grad_in_forward", 2): RowTiles(8192, 16, 3, programs_per_sm=1),
    (8, "grad_in_forward", 4): RowTiles(4096, 8, 3, programs_per_sm=1),  # 16 warps spill 20 B with Triton 3.6
}
# SM counts of the table's GPUs, used when launches are recorded for AOT compilation (no device to ask).
_SMS = {9: 132, 8: 108}


def _arch_class(device: torch.device) -> int:
    arch = target_arch()
    if arch is not None:
        return 9 if arch >= 90 else 8
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        return 9 if major >= 9 else 8
    return 9  # the interpreter: any row of the table works


def row_tiles(kernel: str, dtype: torch.dtype, V: int, device: torch.device) -> RowTiles:
    """The table's tiles for ``kernel`` ("forward", "backward", "grad_in_forward"), the block capped at V's power of
    two (a short vocabulary needs no 8192-wide block and its warps)."""
    tiles = _TABLE[(_arch_class(device), kernel, 2 if dtype.itemsize <= 2 else 4)]
    block = min(tiles.block_v, triton.next_power_of_2(V))
    warps = max(1, min(tiles.num_warps, block // 256))
    return RowTiles(block, warps, tiles.num_stages, tiles.programs_per_sm)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (the table's figure when recording for AOT or interpreting)."""
    if target_arch() is None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[_arch_class(device)]


@triton.jit
def _online_update(z, m, s, a):
    # Why a block-wise online logsumexp: one exp per element (the SFU, not memory, would bound a per-lane update),
    # and `a` = sum exp(z - m) * z gives the entropy without a second sweep.
    m_new = tl.maximum(m, tl.max(z, axis=0))
    # Why the guard: a block (or row) of -inf logits must give probability 0, not exp(-inf + inf) = NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_safe)
    e = tl.exp(z - m_safe)
    s = s * alpha + tl.sum(e, axis=0)
    a = a * alpha + tl.sum(e * tl.where(e > 0.0, z, 0.0), axis=0)
    return m_new, s, a


@triton.jit
def row_logsumexp_entropy(base, V, keep, inv_temperature, BLOCK_V: tl.constexpr, EVICTION: tl.constexpr):
    """(lse, entropy) of ``z = row / temperature`` for the row at ``base`` (unit stride); a row with ``keep``
    false reads nothing and returns (0, 0). A NaN anywhere in the row makes both NaN (the sum carries it).
    EVICTION: the L2 hint of the loads, "evict_last" when the row is swept again right after, else "evict_first"."""
    cols = tl.arange(0, BLOCK_V)
    m = tl.max(tl.full([BLOCK_V], float("-inf"), tl.float32), axis=0)
    s = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    a = tl.sum(tl.zeros([BLOCK_V], tl.float32), axis=0)
    n_blocks = tl.where(keep, V // BLOCK_V, 0)
    # Why full blocks at multiples of BLOCK_V under all-or-nothing masks: from an aligned row start they load as
    # 16-byte vectors. Why the next block is loaded before the current one is reduced: the loads of two blocks
    # are in flight at once (a GPU warp stalls at the first use of a load, so without it each block's latency
    # would be paid in turn).
    z_next = tl.load(base + cols, mask=cols < tl.where(n_blocks > 0, BLOCK_V, 0), other=float("-inf"),
                     eviction_policy=EVICTION)
    for i in range(0, n_blocks):
        z = z_next.to(tl.float32) * inv_temperature
        start = tl.multiple_of((i + 1) * BLOCK_V, BLOCK_V)
        z_next = tl.load(base + start + cols, mask=cols < tl.where(i + 1 < n_blocks, BLOCK_V, 0),
                         other=float("-inf"), eviction_policy=EVICTION)
        m, s, a = _online_update(z, m, s, a)
    n_full = n_blocks * BLOCK_V
    if keep & (n_full < V):
        v = n_full + cols
        z = tl.load(base + v, mask=v < V, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
        m, s, a = _online_update(z * inv_temperature, m, s, a)
    lse = m + tl.log(s)
    entropy = lse - a / s
    return tl.where(keep, lse, 0.0), tl.where(keep, entropy, 0.0)


@triton.jit
def _dlogits_block(z, v, target, lse, h, g, g_h, inv_temperature, HAS_ENTROPY_GRAD: tl.constexpr):
    # d logp / dz = onehot - p; dH / dz = -p (log p + H), the guard keeping p = 0 entries (z = -inf) at 0, not NaN.
    p = tl.exp(z - lse)
    dz = tl.where(v == target, g, 0.0) - g * p
    if HAS_ENTROPY_GRAD:
        dz -= g_h * p * tl.where(p > 0.0, z - lse + h, 0.0)
    return dz * inv_temperature


@triton.jit
def write_row_dlogits(base, out, V, keep, target, lse, h, g, g_h, inv_temperature,
                      HAS_ENTROPY_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    """Write ``d loss / d logits`` of one row to ``out`` (unit stride) in ``out``'s dtype, from the row's lse /
    entropy and per-token gradients ``g = d loss / d logp``, ``g_h = d loss / d entropy``. A row with ``keep``
    false reads nothing and gets zeros.

    Why backwards (tail first, then the full blocks from the last): right after a forward sweep of the same row
    the blocks read last are the likeliest to still be in L2."""
    cols = tl.arange(0, BLOCK_V)
    n_full = (V // BLOCK_V) * BLOCK_V
    if n_full < V:
        v = n_full + cols
        z = tl.load(base + v, mask=v < tl.where(keep, V, 0), other=float("-inf")).to(tl.float32) * inv_temperature
        dz = _dlogits_block(z, v, target, lse, h, g, g_h, inv_temperature, HAS_ENTROPY_GRAD)
        tl.store(out + v, dz.to(out.dtype.element_ty), mask=v < V)
    # Why these masks: constant over the block (all or nothing), so loads stay predicated 16-byte vectors; and
    # as in the first sweep the next block's load is issued before the current block is computed and stored.
    # Why evict_first: the row is dead after this sweep (the stores write it back).
    n_blocks = V // BLOCK_V
    z_next = tl.load(base + n_full - BLOCK_V + cols, mask=cols < tl.where(keep & (n_blocks > 0), BLOCK_V, 0),
                     other=float("-inf"), eviction_policy="evict_first")
    for i in range(0, n_blocks):
        start = tl.multiple_of(n_full - (i + 1) * BLOCK_V, BLOCK_V)
        z = z_next.to(tl.float32) * inv_temperature
        more = keep & (i + 1 < n_blocks)
        z_next = tl.load(base + start - BLOCK_V + cols, mask=cols < tl.where(more, BLOCK_V, 0), other=float("-inf"),
                         eviction_policy="evict_first")
        v = start + cols
        dz = _dlogits_block(z, v, target, lse, h, g, g_h, inv_temperature, HAS_ENTROPY_GRAD)
        tl.store(out + v, dz.to(out.dtype.element_ty))
