"""Host-side helpers every kernel module shares, defined once (the @triton.jit ones are in ``common.py``):

- ``GENERATIONS`` / ``generation(device)``: which tile tables a GPU gets. One table for the fused-linear tiles
  (``linear_tiles.TILES``, keyed 90 / 80) and the row-sweep tiles (``logits_rows``, same keys), so that both
  paths agree on every GPU from sm_80 to sm_120; ``num_sms`` / ``l2_bytes``: the device's own figures, the table's
  where it reports none;
- ``cdiv``, ``cap_args`` (the soft cap as every kernel takes it);
- tensor layouts the launchers share: ``as_btv`` / ``dlogits_result`` (logits and their in-place d logits),
  ``row_col_strides`` (per-row or per-token inputs on a (B, T) grid), ``check_inputs`` / ``per_token`` (the fused
  head's), ``half_view`` (a half-precision d-logits view over fp32 rows).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .launch import target_arch

TRITON_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for non-negative ints (host side; kernels use ``tl.cdiv``)."""
    return -(-a // b)


# ---------------------------------------------------------------------------------------------- GPU generations


@dataclass(frozen=True)
class Generation:
    """A GPU generation as the kernels see it.

    tiles: the key of the tile tables it uses, 90 (Hopper-class tiles: up to ~161 KiB of shared memory per block,
    8192-wide row blocks) or 80 (Ampere-class tiles that fit ~99 KiB); sms: the SM count of a representative part,
    assumed when recording launches for ahead-of-time compilation (a real device reports its own); l2_bytes: the
    smallest L2 cache of the generation's parts, the fallback where a device does not report its own (planning on
    meta tensors, recording for AOT): conservative, so a plan never assumes more L2 than a part has."""

    name: str
    tiles: int
    sms: int
    l2_bytes: int


# Compute capability (major * 10 + minor) -> generation. Why sm_120 gets the 80 tiles: consumer Blackwell has
# ~99 KiB of shared memory per block like sm_86 / sm_89, not Hopper's 227 KiB. sm_100 (datacenter Blackwell) has
# Hopper's shared memory and gets its tiles. Only sm_90 and sm_80 are compiled ahead of time (tools/aot.py).
MIB = 1 << 20
GENERATIONS = {
    80: Generation("A100 (sm_80)", 80, 108, 40 * MIB),
    86: Generation("Ampere consumer (sm_86)", 80, 84, 6 * MIB),
    87: Generation("Orin (sm_87)", 80, 16, 4 * MIB),
    89: Generation("Ada (sm_89)", 80, 128, 24 * MIB),
    90: Generation("H100 / H200 (sm_90)", 90, 132, 50 * MIB),
    100: Generation("B200 (sm_100)", 90, 148, 50 * MIB),
    103: Generation("B300 (sm_103)", 90, 148, 50 * MIB),
    110: Generation("Thor (sm_110)", 80, 20, 4 * MIB),
    120: Generation("Blackwell consumer (sm_120)", 80, 170, 32 * MIB),
    121: Generation("DGX Spark (sm_121)", 80, 48, 16 * MIB),
}


def generation_of(capability: int) -> Generation:
    """The table's row for ``capability`` (e.g. 90), or the nearest listed one below it (sm_80 below sm_80)."""
    known = [c for c in GENERATIONS if c <= capability]
    return GENERATIONS[max(known) if known else 80]


def generation(device: torch.device) -> Generation:
    """The generation launches on ``device`` are made for: the recorded target while compiling ahead of time,
    the device's own capability on CUDA, sm_90 under the interpreter (any row works there)."""
    arch = target_arch()
    if arch is not None:
        return generation_of(arch)
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return generation_of(10 * major + minor)
    return GENERATIONS[90]


def l2_bytes(device: torch.device) -> int:
    """L2 cache bytes of ``device``: its own report on CUDA (``L2_cache_size``), else the generation table's
    conservative figure (planning on meta tensors, recording for AOT, the interpreter)."""
    if target_arch() is None and device.type == "cuda":
        size = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)
        if size:
            return int(size)
    return generation(device).l2_bytes


