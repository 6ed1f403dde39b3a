"""The fused head's extra per-token outputs (``linear_token_logprobs(..., extra_outputs=...)``: log sum p^2, the
mean logit, is_top1) on every path it takes: head.torch (the CPU default), head.light (the Triton tile forward,
with gradients) and head.no_grad (cuBLAS logits + the row fold), the Triton ones under TRITON_INTERPRET=1 with
poisoned outputs.

Ground truth: ``reference.token_extras`` in float64 on the full logits; the float outputs pass the three-way rule
(tests/support/tolerances.py) against the same reference on logits formed in the input dtype; is_top1 is compared
exactly (the cases keep every non-tied pair of top logits far apart, which the test checks, so that no rounding can
reorder them; exact ties are made on purpose, by duplicate weight rows, and must follow "the first maximum wins").
V = 77 crosses the interpreter's row block (16), tile (32) and vocab splits, and head.torch's tiles (shrunk to 32
columns here); the tied columns sit in different blocks, splits and tiles.
"""
from __future__ import annotations

import itertools

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.config import EXTRA_OUTPUTS
from grpo_kernels.reference import token_extras

from ..support.tolerances import assert_three_way

pytestmark = pytest.mark.usefixtures("poisoned_outputs", "small_torch_tiles")

B, T, H, V = 2, 7, 16, 77
TEMPERATURE = 0.7
# Duplicate weight rows: columns tied exactly for every hidden row. 20 and 31 share a row block (16 columns) and a
# tile (32); 31 ends one, 32 starts the next; 64 starts a later one (interpreter tiles and head.torch's shrunk
# ones): an off-by-one at a boundary shows.
TIED = (20, 31, 32, 64)
IMPLS = ("torch", "triton")


@pytest.fixture
def small_torch_tiles(monkeypatch):
    """head.torch's vocab tiles shrunk to 32 columns (a production constant, 4096), so that its per-tile state
    (the running max before the target's tile, the target's own tile) crosses tiles at V = 77."""
    from grpo_kernels.head import torch_tiles

    monkeypatch.setattr(torch_tiles, "TORCH_HEAD_TILE_VOCAB", 32)


def make_case(dtype=torch.float32, seed: int = 0, integer: bool = True):
    """(hidden (B, T, H), weight, bias, ids, mask) in ``dtype``: the TIED columns (duplicate weight rows and bias)
    made the row maximum for the tokens of row 0 (targets cycling through them: only the first is top-1), random
    elsewhere; a masked tail on row 1; ids at 0 and V - 1 too.

    integer: small integers (hidden, weight) and halves (bias), so that every logit is exact in fp32 whatever the
    order of a matmul's sums (a tie is a tie in every implementation; the interpreter's tile dot, for one, gives
    duplicate columns different roundings otherwise) and exact in bf16 too; ties between random columns then occur
    as well. False: Gaussian values, for the float outputs only."""
    g = torch.Generator().manual_seed(seed)
    if integer:
        hidden = torch.randint(-2, 3, (B, T, H), generator=g).float()
        weight = torch.randint(-1, 2, (V, H), generator=g).float()
        bias = torch.randint(-2, 3, (V,), generator=g) * 0.5
    else:
        hidden = torch.randn(B, T, H, generator=g)
        weight = torch.randn(V, H, generator=g) * 0.6
        bias = torch.randn(V, generator=g) * 0.5
    for col in TIED[1:]:
        weight[col], bias[col] = weight[TIED[0]], bias[TIED[0]]
    noise = torch.randint(-1, 2, (T, H), generator=g) if integer else 0.1 * torch.randn(T, H, generator=g)
    hidden[0] = weight[TIED[0]] * (2 if integer else 4) + noise  # the tied columns hold the row max
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0] = torch.tensor([TIED[i % len(TIED)] for i in range(T)])
    ids[1, 0], ids[1, 1] = 0, V - 1
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, -2:] = False
    return [t.to(dtype) for t in (hidden, weight, bias)] + [ids, mask]


