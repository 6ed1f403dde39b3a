"""Test-only knobs, in one place: tests enter ``override(...)``; library code reads ``knobs()``. In normal use every
knob is None (the library's own choice). Why knobs at all: small test shapes must cross boundaries (several chunks,
the fast path's minimum rows, the d-logits route) that real shapes cross on their own.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, fields, replace

# The one knob set from the environment (so that it reaches subprocesses: the vocab-parallel ranks, the trainer):
# GRPO_KERNELS_TEST_FORCE_VARIANT=1 makes every call run as if it passed batch_invariant=False
# (``invariance.requested``); tests/api/test_invariance_forced_off.py runs the invariance tests so.
FORCE_VARIANT_ENV = "GRPO_KERNELS_TEST_FORCE_VARIANT"


@dataclass(frozen=True)
class Knobs:
    """Planner: fast_path_min_rows (the fast head path's minimum rows per chunk), no_grad_chunk_cap (bytes cap of the
    no-grad head chunk). Kernels: max_block_v (cap on the logits path's vocab block, so small rows cross block and
    tail boundaries), chunk_bytes (cap on the light backward's d-logits chunk: several vocab chunks),
    dlogits_by_gemm (force (True) or forbid (False) the cuBLAS + row-epilogue route of that backward),
    interpret_sms (the SM count the interpreter pretends to have), interpret_tile (the fused-linear tile used
    under the interpreter, a ``kernels.linear_tiles.Tile``), logits_programs (the gradient-in-forward kernel's rows in
    flight, at most one per SM: the GPU check times L2-sized grids against full ones). Batch invariance: invariant_rows
(the fixed rows per block, ``invariance.block_rows``: small test batches cross block edges), force_variant
    (True: ``batch_invariant=True`` is ignored, every call runs the default paths, so that a test crediting the
    option can be seen to fail without it; False by default unless ``FORCE_VARIANT_ENV`` is "1")."""

    fast_path_min_rows: int | None = None
    no_grad_chunk_cap: int | None = None
    max_block_v: int | None = None
    chunk_bytes: int | None = None
    dlogits_by_gemm: bool | None = None
    interpret_sms: int | None = None
    interpret_tile: object = None
    logits_programs: int | None = None
    invariant_rows: int | None = None
    force_variant: bool = False


_CURRENT = [Knobs(force_variant=os.environ.get(FORCE_VARIANT_ENV, "0") == "1")]


def knobs() -> Knobs:
    return _CURRENT[-1]


@contextlib.contextmanager
def override(**values):
    """Set knobs for the duration of a ``with`` block (nests; unknown names raise)."""
    known = {f.name for f in fields(Knobs)}
    unknown = set(values) - known
    if unknown:
        raise TypeError(f"unknown override(s) {sorted(unknown)} (testing knobs: {sorted(known)})")
    _CURRENT.append(replace(_CURRENT[-1], **values))
    try:
        yield _CURRENT[-1]
    finally:
        _CURRENT.pop()
