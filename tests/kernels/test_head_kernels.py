"""Fused linear head Triton kernels (grpo_kernels/kernels/linear_*_kernels.py) against float64 ground truth.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (tests/conftest.py) on CPU tensors, with the
interpreter's small tile (16 x 32 x 16), so the shapes below cross every block boundary: N = 1, N not a multiple
of BLOCK_M, V below / above / not a multiple of BLOCK_V, H not a multiple of BLOCK_K, several vocab splits and
several deterministic vocab chunks. Pass rule (docs/DESIGN.md section 6):
``err(kernel) <= K * err(torch in the same dtype) + ATOL[dtype] * max(1, |truth|)``, errors measured against
float64 on the same (already rounded) inputs. Outputs the launchers allocate with ``alloc`` are NaN-poisoned.
"""
from __future__ import annotations

import inspect
import math

import pytest
import torch

from grpo_kernels.config import LogitTransform
from grpo_kernels.inputs import LogprobGrads
from grpo_kernels.reference import logprobs_and_entropy

pytest.importorskip("triton")
if not torch.cuda.is_available():
    from grpo_kernels._triton import interpreting
    if not interpreting():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from grpo_kernels.kernels import linear_backward_kernels as lbk  # noqa: E402
from grpo_kernels.kernels import linear_forward_kernels as lfk  # noqa: E402
from grpo_kernels.kernels import linear_tiles as tiles  # noqa: E402
from grpo_kernels._testing import override  # noqa: E402

from ..support.tolerances import ATOL, assert_three_way, gamma  # noqa: E402

pytestmark = pytest.mark.usefixtures("poisoned_outputs")


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEMPERATURE = 0.7


def make_inputs(N, V, H, dtype, bias=True, seed=0, scale=3.0):
    """hidden (N,H), weight (V,H), bias (V,) in dtype, ids (N,) int64; logits of std ~scale."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * (scale / H ** 0.5)
    b = torch.randn(V, generator=g) if bias else None
    ids = torch.randint(0, V, (N,), generator=g)
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return cast(h), cast(w), cast(b), ids.to(DEVICE)


def grads_for(N, seed=1, entropy=True):
    g = torch.Generator().manual_seed(seed)
    gl = torch.randn(N, generator=g).to(DEVICE)
    ge = torch.randn(N, generator=g).to(DEVICE) if entropy else None
    return gl, ge


def eager(h, w, b, ids, gl, ge, dtype):
    """logp, entropy and grads of sum(gl * logp + ge * entropy) via eager autograd with ``dtype`` logits."""
    leaves = [t.detach().to(dtype).requires_grad_() if t is not None else None for t in (h, w, b)]
    hh, ww, bb = leaves
    logits = hh @ ww.T
    if bb is not None:
        logits = logits + bb
    logp, ent = logprobs_and_entropy(logits, ids, TEMPERATURE)
    loss = (logp * gl.to(logp.dtype)).sum()
    if ge is not None:
        loss = loss + (ent * ge.to(ent.dtype)).sum()
    loss.backward()
    lse = torch.logsumexp(logits.detach().to(logp.dtype) / TEMPERATURE, dim=-1)
    return logp.detach(), lse, ent.detach(), tuple(None if t is None else t.grad for t in leaves)


def check3(name, got, same, truth, dtype):
    """The three-way rule (tests/support/tolerances.py); also no NaN/inf leaks out of the kernel."""
    assert got is not None, f"{name}: missing"
    assert_three_way(got, same, truth, dtype, name)


def check_forward(h, w, b, ids):
    """logp, lse and entropy are fp32 whatever the input dtype: against float64 by the three-way rule, the middle
    term eager fp32 on the (exactly upcast) rounded inputs, what the kernel's fp32 tiles compute."""
    logp, lse, ent = lfk.linear_logprobs_forward(h, w, b, ids, TEMPERATURE)
    zeros = torch.zeros(len(ids), device=DEVICE)
    truth = eager(h, w, b, ids, zeros, None, torch.float64)[:3]
    same = eager(h, w, b, ids, zeros, None, torch.float32)[:3]
    for name, got, s, t in zip(("logp", "lse", "entropy"), (logp, lse, ent), same, truth):
        assert got.dtype == torch.float32 and got.shape == ids.shape
        check3(name, got, s, t, torch.float32)
    return logp, lse, ent


def check_backward(h, w, b, ids, entropy=True, deterministic=False, need=(True, True, True)):
    dtype = h.dtype
    _, lse, ent = check_forward(h, w, b, ids)
    gl, ge = grads_for(len(ids), entropy=entropy)
    out = lbk.linear_logprobs_backward(h, w, b, ids, LogprobGrads(lse, ent, gl, ge), LogitTransform(TEMPERATURE),
                                       need, deterministic)
    *_, truth = eager(h, w, b, ids, gl, ge, torch.float64)
    *_, same = eager(h, w, b, ids, gl, ge, dtype)
    for name, got, want, same_g, src, needed in zip(("d_hidden", "d_weight", "d_bias"), out, truth, same,
                                                    (h, w, b), need):
        if src is None or not needed:
            assert got is None, f"{name} was not requested but returned"
            continue
        assert got.dtype == src.dtype and got.shape == src.shape, name
        check3(name, got, same_g, want, dtype)
    return out