def _truths(hidden, weight, bias, ids, softcap=None):
    """(float64 truth, same-dtype reference) of the extras: the reference on exact logits, and on logits formed in
    the inputs' dtype (the middle term of the three-way rule)."""
    exact = hidden.double() @ weight.double().T + bias.double()
    naive = hidden @ weight.T + bias
    return token_extras(exact, ids, TEMPERATURE, softcap), token_extras(naive, ids, TEMPERATURE, softcap), exact


def _assert_no_near_ties(exact, softcap=None):
    """The case is fit for an exact is_top1 check: per row, the top value is either tied exactly (duplicate columns)
    or ahead of the next distinct value by far more than any rounding of the logits. Why 1e-3 relative: a logit here
    is a sum of H + 1 = 17 products of fp32 (or bf16, exact in fp32) values, off by at most gamma_17(fp32) ~ 1e-6
    relative to the sum of their magnitudes (a few times the top value), then scaled by 1 / T: more than 100 times
    below 1e-3, so no rounding can reorder the top two."""
    z = exact if softcap is None else softcap * torch.tanh(exact / softcap)
    z = z.reshape(-1, V)
    top = z.amax(-1, keepdim=True)
    next_distinct = torch.where(z < top, z, float("-inf")).amax(-1, keepdim=True)
    # bound: not a tolerance but a margin, 1e-3 relative: > 100 x gamma_17(fp32) ~ 1e-6 of the logits' sums (above)
    assert ((top - next_distinct) > 1e-3 * top.abs().clamp(min=1)).all()


def _check(out, truth, same, mask, dtype, what, names=EXTRA_OUTPUTS):
    for name, t, s in zip(EXTRA_OUTPUTS, truth, same):
        got = getattr(out, name)
        if name not in names:
            assert got is None, f"{what}: {name} not asked for"
            continue
        assert got.shape == mask.shape, what
        assert bool((got[~mask] == 0).all()), f"{what}: {name} not 0 / False at masked rows"
        if name == "is_top1":
            assert got.dtype == torch.bool and torch.equal(got[mask], t[mask]), f"{what}: is_top1"
        else:
            assert got.dtype == torch.float32, what
            assert_three_way(got[mask], s[mask], t[mask], dtype, f"{what} {name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("impl", IMPLS)
def test_extras_match_the_reference(impl, grad, dtype, plans):
    """All three extras, with a bias, a mask and exact ties; with gradients (head.torch / head.light) and without
    (head.torch / head.no_grad); the log-prob and entropy are unchanged by asking for the extras."""
    hidden, weight, bias, ids, mask = make_case(dtype)
    truth, same, exact = _truths(hidden, weight, bias, ids)
    _assert_no_near_ties(exact)
    h = hidden.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        out = gk.linear_token_logprobs(h, weight, ids, bias=bias, temperature=TEMPERATURE, return_entropy=True,
                                       impl=impl, mask=mask, extra_outputs=EXTRA_OUTPUTS)
        plain = gk.linear_token_logprobs(h, weight, ids, bias=bias, temperature=TEMPERATURE, return_entropy=True,
                                         impl=impl, mask=mask)
    assert [p.path for p in plans] == [{"torch": "head.torch", "triton": "head.light" if grad else
                                        "head.no_grad"}[impl]] * 2
    _check(out, truth, same, mask, dtype, f"{impl} grad={grad}")
    # the same sweep, with more statistics: the same log-probs and entropies, bit for bit
    assert torch.equal(out.logp, plain[0]) and torch.equal(out.entropy, plain[1])
    assert truth[2][0].tolist() == [i % len(TIED) == 0 for i in range(T)]  # the first tied column wins
    if grad:  # the extras are not differentiable; logp still is
        assert not any(getattr(out, n).requires_grad for n in EXTRA_OUTPUTS) and out.logp.requires_grad
        (g,) = torch.autograd.grad(out.logp.sum(), h)
        (g_plain,) = torch.autograd.grad(plain[0].sum(), h)
        assert torch.equal(g, g_plain)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("impl", IMPLS)
def test_every_subset_of_extras(impl, grad):
    """Each non-empty subset (the Triton kernels place each statistic by the flags that are on): only the outputs
    asked for, each equal to the same output computed with all three (two tokens of the tied row, two random)."""
    hidden, weight, bias, ids, mask = make_case()
    hidden, ids = hidden[:, :2].clone().requires_grad_(grad), ids[:, :2]
    with torch.set_grad_enabled(grad):
        full = gk.linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=TEMPERATURE, impl=impl,
                                        extra_outputs=EXTRA_OUTPUTS)
        assert full.entropy is None  # return_entropy=False
        for k in (1, 2):
            for names in itertools.combinations(EXTRA_OUTPUTS, k):
                out = gk.linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=TEMPERATURE, impl=impl,
                                               extra_outputs=names[::-1])
                for name in EXTRA_OUTPUTS:
                    got = getattr(out, name)
                    assert (got is None) == (name not in names), (names, name)
                    if got is not None:
                        assert torch.equal(got, getattr(full, name)), (impl, names, name)
    assert full.is_top1[0].tolist() == [True, False]  # TIED[0], TIED[1]


