"""The fp32-output GEMM decision (grpo_kernels/kernels/fp32_gemm.py) on CPU, with the CUDA call mocked: probed
once per device on real tensors, never decided from a traced call, one warning when the fallback is taken, and a
fallback that keeps fp32 products and sums."""
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from grpo_kernels.kernels import fp32_gemm

from ..support.tolerances import gamma


@pytest.fixture
def fresh(monkeypatch):
    """Empty decision caches, device index 0 for CPU tensors, and a recorder of the (mocked) out_dtype calls."""
    for name in ("_DECIDED", "_REASON"):
        monkeypatch.setattr(fp32_gemm, name, {})
    monkeypatch.setattr(fp32_gemm, "_WARNED", set())
    monkeypatch.setattr(fp32_gemm, "_device_index", lambda device: 0)
    calls = []

    def mock(behaviour):
        def call(kind, a, b, acc):
            calls.append((kind, tuple(a.shape), fp32_gemm._tracing(a, b, acc)))
            if behaviour == "works":
                value = (a.float() @ b.float()) if kind == "mm" else acc + a.float() @ b.float()
                acc.copy_(value)
            else:
                raise behaviour
        monkeypatch.setattr(fp32_gemm, "_call", call)
    return mock, calls


def _bf16(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_decided_once_per_device_and_reported(fresh):
    mock, calls = fresh
    mock("works")
    a, b = _bf16(4, 8), _bf16(8, 3)
    assert fp32_gemm.fp32_output_gemm_support("cuda:0") == {
        "mm": None, "addmm": None, "fallback": False,
        "reason": "not probed yet (decided at the first fused-head GEMM on this device)"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp32_gemm.supported("mm", a, b) is True
        assert fp32_gemm.supported("mm", a, b) is True
    assert calls == [("mm", (16, 32), False)], "one probe, on the probe's own small real tensors"
    report = fp32_gemm.fp32_output_gemm_support("cuda:0")
    assert report["mm"] is True and report["addmm"] is None and report["fallback"] is False
    assert fp32_gemm.fp32_output_gemm_support("cpu")["mm"] is None


@pytest.mark.parametrize("error", [TypeError("addmm() got an unexpected keyword argument 'out_dtype'"),
                                   NotImplementedError("Could not run 'aten::addmm.dtype_out'")],
                         ids=["TypeError", "NotImplementedError"])
def test_fallback_is_cached_and_warned_once(fresh, error):
    mock, calls = fresh
    mock(error)
    a, b = _bf16(4, 8), _bf16(8, 3)
    with pytest.warns(RuntimeWarning, match=r"addmm.*fallback.*\+15 ms"):
        assert fp32_gemm.supported("addmm", a, b) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fp32_gemm.supported("addmm", a, b) is False
    assert len(calls) == 1
    report = fp32_gemm.fp32_output_gemm_support("cuda:0")
    assert report["addmm"] is False and report["fallback"] is True and type(error).__name__ in report["reason"]


def test_other_errors_are_not_taken_for_a_missing_variant(fresh):
    mock, _ = fresh
    mock(RuntimeError("CUDA error: an illegal memory access was encountered"))
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fp32_gemm.supported("mm", _bf16(4, 8), _bf16(8, 3))
    assert fp32_gemm._DECIDED == {}


def test_a_traced_call_decides_nothing(fresh):
    """Under a FakeTensor trace (torch 2.11's addmm.dtype_out raises TypeError there) the call falls back for
    itself only: no probe, nothing cached, no warning; the next real call probes."""
    mock, calls = fresh
    mock(TypeError("addmm.dtype_out: out_dtype bound to beta"))
    with FakeTensorMode() as mode, warnings.catch_warnings():
        warnings.simplefilter("error")
        acc = mode.from_tensor(torch.zeros(4, 3))
        a, b = mode.from_tensor(_bf16(4, 8)), mode.from_tensor(_bf16(8, 3))
        assert fp32_gemm.supported("addmm", a, b, acc) is None
        assert fp32_gemm._use_out_dtype("addmm", a, b, acc) is False
    assert fp32_gemm._DECIDED == {} and calls == [("addmm", (4, 8), True)]
    mock("works")
    assert fp32_gemm.supported("addmm", _bf16(4, 8), _bf16(8, 3)) is True
    assert calls[-1] == ("addmm", (16, 32), False)
    meta = torch.empty(4, 8, dtype=torch.bfloat16, device="meta")
    assert fp32_gemm._tracing(meta) and not fp32_gemm._tracing(_bf16(4, 8))


@pytest.mark.parametrize("mm_ok", [False, True], ids=["upcast-blocks", "fp32-mm-blocks"])
def test_blocked_fallback_keeps_fp32_products_and_sums(fresh, monkeypatch, mm_ok):
    """acc += a @ b through several 3-row blocks: within fp32 rounding of the float64 truth, where a product
    rounded to bf16 (the former fallback) misses by ~1e-2."""
    mock, calls = fresh
    mock("works")
    monkeypatch.setattr(fp32_gemm, "FALLBACK_BLOCK_BYTES", 3 * 4 * 16)
    a, b = _bf16(10, 64, seed=1), _bf16(64, 16, seed=2)
    acc = torch.randn(10, 16, generator=torch.Generator().manual_seed(3))
    acc0 = acc.clone()
    truth = acc.double() + a.double() @ b.double()
    rounded = acc + (a @ b).float()
    fp32_gemm._blocked_addmm(acc, a, b, mm_ok)
    err = (acc.double() - truth).abs().max().item()
    # fp32 products of bf16 inputs are exact; 64 of them plus the accumulator added in fp32 in any order (blocks):
    # |error| <= gamma_65 (|acc| + |a| |b|) elementwise (Higham)
    bound = gamma(65) * (acc0.double().abs() + a.double().abs() @ b.double().abs())
    assert ((acc.double() - truth).abs() <= bound).all(), err
    assert (rounded.double() - truth).abs().max().item() > 100 * err
    assert len(calls) == (4 if mm_ok else 0)
