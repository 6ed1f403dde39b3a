"""Lazy Triton import and the choice of implementation (``impl``), shared by every op.

Triton is imported on first use only, so ``import grpo_kernels`` stays cheap and works without Triton, and
``TRITON_INTERPRET=1`` set any time before the first kernel call takes effect (docs/DESIGN.md section 6).
"""
from __future__ import annotations

import functools
import os

import torch

from .config import IMPLS

IMPL_ENV = "GRPO_KERNELS_IMPL"


def interpreting() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _import_triton():
    try:
        import triton
        import triton.language as tl
    except ImportError as exc:  # pragma: no cover - triton is a hard dependency on Linux
        raise RuntimeError("impl='triton' needs the 'triton' package: pip install triton") from exc
    return triton, tl


def import_triton():
    """``(triton, triton.language)``, imported on first call."""
    return _import_triton()


def resolve_impl(impl: str | None, *tensors: torch.Tensor) -> str:
    """'triton' or 'torch' for this call.

    impl: "auto" | "triton" | "torch"; the environment variable ``GRPO_KERNELS_IMPL`` overrides "auto".
    auto picks Triton on CUDA tensors and the chunked PyTorch path elsewhere; meta tensors (a plan made without
    data, ``grpo_kernels.explain``) count as CUDA tensors. "triton" on CPU tensors works only
    under ``TRITON_INTERPRET=1`` and otherwise raises a ValueError that says so.
    """
    impl = "auto" if impl is None else impl
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        impl = os.environ.get(IMPL_ENV, "auto") or "auto"
        if impl not in IMPLS:
            raise ValueError(f"environment variable {IMPL_ENV} must be one of {IMPLS}, got {impl!r}")
    on_cuda = all(t.is_cuda or t.device.type == "meta" for t in tensors if t is not None)
    if impl == "auto":
        return "triton" if on_cuda else "torch"
    if impl == "triton" and not on_cuda and not interpreting():
        devices = sorted({str(t.device) for t in tensors if t is not None})
        raise ValueError(
            f"impl='triton' needs CUDA tensors, got tensors on {devices}; set TRITON_INTERPRET=1 before the first "
            "kernel call to run the Triton kernels on the CPU interpreter, or use impl='torch'"
        )
    return impl