SHAPES = {  # id -> (N, V, H); interpreter tile is BLOCK_M=16, BLOCK_V=32, BLOCK_K=16
    "N1-V300-H40": (1, 300, 40),
    "N37-V20-H24": (37, 20, 24),      # V < BLOCK_V, one vocab block
    "N37-V300-H40": (37, 300, 40),    # several vocab splits, ragged last block
    "N50-V333-H33": (50, 333, 33),    # nothing divides anything
}


@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_forward_shapes(shape, dtype):
    check_forward(*make_inputs(*shape, dtype, bias=True))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_forward_no_bias(dtype):
    check_forward(*make_inputs(37, 100, 40, dtype, bias=False))


@pytest.mark.parametrize("scale", [30.0, 0.01], ids=["peaked", "flat"])
def test_forward_extreme_logits(scale):
    """Peaked softmax (logits ~ +-100 after temperature) and near-uniform: no overflow, entropy in [0, log V]."""
    h, w, b, ids = make_inputs(20, 200, 24, torch.float32, bias=False, scale=scale)
    _, _, ent = check_forward(h, w, b, ids)
    # the float64 entropy lies in [0, log V]; ours within the three-way bound just checked, at most ATOL of fp32
    # (scale max(1, log V)) plus K times the fp32 eager error, which is itself below that ATOL here
    slack = 2 * ATOL[torch.float32] * math.log(200)
    assert (ent >= -slack).all() and (ent <= math.log(200) + slack).all()


def test_forward_empty():
    h, w, b, ids = make_inputs(0, 50, 16, torch.float32)
    assert all(t.shape == (0,) for t in lfk.linear_logprobs_forward(h, w, b, ids, 1.0))


@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy-grad", "no-entropy-grad"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_backward(dtype, bias, entropy, mode):
    check_backward(*make_inputs(37, 100, 40, dtype, bias=bias), entropy=entropy,
                   deterministic=mode == "deterministic")


