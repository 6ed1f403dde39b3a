"""cuBLAS GEMMs with fp32 output for bf16 / fp16 operands (the fused head's logits chunk and its dW / dh
accumulators), and the one decision whether this torch can do them (docs/kernels.md, "fp32-output GEMMs").

``torch.mm(a, b, out_dtype=torch.float32)`` and ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``
(torch >= 2.11) multiply half-precision operands with fp32 accumulation and fp32 output: no bf16 rounding of the
logits, and dW accumulates across chunks in fp32 with cuBLAS beta = 1 and no temporary.

The decision is made once per device and GEMM kind, on a small real CUDA call at first use (``_probe``: no host
sync, no value read), never
from a traced call: under a FakeTensor / meta trace or ``torch.compile`` tracing (where torch 2.11's
``addmm.dtype_out`` decomposition raises TypeError although the CUDA kernel exists) the out_dtype call is tried,
its failure falls back for that call only and nothing is cached. When the probe says no, a RuntimeWarning is
issued once per device and kind, and the fallback runs:
- ``logits_f32``: the half-precision product, upcast (logits rounded to bf16 once, as eager PyTorch computes them);
- ``addmm_f32_``: fp32 products of at most ``FALLBACK_BLOCK_BYTES`` of ``acc`` at a time (``mm`` with fp32
  output where that works, else the operands upcast to fp32: exact products), added into the fp32 accumulator:
  partial sums stay fp32.
``fp32_output_gemm_support(device)`` reports the decision (``grpo_kernels.explain``, benchmarks/gpu_check.sh).
"""
from __future__ import annotations

import warnings

import torch

# Largest fp32 temporary of the addmm fallback (bytes).
FALLBACK_BLOCK_BYTES = 64 << 20
KINDS = ("mm", "addmm")
# What the fallback costs, measured at N = 8192, H = 4096, V = 151936 bf16 (named in the warning).
_FALLBACK_COST = {
    "mm": "logits rounded to bf16 before the softmax (eager PyTorch's precision), no extra time",
    "addmm": "dW accumulated through 64 MiB fp32 blocks: ~+15 ms per step at N=8192 H=4096 V=151936",
}

# (kind, device index) -> whether the out_dtype variant works; absent: not probed yet.
_DECIDED: dict[tuple[str, int], bool] = {}
_REASON: dict[tuple[str, int], str] = {}
_WARNED: set[tuple[str, int]] = set()


def _device_index(device: torch.device) -> int:
    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def _tracing(*tensors: torch.Tensor) -> bool:
    """Whether this call is being traced (torch.compile / FakeTensor / meta), so its outcome says nothing about
    the real kernels and must not be cached."""
    from torch._subclasses.fake_tensor import is_fake

    if torch.compiler.is_compiling():
        return True
    return any(t.device.type == "meta" or is_fake(t) for t in tensors)


def _unsupported(err: Exception) -> bool:
    """An error that says this torch lacks the out_dtype GEMM variant (not an out-of-memory or a shape bug)."""
    if isinstance(err, torch.OutOfMemoryError):
        return False
    text = str(err)
    return isinstance(err, (TypeError, NotImplementedError)) or "out_dtype" in text or "overload" in text


def _call(kind: str, a: torch.Tensor, b: torch.Tensor, acc: torch.Tensor | None) -> None:
    """One out_dtype GEMM: ``acc += a @ b`` (addmm) or ``acc = a @ b`` (mm), fp32 output."""
    if kind == "mm":
        torch.mm(a, b, out_dtype=torch.float32, out=acc)
    else:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)


def _probe(kind: str, device: torch.device) -> tuple[bool, str]:
    """Run the out_dtype GEMM once on small real tensors of ``device``: whether this torch has the variant.

    Why no check of its value: reading it would be a host sync (and would fail inside CUDA graph capture) at the
    first call of a training step; the variant either exists or raises here, and the GPU check
    (benchmarks/gpu_check.sh, tests/kernels/test_gpu_kernels.py) compares its logits with float64 ones."""
    a = torch.full((16, 32), 0.5, dtype=torch.bfloat16, device=device)
    b = torch.full((32, 16), 0.25, dtype=torch.bfloat16, device=device)
    out = torch.ones((16, 16), dtype=torch.float32, device=device)
    try:
        _call(kind, a, b, out)
    except (TypeError, RuntimeError, NotImplementedError) as err:
        if not _unsupported(err):
            raise
        return False, f"torch.{kind}(out_dtype=float32) raised {type(err).__name__}: {str(err).splitlines()[0]}"
    return True, f"torch.{kind}(out_dtype=float32) works on {device}"


