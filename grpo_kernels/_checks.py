"""Validation primitives (a ValueError naming the argument and what was expected) used by ``inputs.py``, and the
output allocator of the Triton launchers (NaN-poisoned under GRPO_KERNELS_POISON=1 in tests).
"""
from __future__ import annotations

import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
POISON_ENV = "GRPO_KERNELS_POISON"
# Opt-in: read the value checks on the host (one sync each), so that a GPU run raises the ValueError too.
CHECK_VALUES_ENV = "GRPO_KERNELS_CHECK_VALUES"


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


def mask_like(mask, shape: tuple, what: str = "") -> None:
    """A mask (None allowed) of the given shape, bool / integer / float."""
    if mask is None:
        return
    tensor("mask", mask)
    if tuple(mask.shape) != tuple(shape):
        raise ValueError(f"mask must have shape {tuple(shape)}{what}, got {tuple(mask.shape)}")
    if mask.is_complex():
        raise ValueError(f"mask must be bool, integer or float, got {mask.dtype}")


def is_number(value) -> bool:
    """An int or float (not a bool), concrete or, under torch.compile, symbolic: Dynamo shows a symbolic float to
    the traced code as a float."""
    return not isinstance(value, bool) and isinstance(value, (int, float))


def is_finite(value) -> bool:
    """``math.isfinite`` written as comparisons, so that it also reads a symbolic float (torch.compile's automatic
    dynamic or ``dynamic=True``, where ``math.isfinite`` does not trace): False for NaN and +-inf. On a symbolic
    value each comparison becomes a guard of the compiled graph (docs/api.md, "Errors and edge cases"). Why the
    largest float, not infinity, as the bound: the compiler takes ``-inf < s < inf`` as true of every symbolic float
    and keeps no guard, so that a later infinite value would reuse the graph unchecked; ``|s| <= max`` is a guard,
    which infinity fails (the step is traced again, the infinity a constant, and the check raises). The bound is
    a literal (``sys.float_info.max``): with ``dynamic=True`` Dynamo makes a module-level float symbolic too."""
    return -1.7976931348623157e308 <= value <= 1.7976931348623157e308


def shown(value) -> str:
    """``repr(value)`` for an error message. Under torch.compile a number may be symbolic, which has no repr that
    Dynamo can trace, and the traced code cannot tell it from a constant: the message names the argument and says
    the value is not shown."""
    if is_number(value) and torch.compiler.is_compiling():
        return "a value traced by torch.compile (not shown)"
    return repr(value)


def finite(name: str, value, *, positive: bool = False, nonneg: bool = False) -> None:
    """A finite number (> 0 with ``positive``, >= 0 with ``nonneg``), concrete or symbolic (``is_finite``)."""
    if not is_number(value) or not is_finite(value):
        raise ValueError(f"{name} must be a finite number, got {shown(value)}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {shown(value)}")
    if nonneg and value < 0:
        raise ValueError(f"{name} must be >= 0, got {shown(value)}")


def temperature(value) -> float:
    if not is_number(value) or not is_finite(value) or value <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {shown(value)}")
    return float(value)


def softcap(value) -> float | None:
    """None (no soft cap) or a finite cap > 0 (``z = cap * tanh(x / cap)``, docs/numerics.md "Soft-capped logits")."""
    if value is None:
        return None
    if not is_number(value) or not is_finite(value) or value <= 0:
        raise ValueError(f"softcap must be None or a finite number > 0, got {shown(value)}")
    return float(value)


ROUND_LOGITS = ("bf16", "fp16")


def round_logits(value) -> str | None:
    """None (fp32 logits) or a dtype name of ``ROUND_LOGITS`` the raw logits are rounded to (docs/numerics.md
    "Rounding the logits")."""
    if value is not None and (not isinstance(value, str) or value not in ROUND_LOGITS):
        raise ValueError(f"round_logits must be None or one of {ROUND_LOGITS}, got {value!r}")
    return value


