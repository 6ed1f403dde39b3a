"""Batch invariance (``batch_invariant=True``, docs/numerics.md "Batch invariance"): the fixed row blocks.

A row's numbers must not depend on the batch around it. Where the batch size enters a computation is where its
shapes do: a GEMM library picks its kernel (tiles, split-K) by the number of rows, a reduction over a tensor splits
its work by the tensor's size, a planner sizes chunks from the row count and the memory budget. So every batch-
invariant path runs on blocks of exactly ``block_rows(device)`` rows: full blocks are views of the inputs, the last
one a zero-padded copy of ``block_rows`` rows (padded rows carry no gradient and their outputs are dropped), and the
vocabulary is cut at places that depend on V alone. Every GEMM, every chunk reduction and every kernel launch then
has the same shape whatever N is, and the same code computes a row at any position of any block (a row's result in
a GEMM does not depend on its row index within a fixed shape; each reduction is per row).

The block size is a constant per device type unless the caller chooses one (a different size changes which kernels
run, so it is another bit pattern): 256 rows on CPU (the PyTorch tiles: at N = 512, H = 64, V = 8000 the head's loss
step takes 1.27x the default call's time with 64-row blocks, 1.18x with 128, 1.06x with 256, 1.04x with 512, and 512
rows are slower on the logits path and pay twice the padding at small N; benchmarks/results/invariance_cost_cpu.md,
written by ``python -m benchmarks.invariance_cost --out benchmarks/results``), 512 on CUDA (one cuBLAS / Triton
configuration per shape; a 512 x V fp32 chunk is 311 MB at V = 151936). A call computes whole blocks, so far below
a block it costs several times the default call (the same file: 13x the head's loss step at N = 1, 3.2x at N = 64),
and its smallest ``memory_budget`` is one block's working memory. ``invariant_block_rows`` (GRPOLossConfig, the
log-prob functions, DistillLossConfig, ``patch_trl``) sets a smaller block for such workloads: results are then
bitwise equal only between calls with the same block; it is never chosen silently. Tests set smaller blocks with
the ``invariant_rows`` knob so that small batches cross block edges.
"""
from __future__ import annotations

import dataclasses

import torch

from ._testing import knobs

BLOCK_ROWS = {"cpu": 256, "cuda": 512}
DEFAULT_BLOCK_ROWS = 512  # other device types (meta plans stand for CUDA)
# The memory-light head path's backward layout (vocabulary chunks per block) is chosen within this fixed room, never
# the budget, which would move the chunks: 256 MiB holds a 512-row d-logits chunk of 128k fp32 columns.
INVARIANT_LIGHT_ROOM = 256 << 20


def requested(batch_invariant: bool) -> bool:
    """Whether a call asking for ``batch_invariant`` runs the batch-invariant paths: always, except under the
    test-only knob ``force_variant`` (``GRPO_KERNELS_TEST_FORCE_VARIANT=1``), which runs the default paths instead so
    that the invariance tests can show they fail without the option (tests/api/test_invariance_forced_off.py)."""
    return batch_invariant and not knobs().force_variant


def as_run(cfg):
    """A call's resolved ``GRPOLossConfig`` or ``DistillLossConfig`` as it runs: ``batch_invariant`` through
    ``requested`` (forced off, the chosen block goes too: it is only valid with the option)."""
    if cfg.batch_invariant == requested(cfg.batch_invariant):
        return cfg
    return dataclasses.replace(cfg, batch_invariant=False, invariant_block_rows=None)


def block_rows(device, rows: int | None = None) -> int:
    """The fixed rows per block of the batch-invariant paths on ``device``: ``rows`` when the caller chose them
    (``invariant_block_rows``, validated by ``_checks.invariant_block_rows``), else the test knob, else the device
    type's ``BLOCK_ROWS``."""
    if rows is not None:
        return rows
    if knobs().invariant_rows is not None:
        return knobs().invariant_rows
    return BLOCK_ROWS.get(torch.device(device).type, DEFAULT_BLOCK_ROWS)


def blocks(n: int, rows: int) -> list[tuple[int, int]]:
    """[(r0, r1)]: the blocks of ``rows`` rows covering n rows (the last may be short: ``padded`` fills it)."""
    return [(r0, min(n, r0 + rows)) for r0 in range(0, n, rows)]


def padded(t: torch.Tensor | None, r0: int, r1: int, rows: int, fill=0):
    """Rows r0 .. r1 of ``t`` as exactly ``rows`` rows: a view when the block is full, else a copy padded with
    ``fill`` (None stays None)."""
    if t is None or r1 - r0 == rows:
        return None if t is None else t[r0:r1]
    out = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    out[: r1 - r0] = t[r0:r1]
    return out