def supported(kind: str, *tensors: torch.Tensor) -> bool | None:
    """Whether the fp32-output ``kind`` GEMM ("mm" or "addmm") is used for these CUDA tensors: probed once per
    device on real tensors and cached; None while tracing (the caller tries the call and falls back, uncached)."""
    if _tracing(*tensors):
        return None
    device = tensors[0].device
    key = (kind, _device_index(device))
    if key not in _DECIDED:
        ok, reason = _probe(kind, device)
        _DECIDED[key], _REASON[key] = ok, reason
        if not ok and key not in _WARNED:
            _WARNED.add(key)
            warnings.warn(f"grpo_kernels: {reason}; using the fallback on {device} ({_FALLBACK_COST[kind]}). "
                          "torch >= 2.11 has the fp32-output GEMM.", RuntimeWarning, stacklevel=3)
    return _DECIDED[key]


def _traced_try(kind: str, a, b, acc) -> bool:
    """Under a trace: try the out_dtype call; False (nothing cached) when the trace rejects it."""
    try:
        _call(kind, a, b, acc)
    except (TypeError, RuntimeError, NotImplementedError) as err:
        if not _unsupported(err):
            raise
        return False
    return True


def _use_out_dtype(kind: str, a, b, acc) -> bool:
    """Run the out_dtype GEMM when it is supported (or, while tracing, when the trace accepts it)."""
    ok = supported(kind, a, b, acc)
    if ok is None:
        return _traced_try(kind, a, b, acc)
    if ok:
        _call(kind, a, b, acc)
    return ok


def fp32_output_gemm_support(device) -> dict:
    """The decision for ``device``: {"mm": bool | None, "addmm": bool | None (None: not probed yet, or not
    CUDA), "fallback": whether a fallback is in use, "reason": what the probes found}."""
    device = torch.device(device)
    if device.type != "cuda":
        return {"mm": None, "addmm": None, "fallback": False,
                "reason": f"{device.type}: the fp32-output GEMM path is used on CUDA only"}
    index = _device_index(device)
    found = {kind: _DECIDED.get((kind, index)) for kind in KINDS}
    reasons = [_REASON[(kind, index)] for kind in KINDS if (kind, index) in _REASON]
    return {**found, "fallback": any(v is False for v in found.values()),
            "reason": "; ".join(reasons) or "not probed yet (decided at the first fused-head GEMM on this device)"}


def logits_f32(h: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:
    """out (R, V) fp32 = h (R, H) @ weight (V, H)^T with fp32 accumulation and fp32 output.

    CUDA bf16/fp16: ``torch.mm(..., out_dtype=torch.float32)``; without it, the half-precision product upcast
    (logits rounded to bf16 once, as eager PyTorch). CPU: the rounded inputs multiplied in fp32.
    """
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    elif not h.is_cuda:
        torch.mm(h.float(), weight.float().t(), out=out)
    elif not _use_out_dtype("mm", h, weight.t(), out):
        out.copy_(torch.mm(h, weight.t()))


def addmm_f32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc (fp32) += a @ b for bf16/fp16/fp32 a, b, accumulated in fp32 with no half-precision intermediate.

    CUDA: ``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` (cuBLAS beta = 1, no temporary); where this
    torch lacks it: fp32 products of at most ``FALLBACK_BLOCK_BYTES`` rows of acc at a time, added in. CPU: the
    inputs upcast, then ``addmm_``.
    """
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if not a.is_cuda:
        acc.addmm_(a.float(), b.float())
        return
    if _use_out_dtype("addmm", a, b, acc):
        return
    _blocked_addmm(acc, a, b, supported("mm", a, b, acc))


def _blocked_addmm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, mm_ok: bool | None) -> None:
    """The addmm fallback: ``acc += a @ b`` through fp32 products of at most ``FALLBACK_BLOCK_BYTES`` of ``acc``
    at a time. mm_ok: whether ``mm(out_dtype=float32)`` works (None while tracing: tried on the first block)."""
    rows = max(1, min(acc.shape[0], FALLBACK_BLOCK_BYTES // (4 * max(1, acc.shape[1]))))
    tmp = torch.empty((rows, acc.shape[1]), dtype=torch.float32, device=acc.device)
    b32 = None
    for i0 in range(0, acc.shape[0], rows):
        i1 = min(acc.shape[0], i0 + rows)
        part = tmp[: i1 - i0]
        if mm_ok is None:
            mm_ok = _traced_try("mm", a[i0:i1], b, part)
            if mm_ok:
                acc[i0:i1].add_(part)
                continue
        if mm_ok:
            _call("mm", a[i0:i1], b, part)
        else:
            # Why upcast rather than a half product: bf16 / fp16 values are exact in fp32, so the block's
            # products and sums stay fp32 (slower than tensor-core bf16, and only where torch lacks out_dtype).
            b32 = b.float() if b32 is None else b32
            torch.mm(a[i0:i1].float(), b32, out=part)
        acc[i0:i1].add_(part)
