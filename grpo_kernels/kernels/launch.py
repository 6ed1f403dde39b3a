"""The one place Triton kernels are launched from, so that their ahead-of-time signatures are derived, not copied.

Launchers call ``launch(kernel, grid, *args, **constexprs_and_options)``, which is ``kernel[grid](...)``. Inside
``recording(arch)`` nothing runs: every launch is recorded with its actual arguments, and launchers that pick
tiles per GPU generation read ``target_arch()`` instead of querying a device. ``tools/aot.py`` runs each kernel
module's ``aot_launches()`` scenarios (the real launchers on small CPU tensors) under ``recording`` and compiles
exactly the argument types, constexprs and launch options a GPU launch would use (docs/DESIGN.md section 5).
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


@contextlib.contextmanager
def recording(arch: int):
    """Record launches for ``sm_<arch>`` instead of running them; yields the list the records go to."""
    if _STATE["records"] is not None:
        raise RuntimeError("recording() does not nest")
    records: list[Launch] = []
    _STATE.update(records=records, arch=arch)
    try:
        yield records
    finally:
        _STATE.update(records=None, arch=None)