def invariant_block_rows(value, batch_invariant) -> int | None:
    """None (the device's block, ``invariance.BLOCK_ROWS``) or the rows per block of a batch-invariant call, an int
    >= 1, only with ``batch_invariant=True`` (never ignored: another block is another bit pattern, docs/numerics.md
    "Batch invariance")."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"invariant_block_rows must be None or an int number of rows >= 1, got {value!r}")
    if batch_invariant is not True:
        raise ValueError(f"invariant_block_rows={value} sets the rows per block of batch_invariant=True, but "
                         f"batch_invariant is {batch_invariant!r}; set batch_invariant=True or leave "
                         "invariant_block_rows None")
    return value


def host_value_checks() -> bool:
    """Whether the value checks read their verdict on the host (``GRPO_KERNELS_CHECK_VALUES=1``)."""
    return os.environ.get(CHECK_VALUES_ENV, "0") == "1"


def holds(ok: torch.Tensor, message: str, detail=None) -> None:
    """A check of tensor values without a host sync (docs/api.md, "Host syncs"): ``ok`` is a 0-dim bool tensor
    computed where the values are; where it is False a ValueError(message + detail()) is raised.

    By default ``torch._assert_async``: on a GPU the verdict stays in the stream (no sync; a failure is a device-side
    assert, which ends the process's CUDA context), on a CPU it is read at once and raised as the ValueError. With
    ``GRPO_KERNELS_CHECK_VALUES=1`` the verdict is read on the host (one sync per check), so a GPU run raises the
    ValueError too. Under torch.compile the same check is traced into the graph (a RuntimeError naming the argument
    when the compiled call runs). detail: a zero-argument callable giving the values for the message, called only on
    failure (never under torch.compile)."""
    if ok.device.type == "meta":  # meta tensors (planning) carry no values
        return
    if torch.compiler.is_compiling():
        # Why traced, never skipped: a compiled call must refuse what eager refuses (an out-of-range id would read
        # the next row). The check becomes the graph's own aten._assert_async: it fails as a RuntimeError with this
        # message when the compiled graph runs (on a GPU, a device-side assert), never as a silent number.
        torch._assert_async(ok, message)
        return
    if host_value_checks():
        failed = not bool(ok)
    else:
        try:
            torch._assert_async(ok, message)
            failed = False
        except RuntimeError:  # a CPU tensor: the verdict was read at once
            failed = True
    if failed:
        raise ValueError(message + (detail() if detail is not None else ""))


def token_ids(ids: torch.Tensor, vocab_size: int, name: str = "ids") -> None:
    """Ids must lie in [0, V): one reduction, checked on the device (``holds``)."""
    if ids.numel() == 0:
        return
    ok = ((ids >= 0) & (ids < vocab_size)).all()
    holds(ok, f"{name} must lie in [0, V) = [0, {vocab_size})",
          lambda: f", got values in [{int(ids.min())}, {int(ids.max())}]")


def overlaps_in_memory(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory, decided from its sizes and strides alone.

    Dimensions of size 1 are ignored; a zero stride on a larger dimension is overlap (``expand``). The others,
    sorted by stride, must each step over everything the dimensions inside them reach: ``stride >= 1 + sum((size -
    1) * stride)`` of the smaller-strided ones. Every view made by slicing (``logits[:, :-1]``, ``[:, ::2]``),
    ``transpose`` / ``permute`` or ``narrow`` of a non-overlapping tensor passes; ``expand`` and ``as_strided``
    onto itself fail. Why not ``torch._debug_has_internal_overlap``: it answers "too hard" for any view that is
    not contiguous (``logits[:, :-1]`` included). Sufficient, not necessary: an interleaved ``as_strided`` layout
    whose elements happen to be distinct (sizes (2, 3), strides (3, 2)) is also reported as overlapping."""
    if t.numel() <= 1:
        return False
    dims = sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz > 1)
    reach = 1  # elements spanned by the dimensions already walked, plus one
    for stride, size in dims:
        if stride < reach:  # also a zero stride: every index of this dim hits the same element
            return True
        reach += (size - 1) * stride
    return False


def rows_flatten(t: torch.Tensor) -> bool:
    """Whether ``t.view(-1, t.shape[-1])`` exists (its leading dims flatten without a copy), decided from sizes and
    strides alone (no try / except: a fake tensor under torch.compile raises another error type)."""
    dims = [(size, stride) for size, stride in zip(t.shape[:-1], t.stride()[:-1]) if size > 1]
    return all(outer_stride == inner_size * inner_stride
               for (_, outer_stride), (inner_size, inner_stride) in zip(dims[:-1], dims[1:]))


def cu_seqlens(cu, n_tokens: int, n_seq: int, device) -> None:
    """``cu_seqlens`` of S = n_seq sequences over n_tokens packed tokens (flash-attn's convention): an int32 / int64
    (S + 1,) tensor on ``device``, starting at 0, non-decreasing, ending at n_tokens (the values on the device)."""
    tensor("cu_seqlens", cu)
    if cu.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be an int32 or int64 tensor (flash-attn's convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] != n_seq + 1:
        raise ValueError(f"cu_seqlens must have shape (S + 1,) = ({n_seq + 1},), one more than the {n_seq} "
                         f"advantages (one per sequence), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"cu_seqlens must be on the device of the logits / hidden states {device}, got {cu.device}")
    if cu.device.type == "meta":
        return
    holds(cu[0] == 0, "cu_seqlens must start at 0", lambda: f", got {int(cu[0])}")
    holds((cu[1:] >= cu[:-1]).all(), "cu_seqlens must be non-decreasing (sequence s is tokens "
          "cu_seqlens[s]:cu_seqlens[s + 1])", lambda: f", got {cu.tolist()}")
    holds(cu[-1] == n_tokens, f"cu_seqlens must end at the number of packed tokens N = {n_tokens}",
          lambda: f", got {int(cu[-1])}")


def same_device(**tensors) -> None:
    devices = {name: t.device for name, t in tensors.items() if isinstance(t, torch.Tensor)}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def kernel_dtype(name: str, t) -> None:
    """A tensor (or the dtype it is computed in) the Triton kernels support."""
    dtype = t if isinstance(t, torch.dtype) else t.dtype
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"impl='triton' supports {name} in float32, bfloat16 or float16, got {dtype}; "
                         "use impl='torch' for float64")


def alloc(shape, dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled when GRPO_KERNELS_POISON=1 (tests: a kernel that skips a write shows up)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    if os.environ.get(POISON_ENV, "0") == "1":
        out.fill_(float("nan") if dtype.is_floating_point else -1)
    return out