def num_sms(device: torch.device) -> int:
    """SMs of ``device`` (the table's figure while recording for AOT or interpreting)."""
    if target_arch() is None and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return generation(device).sms


# ---------------------------------------------------------------------------------------------- launch arguments


ROUND_CODES = {"bf16": 2, "fp16": 4}  # the SOFTCAP bits of common.round_logit (CAP_ON is 1)


def cap_args(softcap: float | None, round_logits: str | None = None) -> dict:
    """The soft cap as every kernel takes it: a runtime fp32 ``softcap`` (a new cap does not recompile; 1.0, never
    read, when off) and the ``SOFTCAP`` constexpr that compiles the cap in (``soft_cap`` / ``soft_cap_grad``): a bool
    without ``round_logits`` (the kernels are those of before the option), else the int CAP_ON | ROUND_* (bits 1 | 2
    or 4, ``common``) that also rounds each raw logit to bf16 / fp16 before the cap (``common.round_logit``)."""
    on = softcap is not None
    flag = on if round_logits is None else int(on) | ROUND_CODES[round_logits]
    return dict(softcap=1.0 if softcap is None else float(softcap), SOFTCAP=flag)


# ---------------------------------------------------------------------------------------------- layouts


def as_btv(logits: torch.Tensor) -> torch.Tensor:
    """A (B, T, V) view with unit vocab stride (copies only when the vocab dim is strided)."""
    x = logits if logits.dim() == 3 else logits.unsqueeze(0)
    return x if x.stride(-1) == 1 else x.contiguous()


def dlogits_result(logits: torch.Tensor, x: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    """d logits, written by a kernel into ``out`` (B, T, V), shaped like ``logits``; ``x`` is ``as_btv(logits)``.

    In place, the kernel wrote into ``x``: that is ``logits`` itself for any batch / time strides (slices such as
    ``logits[:, :-1]``, transposes), but a private copy when the vocab dim is strided; then one copy back makes
    ``logits`` hold d logits all the same (the elements outside the view are never touched)."""
    if inplace and x.data_ptr() != logits.data_ptr():
        logits.copy_(out.view(logits.shape))
        out = logits
    return out.view(logits.shape) if out.is_contiguous() else out.reshape(logits.shape)


def row_col_strides(x: torch.Tensor | None, B: int, T: int):
    """(tensor, stride over rows, stride over tokens) for (B,), (B, 1) or (B, T) inputs (zero stride broadcasts)."""
    if x is None:
        return None, 0, 0
    x = x.float().contiguous()
    if x.dim() == 1 or x.shape[-1] == 1:
        return x, 1, 0
    return x, T, 1


def check_inputs(hidden, weight, bias, ids) -> tuple[int, int, int]:
    assert hidden.dim() == 2 and weight.dim() == 2 and hidden.shape[1] == weight.shape[1], "hidden (N,H), weight (V,H)"
    assert hidden.dtype == weight.dtype and hidden.dtype in TRITON_DTYPES, "hidden/weight: one of fp32/bf16/fp16"
    assert hidden.stride(1) == 1 and weight.stride(1) == 1, "hidden/weight need a unit stride on H"
    assert ids.shape == hidden.shape[:1] and ids.dtype == torch.int64 and ids.is_contiguous(), "ids (N,) int64"
    assert bias is None or (bias.shape == weight.shape[:1] and bias.is_contiguous()), "bias (V,) contiguous"
    return hidden.shape[0], weight.shape[0], hidden.shape[1]


def per_token(t, n: int) -> torch.Tensor:
    """A per-token fp32 (N,) tensor, made contiguous (autograd hands out expanded, stride-0 gradients)."""
    assert t.shape == (n,) and t.dtype == torch.float32, "per-token tensors: fp32 (N,)"
    return t.contiguous()


def half_view(buf: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The (R, V) d-logits view in ``dtype`` that shares ``buf``'s (R, V) fp32 rows (row stride 2V for half)."""
    if dtype == torch.float32:
        return buf
    return buf.view(dtype)[:, : buf.shape[1]]