@pytest.mark.parametrize("softcap", [None, 2.5], ids=["plain", "softcap"])
@pytest.mark.parametrize("impl", IMPLS)
def test_float_extras_of_gaussian_logits(impl, softcap):
    """log sum p^2 and the mean logit of Gaussian (non-integer) logits, with and without a soft cap (the extras of
    the capped logits), with gradients."""
    hidden, weight, bias, ids, mask = make_case(integer=False)
    h = hidden.clone().requires_grad_(True)
    out = gk.linear_token_logprobs(h, weight, ids, bias=bias, temperature=TEMPERATURE, impl=impl, mask=mask,
                                   softcap=softcap, extra_outputs=EXTRA_OUTPUTS[:2])
    truth, same, _ = _truths(hidden, weight, bias, ids, softcap)
    for name, t, s in zip(EXTRA_OUTPUTS[:2], truth, same):
        assert_three_way(getattr(out, name)[mask], s[mask], t[mask], torch.float32, f"{impl} {softcap} {name}")


@pytest.mark.parametrize("impl", IMPLS)
def test_ties_the_soft_cap_makes(impl):
    """Logits far beyond the cap all become exactly ``softcap`` in fp32 (x / c >= 10: tanh rounds to 1 in every
    formula), so the first of them is the only top-1 whatever their raw order; without the cap the largest raw
    logit is."""
    cap = 0.25
    # raw logits 40, 30 (an earlier column), 50 at columns 9, 3, 20; 0 elsewhere; token rows target 3, 9, 20
    w = torch.zeros(V, H)
    w[9, 0], w[3, 0], w[20, 0] = 40.0, 30.0, 50.0
    x = torch.zeros(3, H)
    x[:, 0] = 1.0
    ids3 = torch.tensor([3, 9, 20])
    for grad in (True, False):
        h = x.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            capped = gk.linear_token_logprobs(h, w, ids3, softcap=cap, impl=impl, extra_outputs=("is_top1",))
            plain = gk.linear_token_logprobs(h, w, ids3, impl=impl, extra_outputs=("is_top1",))
        assert capped.is_top1.tolist() == [True, False, False] and plain.is_top1.tolist() == [False, False, True]