@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
@pytest.mark.parametrize("shape", [SHAPES["N1-V300-H40"], SHAPES["N37-V20-H24"], SHAPES["N50-V333-H33"]],
                         ids=["N1-V300-H40", "N37-V20-H24", "N50-V333-H33"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backward_shapes(dtype, shape, mode):
    check_backward(*make_inputs(*shape, dtype), deterministic=mode == "deterministic")


NEEDS = {"frozen-head": (True, False, False), "head-only": (False, True, True), "bias-only": (False, False, True),
         "hidden-and-bias": (True, False, True), "weight-only": (False, True, False)}


@pytest.mark.parametrize("mode", ["atomic", "deterministic"])
@pytest.mark.parametrize("need", list(NEEDS.values()), ids=list(NEEDS))
def test_backward_need_flags(need, mode):
    """Only the requested gradients come back (need_weight=False: a frozen / LoRA head) and they are right."""
    check_backward(*make_inputs(37, 100, 40, torch.bfloat16), deterministic=mode == "deterministic", need=need)


def test_backward_nothing_needed():
    h, w, b, ids = make_inputs(5, 40, 16, torch.float32)
    _, lse, ent = lfk.linear_logprobs_forward(h, w, b, ids, 1.0)
    gl, ge = grads_for(5)
    assert lbk.linear_logprobs_backward(h, w, b, ids, LogprobGrads(lse, ent, gl, ge), LogitTransform(1.0),
                                        (False, False, False), False) == \
        (None, None, None)


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_deterministic_several_chunks(dtype, knobs):
    """A tiny chunk budget forces one BLOCK_V-wide vocab chunk per step: dh accumulates over 4 chunks."""
    knobs(chunk_bytes=1)
    check_backward(*make_inputs(37, 100, 40, dtype), deterministic=True)


@pytest.mark.parametrize("chunks", ["one-chunk", "several-chunks"])
def test_deterministic_is_bitwise_reproducible(chunks, monkeypatch, knobs):
    if chunks == "several-chunks":
        knobs(chunk_bytes=1)
    else:
        monkeypatch.setattr(lbk, "DETERMINISTIC_CHUNK_FRACTION", 1.0)
    h, w, b, ids = make_inputs(37, 100, 40, torch.bfloat16)
    _, lse, ent = lfk.linear_logprobs_forward(h, w, b, ids, TEMPERATURE)
    gl, ge = grads_for(37)
    runs = [lbk.linear_logprobs_backward(h, w, b, ids, LogprobGrads(lse, ent, gl, ge), LogitTransform(TEMPERATURE),
                                         (True, True, True), True)
            for _ in range(2)]
    for first, second in zip(*runs):
        assert torch.equal(first, second)


def test_forward_is_bitwise_reproducible():
    h, w, b, ids = make_inputs(37, 300, 40, torch.bfloat16)
    first, second = (lfk.linear_logprobs_forward(h, w, b, ids, TEMPERATURE) for _ in range(2))
    assert all(torch.equal(x, y) for x, y in zip(first, second))


def test_swizzle_with_several_groups(monkeypatch):
    """GROUP_M=2 with 4 token blocks: two groups of the backward's tile swizzle, the last one partial."""
    monkeypatch.setattr(tiles, "GROUP_M", 2)
    for deterministic in (False, True):
        check_backward(*make_inputs(50, 100, 24, torch.float32), deterministic=deterministic)


def test_one_vocab_split():
    """Many SMs per token block: the split heuristic must still cover the vocab exactly once."""
    for sms in (1, 1000):
        with override(interpret_sms=sms):
            check_forward(*make_inputs(37, 300, 40, torch.float32))


@pytest.mark.skipif(DEVICE == "cuda", reason="the interpreter tile only exists on CPU")
def test_gpu_sized_tile_under_interpreter(knobs):
    """The sm_90 block sizes (128 x 128 x 64) on a shape smaller than one tile, forward and backward."""
    knobs(interpret_tile=tiles.TILES[(90, "fwd", "half")])
    for deterministic in (False, True):
        check_backward(*make_inputs(20, 150, 72, torch.bfloat16), deterministic=deterministic)


def test_only_block_sizes_and_flags_are_constexpr():
    """Lengths, strides, the temperature and the soft cap are runtime arguments: a new N, V, H, temperature or cap
    never recompiles (``SOFTCAP`` only says whether there is a cap)."""
    kernels = [lfk.linear_fwd_partial_kernel, lfk.linear_fwd_merge_kernel, lbk.linear_bwd_atomic_kernel,
               lbk.linear_dlogits_kernel]
    for kern in kernels:
        fn = getattr(kern, "fn", kern)
        params = inspect.signature(fn).parameters.values()
        const = {p.name for p in params if "constexpr" in str(p.annotation)}
        assert const, fn.__name__
        assert all(c.startswith(("BLOCK_", "HAS_", "NEED_", "GROUP_", "DOT_", "SOFTCAP")) for c in const), \
            (fn.__name__, const)
        assert {"N", "inv_temperature"} <= {p.name for p in params} - const or fn.__name__ == "linear_fwd_merge_kernel"


@pytest.mark.parametrize("entropy", [True, False], ids=["entropy-grad", "no-entropy-grad"])
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_deterministic_dlogits_by_gemm_several_chunks(dtype, entropy, knobs):
    """The deterministic backward with d logits from fp32 GEMM logits + the row-sweep epilogue (the CUDA bf16/fp16
    choice), forced here on CPU: 4 vocab chunks, written in place as half-precision rows; bitwise reproducible."""
    knobs(dlogits_by_gemm=True, chunk_bytes=1)
    h, w, b, ids = make_inputs(37, 100, 40, dtype)
    first = check_backward(h, w, b, ids, entropy=entropy, deterministic=True)
    _, lse, ent = lfk.linear_logprobs_forward(h, w, b, ids, TEMPERATURE)
    gl, ge = grads_for(37, entropy=entropy)
    again = lbk.linear_logprobs_backward(h, w, b, ids, LogprobGrads(lse, ent, gl, ge), LogitTransform(TEMPERATURE),
                                         (True, True, True), True)
    assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_fp32_accumulating_gemm_helpers():
    """logits_f32 / addmm_f32_ (the cuBLAS steps of the cuBLAS-based paths) against float64, bf16 and fp32."""
    from grpo_kernels.kernels import fp32_gemm as epi
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.bfloat16, torch.float32):
        a, b = torch.randn(9, 20, generator=g).to(dtype), torch.randn(20, 7, generator=g).to(dtype)
        acc = torch.randn(9, 7, generator=g)
        want = acc.double() + a.double() @ b.double()
        # fp32 accumulation of 20 products of exact inputs plus the accumulator: |error| <= gamma_21 (|acc| + |a| |b|)
        # elementwise (Higham), whatever order the GEMM adds in
        bound = gamma(21) * (acc.double().abs() + a.double().abs() @ b.double().abs())
        epi.addmm_f32_(acc, a, b)
        assert acc.dtype == torch.float32 and ((acc.double() - want).abs() <= bound).all()
        out = torch.empty(9, 7)
        epi.logits_f32(a, b.t(), out)
        bound = gamma(20) * (a.double().abs() @ b.double().abs())
        assert ((out.double() - a.double() @ b.double()).abs() <= bound).all()
