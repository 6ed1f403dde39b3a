"""Input validation: every bad input becomes a ValueError naming the argument and what was expected.

Kernels never see unchecked shapes, dtypes or token ids: a wrong id would read out of bounds inside a kernel.
"""
from __future__ import annotations

import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POISON_ENV = "GRPO_KERNELS_POISON"


def _shape(t) -> tuple:
    return tuple(t.shape)


def tensor(name: str, t, *, floating: bool = False, integer: bool = False, dims=None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if floating and t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name} must be a float tensor (float32, bfloat16, float16 or float64), got {t.dtype}")
    if integer and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor of token ids, got {t.dtype}")
    if dims is not None and t.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(str(d) for d in dims)} dimensions, got shape {_shape(t)}")
    return t


def temperature(value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {value!r}")
    return float(value)


def token_ids(ids: torch.Tensor, vocab_size: int, name: str = "ids") -> None:
    """Ids must lie in [0, V): one reduction and one host sync, cheap next to a vocab sweep."""
    if ids.numel() == 0:
        return
    lo, hi = torch.aminmax(ids)
    lo, hi = int(lo), int(hi)
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"{name} must lie in [0, V) = [0, {vocab_size}), got values in [{lo}, {hi}]")


def same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def logits_and_ids(logits, ids) -> None:
    tensor("logits", logits, floating=True, dims=(2, 3))
    tensor("ids", ids, integer=True)
    if _shape(ids) != _shape(logits)[:-1]:
        raise ValueError(f"ids must have shape {_shape(logits)[:-1]} (logits' leading dims), got {_shape(ids)}")
    if logits.shape[-1] == 0:
        raise ValueError("logits must have a non-empty vocabulary dimension V")
    same_device(logits=logits, ids=ids)
    token_ids(ids, logits.shape[-1])


def loss_inputs(B: int, T: int, advantages, mask, old_logps, ref_logps, is_ratio, sampling_logps,
                num_items_in_batch, config) -> None:
    """Shapes, dtypes and presence of the per-token inputs of the loss; (B, T) is the completion grid."""
    tensor("advantages", advantages, floating=True)
    if _shape(advantages) not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape ({B},) or ({B}, {T}), got {_shape(advantages)}")
    if mask is not None:
        tensor("mask", mask)
        if _shape(mask) != (B, T):
            raise ValueError(f"mask must have shape ({B}, {T}), got {_shape(mask)}")
        if mask.is_complex():
            raise ValueError(f"mask must be bool, integer or float, got {mask.dtype}")
    for name, t in (("old_logps", old_logps), ("ref_logps", ref_logps), ("sampling_logps", sampling_logps)):
        if t is not None:
            tensor(name, t, floating=True)
            if _shape(t) != (B, T):
                raise ValueError(f"{name} must have shape ({B}, {T}), got {_shape(t)}")
    if is_ratio is not None:
        tensor("is_ratio", is_ratio, floating=True)
        if _shape(is_ratio) not in ((B,), (B, 1), (B, T)):
            raise ValueError(f"is_ratio must have shape ({B},), ({B}, 1) or ({B}, {T}), got {_shape(is_ratio)}")
    if num_items_in_batch is not None:
        n = num_items_in_batch
        if isinstance(n, torch.Tensor):
            if n.numel() != 1:
                raise ValueError(f"num_items_in_batch must be a scalar, got shape {_shape(n)}")
        elif isinstance(n, bool) or not isinstance(n, (int, float)) or not math.isfinite(n) or n < 0:
            raise ValueError(f"num_items_in_batch must be a number >= 0 or a scalar tensor, got {n!r}")
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"ref_logps is required when beta != 0 (beta={config.beta}); pass the reference "
                         "model's per-token log-probs of shape (B, T)")
    # num_items_in_batch may live anywhere (a CPU scalar is common): it is moved to the loss's device
    same_device(advantages=advantages, mask=mask, old_logps=old_logps, ref_logps=ref_logps, is_ratio=is_ratio,
                sampling_logps=sampling_logps)


def kernel_dtype(name: str, t: torch.Tensor) -> None:
    if t.dtype not in KERNEL_DTYPES:
        raise ValueError(f"impl='triton' supports {name} in float32, bfloat16 or float16, got {t.dtype}; "
                         "use impl='torch' for float64")


def alloc(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled when GRPO_KERNELS_POISON=1 (tests: a kernel that skips a write shows up)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get(POISON_ENV, "0") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out