@pytest.mark.parametrize("impl", IMPLS)
def test_edges_one_token_non_finite_and_banned(impl):
    """T = 1; a NaN hidden row (log-prob, log sum p^2 and mean NaN there, is_top1 False, the other rows untouched);
    a -inf bias entry (a banned token: mean -inf, log sum p^2 finite); a row whose target is the banned one."""
    hidden, weight, bias, ids, mask = make_case()
    one = gk.linear_token_logprobs(hidden[:1, :1], weight, ids[:1, :1], bias=bias, impl=impl,
                                   extra_outputs=EXTRA_OUTPUTS)
    assert one.is_top1.shape == (1, 1)
    h = hidden.clone()
    h[1, 3] = float("nan")
    b = bias.clone()
    b[7] = float("-inf")
    ids = ids.clone()
    ids[1, 2] = 7
    out = gk.linear_token_logprobs(h, weight, ids, bias=b, temperature=TEMPERATURE, impl=impl,
                                   extra_outputs=EXTRA_OUTPUTS)
    truth = token_extras(h.double() @ weight.double().T + b.double(), ids, TEMPERATURE)
    same = token_extras(h @ weight.T + b, ids, TEMPERATURE)
    assert torch.isnan(out.log_sum_sq_probs[1, 3]) and torch.isnan(out.mean_logits[1, 3]) and not out.is_top1[1, 3]
    assert torch.isnan(out.logp[1, 3])
    finite = torch.ones(B, T, dtype=torch.bool)
    finite[1, 3] = False
    assert torch.isinf(out.mean_logits[finite]).all() and torch.isfinite(out.log_sum_sq_probs[finite]).all()
    assert torch.equal(out.is_top1, truth[2]) and not out.is_top1[1, 2]
    assert_three_way(out.log_sum_sq_probs[finite], same[0][finite], truth[0][finite], torch.float32,
                     f"{impl} log_sum_sq_probs with a banned token")


def test_compiled_extras_match_eager():
    """Under torch.compile (aot_eager, fullgraph): the registered op and its fake give eager's extras, with a mask
    (the op compacts the rows when it runs), and the log-prob's gradient. The torch impl: the op boundary is the
    same for every path (the Triton paths' kernels are checked above)."""
    hidden, weight, bias, ids, mask = make_case()

    def fn(hidden):
        out = gk.linear_token_logprobs(hidden, weight, ids, bias=bias, impl="torch", mask=mask,
                                       extra_outputs=("is_top1", "mean_logits"))
        return out.logp.sum(), out.is_top1, out.mean_logits

    runs = []
    for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
        h = hidden.clone().requires_grad_(True)
        total, top1, mean = f(h)
        (grad,) = torch.autograd.grad(total, h)
        runs.append((top1, mean, grad))
    (top1, mean, grad), (c_top1, c_mean, c_grad) = runs
    assert c_top1.dtype == torch.bool and torch.equal(c_top1, top1) and torch.equal(c_mean, mean)
    assert torch.equal(c_grad, grad)


def test_head_op_passes_opcheck_with_extras():
    """The registered op's schema, fake kernel and autograd with extras asked for (torch impl)."""
    from grpo_kernels import ops
    from grpo_kernels.config import LogitTransform, TokenExtras
    from grpo_kernels.head.light import LightOptions

    hidden, weight, bias, ids, mask = make_case()
    o = LightOptions("head.torch", LogitTransform(0.7, 3.0), True, 4, extras=TokenExtras(True, False, True))
    torch.library.opcheck(torch.ops.grpo_kernels.head_logprobs.default,
                          (hidden.reshape(-1, H).requires_grad_(True), weight.requires_grad_(True), bias,
                           ids.reshape(-1), mask.reshape(-1), *ops.encode(o)))
    assert ops.decode(LightOptions, *ops.encode(o)) == o


def test_bad_extra_outputs_are_refused():
    hidden, weight, bias, ids, mask = make_case()
    for bad, message in ((("entropy",), "unknown output 'entropy'"), ("is_top1", "must be a tuple"),
                         (("is_top1", "is_top1"), "more than once")):
        with pytest.raises(ValueError, match=f"extra_outputs.*{message}|{message}"):
            gk.linear_token_logprobs(hidden, weight, ids, extra_outputs=bad)
    with pytest.raises(ValueError, match="extra_outputs is not supported with process_group"):
        gk.linear_token_logprobs(hidden, weight, ids, process_group=object(), extra_outputs=("is_top1",))
    # no extras: the return forms are unchanged
    assert isinstance(gk.linear_token_logprobs(hidden, weight, ids, extra_outputs=()), torch.Tensor)
