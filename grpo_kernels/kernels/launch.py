"""The one place Triton kernels are launched from, so that their ahead-of-time signatures are derived, not copied.

Launchers call ``launch(kernel, grid, *args, **constexprs_and_options)``, which is ``kernel[grid](...)``. Inside
``recording(arch)`` nothing runs: every launch is recorded with its actual arguments, and launchers that pick
tiles per GPU generation read ``target_arch()`` instead of querying a device. ``tools/aot.py`` runs each kernel
module's ``aot_launches()`` scenarios (the real launchers on small CPU tensors) under ``recording`` and compiles
exactly the argument types, constexprs and launch options a GPU launch would use (docs/DESIGN.md section 5).

Recording pretends to be a CUDA run: every route decision asks ``as_cuda(device)`` rather than ``device.type``, so
the CPU tensors of a scenario take the routes a GPU takes (the light backward's cuBLAS + row-epilogue d logits for
bf16 / fp16, the compiled tiles and dot precision rather than the interpreter's), and ``recording(arch, tf32=...)``
sets torch's fp32 matmul precision (TF32, as under ``set_float32_matmul_precision("high")``, or IEEE fp32,
"highest") for the scenario, restoring it after, so that both precisions a GPU run can be under are recorded
(``tools/aot.py`` records each scenario under both).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel, its grid, positional arguments and keyword constexprs / launch options."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict = field(default_factory=dict)


_STATE: dict = {"records": None, "arch": None}


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, or a recorded ``Launch`` inside ``recording``."""
    records = _STATE["records"]
    if records is not None:
        records.append(Launch(kernel, tuple(grid), args, dict(kwargs)))
        return
    kernel[grid](*args, **kwargs)


def target_arch() -> int | None:
    """The SM version (90, 80) launches are being recorded for; None when kernels really run."""
    return _STATE["arch"]


def as_cuda(device) -> bool:
    """Whether launches for tensors on ``device`` are made as on a CUDA GPU: a CUDA device, a meta one (a plan made
    without data stands for a CUDA run: ``explain`` counts what that run allocates), or any device while recording
    (the recorded routes are a GPU run's, whatever device the scenario's small tensors live on)."""
    return _STATE["arch"] is not None or getattr(device, "type", device) in ("cuda", "meta")


@contextlib.contextmanager
def recording(arch: int, tf32: bool | None = None):
    """Record launches for ``sm_<arch>`` instead of running them; yields the list the records go to.

    tf32: torch's fp32 matmul precision while recording, TF32 (True: fp32 matmuls and the fp32 tile dots use TF32,
    ``_precision.fp32_matmuls_use_tf32``; ``set_float32_matmul_precision("high")``) or IEEE fp32 (False:
    "highest", torch's default), restored afterwards; None leaves torch's setting as it is."""
    if _STATE["records"] is not None:
        raise RuntimeError("recording() does not nest")
    records: list[Launch] = []
    with _fp32_matmul_precision(tf32):
        _STATE.update(records=records, arch=arch)
        try:
            yield records
        finally:
            _STATE.update(records=None, arch=None)


@contextlib.contextmanager
def _fp32_matmul_precision(tf32: bool | None):
    """torch's fp32 CUDA matmul precision set to TF32 / IEEE for the block (nothing when None), through the
    ``fp32_precision`` attribute where torch has it (``set_float32_matmul_precision`` would mix the legacy and new
    APIs, after which torch refuses to report the precision), else the legacy ``allow_tf32``."""
    if tf32 is None:
        yield
        return
    import torch

    matmul = torch.backends.cuda.matmul
    name, value = (("fp32_precision", "tf32" if tf32 else "ieee") if hasattr(matmul, "fp32_precision")
                   else ("allow_tf32", tf32))
    saved = getattr(matmul, name)
    setattr(matmul, name, value)
    try:
        yield
    finally:
        setattr(matmul, name, saved)
