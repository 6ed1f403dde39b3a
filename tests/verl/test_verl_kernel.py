"""grpo_kernels.verl's ``linear_cross_entropy`` at verl's seam, with the checks of verl's own
tests/utils/test_linear_cross_entropy.py at small shapes (CPU), and against verl's Triton kernel where CUDA is there.

verl's checks, kept: bf16 inputs drawn uniform(-0.5, 0.5), temperature 1.5, random output gradients (entropy
uniform(-0.5, 0.5), log-probs uniform(-1, 1)), log-probs / entropy / d hidden / d weight against a torch reference
(``run_torch_entropy``: fp32 logits), verl's ``logprobs_from_logits`` / ``entropy_from_logits`` on fp32 logits and its
torch fused backend ``FusedLinearForPPO`` on fp32 inputs; verl's vocabulary-padding regression construction (one
logit +3, all others -15: a peaked softmax where phantom padding mass shows) at a vocabulary that is and one that is
not a multiple of its 1024 tile. Their fixed tolerances are replaced by the three-way rule of tests/support/
tolerances.py against float64 truth on the same rounded inputs, each verl computation taken in turn as the middle
term (ours may not be much less accurate than any of them). Added: all-negative logits (every logit far below 0,
where verl's epilogue starts its running maximum at 0), ``reduction`` sum / mean, the no-grad path, the Triton
interpreter, argument errors, and the patch itself (what it swaps, that ``unpatch`` restores verl's object).
"""
from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy
from ..support.verl_env import CUDA_SKIP_REASON, require_verl

require_verl()
import verl.utils.kernel.linear_cross_entropy as verl_lce  # noqa: E402
import verl.utils.torch_functional as verl_F  # noqa: E402
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402

import grpo_kernels.verl as gk_verl  # noqa: E402  (patches verl on import)
from grpo_kernels.integrations import verl as integration  # noqa: E402

VERL_KERNEL = verl_lce.LinearCrossEntropy.apply  # verl's own kernel, whatever the module attribute holds now
TEMPERATURE = 1.5  # verl's test's
# verl's test shapes (batch 1): (num_tokens, hidden_size, vocab_size), used on CUDA only
VERL_SHAPES = [(1937, 3584, 152064), (2169, 896, 151936), (1530, 2048, 32256), (1388, 4096, 102400),
               (8192, 4096, 102400)]


@pytest.fixture(autouse=True)
def patched():
    """Every test starts and ends patched (the state importing grpo_kernels.verl leaves)."""
    gk_verl.patch()
    yield
    gk_verl.patch()


def verl_inputs(n, h, v, dtype, seed=0, layout="1NH"):
    """verl's test's inputs at (n, h, v): hidden / weight uniform(-0.5, 0.5) leaves, labels, output gradients."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.empty(n, h, dtype=torch.float32).uniform_(-0.5, 0.5, generator=g).to(dtype)
    weight = torch.empty(v, h, dtype=torch.float32).uniform_(-0.5, 0.5, generator=g).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    g_entropy = torch.empty(n).uniform_(-0.5, 0.5, generator=g).to(dtype)
    g_logprobs = torch.empty(n).uniform_(-1, 1, generator=g).to(dtype)
    shape = {"1NH": (1, n, h), "N1H": (n, 1, h), "NH": (n, h)}[layout]
    return hidden.reshape(shape), weight, labels.reshape(shape[:-1]), g_entropy, g_logprobs


def run(fn, hidden, weight, labels, g_entropy, g_logprobs, cast=None):
    """(log-probs (N,), entropy (N,), d hidden, d weight) of ``fn(hidden, weight, labels)`` with verl's test's
    backward (``autograd.grad((entropy, logprobs), (hidden, weight), (g_entropy, g_logprobs))``). ``cast``: the dtype
    ``fn`` computes in (the leaves stay in theirs, as verl's references upcast bf16 leaves to fp32)."""
    h = hidden.detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    hc, wc = (h, w) if cast is None else (h.to(cast), w.to(cast))
    logp, entropy = fn(hc, wc, labels)
    logp, entropy = logp.reshape(-1), entropy.reshape(-1)
    dh, dw = torch.autograd.grad((entropy, logp), (h, w), (g_entropy.to(entropy.dtype), g_logprobs.to(logp.dtype)))
    return logp.detach(), entropy.detach(), dh, dw


def torch_entropy(hidden, weight, labels, temperature=TEMPERATURE):
    """verl's test's ``run_torch_entropy`` / the project's reference: full logits in the inputs' dtype (fp32, fp64)."""
    from grpo_kernels.reference import logprobs_and_entropy

    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T
    return logprobs_and_entropy(logits, labels.reshape(-1), temperature)


def naive_same_dtype(hidden, weight, labels, temperature=TEMPERATURE):
    """Plain PyTorch in the inputs' own dtype: logits, log-softmax and entropy all in it (the rule's middle term)."""
    return naive_logprobs_entropy(hidden.reshape(-1, hidden.shape[-1]) @ weight.T, labels.reshape(-1), temperature)


def verl_original(hidden, weight, labels, temperature=TEMPERATURE):
    """verl's test's ``run_verl_original_entropy``: verl_F's log-probs and entropy of fp32 logits."""
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T / temperature
    return verl_F.logprobs_from_logits(logits, labels.reshape(-1), inplace_backward=False), \
        verl_F.entropy_from_logits(logits)


def verl_torch_fused(hidden, weight, labels, temperature=TEMPERATURE):
    """verl's torch fused backend (``FusedLinearForPPO``, the FSDP engine's default impl_backend)."""
    return FusedLinearForPPO()(hidden, weight, labels, temperature=temperature)


def ours(hidden, weight, labels, temperature=TEMPERATURE, reduction="none"):
    """The name verl's model forwards call, as they call it (positional, reduction "none")."""
    return verl_lce.linear_cross_entropy(hidden, weight, labels, temperature, reduction)


def assert_all_three_way(got, middles: dict, truth, dtype, what):
    """The three-way rule for each output (logp, entropy, dh, dw) with each middle term in turn."""
    names = ("log_probs", "entropy", "d hidden", "d weight")
    for k, name in enumerate(names):
        scale = grad_scale(truth[k]) if k >= 2 else None
        for middle_name, middle in middles.items():
            assert_three_way(got[k], middle[k], truth[k], dtype, f"{what}: {name} (middle term: {middle_name})",
                             scale=scale)


def truth_and_middles(hidden, weight, labels, g_entropy, g_logprobs):
    """float64 truth and the middle terms: plain PyTorch in the inputs' dtype, and verl's references as its test
    runs them (fp32 logits of the same inputs, fp32 FusedLinearForPPO)."""
    args = (hidden, weight, labels, g_entropy, g_logprobs)
    truth = run(torch_entropy, *args, cast=torch.float64)
    middles = {"plain torch in the inputs' dtype": run(naive_same_dtype, *args),
               "verl's run_torch_entropy (fp32)": run(torch_entropy, *args, cast=torch.float32),
               "verl_F on fp32 logits": run(verl_original, *args, cast=torch.float32),
               "FusedLinearForPPO (fp32)": run(verl_torch_fused, *args, cast=torch.float32)}
    return truth, middles


# ------------------------------------------------------------------------------------------------------- the patch

def test_import_patches_the_seam_and_unpatch_restores_verls_object():
    assert verl_lce.linear_cross_entropy is integration.linear_cross_entropy
    assert gk_verl.is_verl_patched()
    report = gk_verl.patch()
    assert not report.newly_patched and report.patched == (f"{integration.SEAM_MODULE}.linear_cross_entropy",)
    assert "verl 0.9.1" in str(report) and "Megatron fused forward (TP vocab shards)" in str(report)
    gk_verl.unpatch()
    assert verl_lce.linear_cross_entropy == VERL_KERNEL  # verl's bound LinearCrossEntropy.apply
    assert not gk_verl.is_verl_patched()
    gk_verl.unpatch()  # a no-op when not patched
    assert gk_verl.patch().newly_patched and verl_lce.linear_cross_entropy is integration.linear_cross_entropy


def test_unpatch_gives_back_the_exact_object_verl_had():
    gk_verl.unpatch()
    original = verl_lce.linear_cross_entropy
    gk_verl.patch()
    gk_verl.unpatch()
    assert verl_lce.linear_cross_entropy is original


def test_names_bound_at_import_are_swapped_both_ways():
    """A module that did ``from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`` at its import
    (as Megatron's model_forward_fused and model_forward_1f1b_overlap do): imported before the patch, it is swapped
    and restored; imported while patched, it binds ours and gets verl's back on unpatch."""
    source = "from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy\n"

    def load(name):
        module = types.ModuleType(name)
        sys.modules[name] = module
        exec(source, module.__dict__)
        return module

    gk_verl.unpatch()
    original = verl_lce.linear_cross_entropy
    try:
        before = load("verl._bound_before_patch")
        report = gk_verl.patch()
        assert "verl._bound_before_patch.linear_cross_entropy" in report.patched
        assert before.linear_cross_entropy is integration.linear_cross_entropy
        after = load("verl._bound_while_patched")
        assert after.linear_cross_entropy is integration.linear_cross_entropy
        gk_verl.unpatch()
        assert before.linear_cross_entropy is original and after.linear_cross_entropy is original
    finally:
        sys.modules.pop("verl._bound_before_patch", None)
        sys.modules.pop("verl._bound_while_patched", None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on CUDA verl's kernel runs instead of refusing CPU tensors")
def test_after_unpatch_calls_reach_verls_kernel():
    """verl's kernel is back: it cannot run on this machine (CPU torch has no NVTX, its first call; a CUDA build
    without a GPU fails its ``assert hidden.is_cuda``), where ours computes."""
    hidden, weight, labels, _, _ = verl_inputs(4, 8, 11, torch.float32)
    ours(hidden, weight, labels)
    gk_verl.unpatch()
    with pytest.raises((RuntimeError, AssertionError)) as failure:
        verl_lce.linear_cross_entropy(hidden, weight, labels, TEMPERATURE, "none")
    assert any(str(entry.path).endswith("verl/utils/kernel/linear_cross_entropy.py") for entry in failure.traceback)


def test_unsupported_verl_version_is_refused(monkeypatch):
    gk_verl.unpatch()
    monkeypatch.setattr(integration, "_verl_version", lambda: "0.8.3")
    with pytest.raises(RuntimeError, match="supports verl 0.9.x, found verl 0.8.3; nothing was patched"):
        gk_verl.patch()
    assert not gk_verl.is_verl_patched() and verl_lce.linear_cross_entropy is not integration.linear_cross_entropy


# ------------------------------------------------------------------------------------- verl's checks, small shapes

@pytest.mark.parametrize("layout", ["1NH", "NH", "N1H"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("vocab", [1000, 1025], ids=["V1000", "V1025"])
def test_verify_correctness_small(vocab, dtype, layout):
    """verl's ``verify_correctness`` at N = 37, H = 24 (not a multiple of 128, which verl's kernel requires), V not a
    multiple of its tiles; ours matches its shapes: (N,) float32 log-probs and entropy, d hidden shaped like hidden."""
    hidden, weight, labels, g_entropy, g_logprobs = verl_inputs(37, 24, vocab, dtype, layout=layout)
    got = run(ours, hidden, weight, labels, g_entropy, g_logprobs)
    assert got[0].shape == got[1].shape == (37,) and got[0].dtype == got[1].dtype == torch.float32
    assert got[2].shape == hidden.shape and got[2].dtype == dtype and got[3].dtype == dtype
    truth, middles = truth_and_middles(hidden, weight, labels, g_entropy, g_logprobs)
    assert_all_three_way(got, middles, truth, dtype, f"V={vocab} {dtype} {layout}")


@pytest.mark.parametrize("vocab", [1536, 1024, 1015], ids=["V1536-mod1024=512", "V1024-divisible", "V1015"])
def test_non_divisible_vocab_padding(vocab):
    """verl's padding regression construction (bf16, N = 16, D = 8, T = 1.5): logit +3 for id 0, -15 for every other
    id, labels 0. A phantom exp(0) per padded tile entry would add ~e^-3 of the target's mass per entry here.
    V = 1015 is 129920 / 128, the vocabulary of the report that found verl's padding fault, scaled down."""
    n, d = 16, 8
    w = torch.zeros(vocab, d, dtype=torch.bfloat16)
    w[:, 0] = -15.0 * TEMPERATURE
    w[0, 0] = 3.0 * TEMPERATURE
    h = torch.zeros(1, n, d, dtype=torch.bfloat16)
    h[:, :, 0] = 1.0
    labels = torch.zeros(1, n, dtype=torch.long)
    g_entropy, g_logprobs = torch.full((n,), 0.25, dtype=torch.bfloat16), torch.full((n,), -0.5, dtype=torch.bfloat16)
    got = run(ours, h, w, labels, g_entropy, g_logprobs)
    truth, middles = truth_and_middles(h, w, labels, g_entropy, g_logprobs)
    assert_all_three_way(got, middles, truth, torch.bfloat16, f"padding V={vocab}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_all_negative_logits_entropy(dtype):
    """Every logit in [-300, -200] (temperature 1): softmax is shift-invariant, so log-probs and entropy are those of
    logits in [-100, 0]. verl's forward epilogue starts its running maximum at 0, where exp(-200) underflows fp32 to 0
    (its accumulated sum 0, log 0 = -inf); ours takes the maximum over the logits themselves."""
    n, d, v = 12, 4, 321
    g = torch.Generator().manual_seed(1)
    w = torch.zeros(v, d)
    w[:, 0] = -200.0 - 100.0 * torch.rand(v, generator=g)
    w[:, 1] = torch.randn(v, generator=g)
    h = torch.zeros(1, n, d)
    h[:, :, 0] = 1.0
    h[:, :, 1] = 0.1 * torch.randn(n, generator=g)
    hidden, weight = h.to(dtype), w.to(dtype)
    labels = torch.randint(0, v, (1, n), generator=g)
    g_entropy, g_logprobs = torch.full((n,), 0.3, dtype=dtype), torch.full((n,), -1.0, dtype=dtype)
    got = run(lambda *a: ours(*a, temperature=1.0), hidden, weight, labels, g_entropy, g_logprobs)
    args = (hidden, weight, labels, g_entropy, g_logprobs)
    truth = run(lambda *a: torch_entropy(*a, temperature=1.0), *args, cast=torch.float64)
    middle = run(lambda *a: naive_same_dtype(*a, temperature=1.0), *args)
    # bound: not a tolerance: an entropy above 0.5 nats means no single token holds the mass (the case is not
    # degenerate), whatever the rounding
    assert truth[1].min() > 0.5
    assert_all_three_way(got, {"plain torch in the inputs' dtype": middle}, truth, dtype, "all-negative logits")


# --------------------------------------------------------------------------------------- reductions, paths, errors

@pytest.mark.parametrize("reduction", ["sum", "mean", "SUM", "Mean"])
def test_reduction_sum_and_mean_as_verls_kernel(reduction):
    """verl's kernel: "sum" / "mean" return the log-probs' sum / mean over the N tokens as a 0-dim tensor and the
    per-token entropy unchanged; the backward takes a scalar log-prob gradient. Exact: the same per-token values,
    then one torch sum (a mean divides it by N, as verl's kernel does)."""
    hidden, weight, labels, g_entropy, _ = verl_inputs(9, 16, 50, torch.float32)
    h1, h2 = hidden.clone().requires_grad_(True), hidden.clone().requires_grad_(True)
    logp, entropy = ours(h1, weight, labels)
    total, entropy_r = ours(h2, weight, labels, reduction=reduction)
    expected = logp.sum() if reduction.lower() == "sum" else logp.sum() / logp.numel()
    assert total.dim() == 0 and torch.equal(total, expected) and torch.equal(entropy_r, entropy)
    g = torch.tensor(0.7)
    per_token = g if reduction.lower() == "sum" else g / logp.numel()
    (d1,) = torch.autograd.grad((entropy, logp), h1, (g_entropy, per_token.expand(logp.shape)))
    (d2,) = torch.autograd.grad((entropy_r, total), h2, (g_entropy, g))
    # the same per-token gradients through the same backward; a mean's 0.7 / 9 is rounded once in both
    torch.testing.assert_close(d2, d1, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_no_grad_path_for_old_and_reference_logprobs(plans, monkeypatch, impl):
    """verl's old / reference log-probs run under no_grad: one sweep (2 N H V FLOPs, no recompute), on the Triton
    path (CUDA; the interpreter here) the ``head.no_grad`` path; the same numbers."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", impl)
    hidden, weight, labels, g_entropy, g_logprobs = verl_inputs(21, 16, 257, torch.bfloat16)
    with torch.no_grad():
        logp, entropy = ours(hidden, weight, labels)
    assert plans[-1].flops_nhv == 2 and not logp.requires_grad
    assert plans[-1].path == ("head.no_grad" if impl == "triton" else "head.torch")
    truth, middles = truth_and_middles(hidden, weight, labels, g_entropy, g_logprobs)
    middle = middles["plain torch in the inputs' dtype"]
    assert_three_way(logp, middle[0], truth[0], torch.bfloat16, "no-grad log_probs")
    assert_three_way(entropy, middle[1], truth[1], torch.bfloat16, "no-grad entropy")


@pytest.mark.interpreter
def test_triton_kernels_under_the_interpreter(monkeypatch):
    """The seam on grpo_kernels' Triton kernels (the CUDA path), run by the interpreter on CPU at a tiny shape."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    hidden, weight, labels, g_entropy, g_logprobs = verl_inputs(6, 16, 37, torch.float32)
    got = run(ours, hidden, weight, labels, g_entropy, g_logprobs)
    truth, middles = truth_and_middles(hidden, weight, labels, g_entropy, g_logprobs)
    assert_all_three_way(got, {"plain torch in fp32": middles["plain torch in the inputs' dtype"]}, truth,
                         torch.float32, "interpreter")


def test_non_finite_hidden_propagates_to_its_row_only():
    """A NaN in one row of hidden gives that row NaN log-prob and entropy (not an error, not a silent number); the
    other rows are unchanged, bit for bit (each row's values depend on its own hidden state only)."""
    hidden, weight, labels, _, _ = verl_inputs(6, 8, 40, torch.float32)
    clean = ours(hidden, weight, labels)
    poisoned = hidden.clone()
    poisoned[0, 2, 3] = float("nan")
    logp, entropy = ours(poisoned, weight, labels)
    assert torch.isnan(logp[2]) and torch.isnan(entropy[2])
    keep = torch.arange(6) != 2
    assert torch.equal(logp[keep], clean[0][keep]) and torch.equal(entropy[keep], clean[1][keep])


@pytest.mark.parametrize("call,match", [
    (lambda h, w, y: ours(h, w, y, reduction="max"), r"reduction must be one of \('none', 'sum', 'mean'\)"),
    (lambda h, w, y: ours(h, w, y, reduction=None), "reduction must be one of"),
    (lambda h, w, y: ours(h, w, y, temperature="1.0"), "temperature must be a float"),
    (lambda h, w, y: ours(h, w, y, temperature=True), "temperature must be a float"),
    (lambda h, w, y: ours(h, w, y, temperature=0.0), "temperature"),
    (lambda h, w, y: ours(h, w, y[:, :-1]), "labels must hold one id per row of hidden: 5 rows"),
    (lambda h, w, y: ours(h[0, 0], w, y), "hidden must have shape"),
    (lambda h, w, y: ours(h, w, y + 11), r"ids"),
    (lambda h, w, y: ours(h, w.double(), y), "weight dtype"),
    (lambda h, w, y: verl_lce.linear_cross_entropy(h, w, y, 1.0, "none", object()), "process_group"),
], ids=["reduction-max", "reduction-None", "temperature-str", "temperature-bool", "temperature-0", "labels-count",
        "hidden-1d", "labels-out-of-range", "weight-dtype", "group-not-a-group"])
def test_bad_arguments_raise_value_errors(call, match):
    hidden, weight, labels, _, _ = verl_inputs(5, 8, 11, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(hidden, weight, labels)


# ------------------------------------------------------------------------------------- against verl's own kernel

def _timed(fn, *args):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn(*args)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - start) * 1e3


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)
@pytest.mark.parametrize("shape", VERL_SHAPES, ids=[f"N{n}-H{h}-V{v}" for n, h, v in VERL_SHAPES])
def test_against_verls_kernel_at_its_shapes_cuda(shape):
    """verl's test's shapes and inputs (bf16), on CUDA: ours and verl's Triton kernel against float64 truth of the
    log-probs and entropy (ours may not be much less accurate than verl's kernel: the three-way rule with verl's
    kernel as the middle term), and the forward + backward times of both, printed (the last of 3 runs)."""
    n, h, v = shape
    hidden, weight, labels, g_entropy, g_logprobs = (t.cuda() for t in verl_inputs(n, h, v, torch.bfloat16))
    times = {}
    for name, fn in (("grpo_kernels", ours), ("verl", lambda *a: VERL_KERNEL(*a, TEMPERATURE))):
        for _ in range(3):
            hh, ww = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
            (logp, entropy), fwd = _timed(fn, hh, ww, labels)
            _, bwd = _timed(lambda: torch.autograd.grad((entropy, logp), (hh, ww), (g_entropy, g_logprobs.float())))
        times[name] = (fwd, bwd, logp.detach(), entropy.detach())
    with torch.no_grad():
        rows = slice(0, 256)  # the float64 truth of 256 rows (an N x V float64 logits tensor would not fit)
        truth = torch_entropy(hidden[:, rows].double(), weight.double(), labels[:, rows])
    for k, what in ((2, "log_probs"), (3, "entropy")):
        assert_three_way(times["grpo_kernels"][k][rows], times["verl"][k][rows], truth[k - 2], torch.bfloat16,
                         f"{shape} {what} (middle term: verl's kernel)")
    print(f"\n[verl shape N={n} H={h} V={v}] forward / backward ms: grpo_kernels "
          f"{times['grpo_kernels'][0]:.2f} / {times['grpo_kernels'][1]:.2f}, verl {times['verl'][0]:.2f} / "
          f"{times['verl'][1]:.2f}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason=CUDA_SKIP_REASON)
def test_all_negative_logits_against_verls_kernel_cuda():
    """On CUDA: the all-negative construction through verl's kernel and ours (H = 128, verl's kernel's multiple);
    ours may not be much less accurate than verl's (the three-way rule), and it is finite."""
    n, d, v = 64, 128, 4096
    g = torch.Generator().manual_seed(1)
    w = torch.zeros(v, d)
    w[:, 0] = -200.0 - 100.0 * torch.rand(v, generator=g)
    h = torch.zeros(1, n, d)
    h[:, :, 0] = 1.0
    labels = torch.randint(0, v, (1, n), generator=g).cuda()
    hidden, weight = h.cuda().to(torch.bfloat16), w.cuda().to(torch.bfloat16)
    truth = torch_entropy(hidden.double(), weight.double(), labels, temperature=1.0)
    mine = ours(hidden, weight, labels, temperature=1.0)
    theirs = VERL_KERNEL(hidden, weight, labels, 1.0)
    errors = [(out[1].double() - truth[1]).abs().nan_to_num(float("inf")).max().item() for out in (mine, theirs)]
    print(f"\n[all-negative logits] max entropy error: grpo_kernels {errors[0]:.3e}, verl {errors[1]:.3e}")
    for k, what in ((0, "log_probs"), (1, "entropy")):
        assert torch.isfinite(mine[k]).all(), what
        middle = torch.nan_to_num(theirs[k], nan=float("inf"))
        assert_three_way(mine[k], middle, truth[k], torch.bfloat16, f"all-negative {what} (middle term: verl's kernel)")


# ------------------------------------------------------------------------------------------- batch invariance

@pytest.mark.parametrize("how", ["argument", "environment"])
def test_batch_invariant_reaches_every_seam_call(how, monkeypatch, knobs):
    """patch_verl(batch_invariant=True), or GRPO_KERNELS_BATCH_INVARIANT=1 as a verl worker's environment gives it:
    a sequence's log-probs, entropy and d hidden at verl's seam are bitwise the same alone and packed after others
    ((1, total_nnz, H), verl's layout); the default leaves them batch-dependent in general (no assertion on that)."""
    knobs(invariant_rows=8)  # blocks of 8 rows: the packed micro-batch below crosses their edges
    if how == "environment":
        monkeypatch.setenv(integration.BATCH_INVARIANT_ENV, "1")
        integration.patch_verl()
    else:
        integration.patch_verl(batch_invariant=True)
    try:
        g = torch.Generator().manual_seed(5)
        weight = torch.randn(61, 16, generator=g) / 2
        probe, others = torch.randn(1, 7, 16, generator=g), torch.randn(1, 12, 16, generator=g)
        labels = torch.randint(0, 61, (1, 19), generator=g)
        results = []
        for hidden, lab in ((probe, labels[:, 12:]), (torch.cat([others, probe], 1), labels)):
            x = hidden.clone().requires_grad_(True)
            logp, ent = ours(x, weight, lab)
            (logp.sum() + 0.5 * ent.sum()).backward()
            results.append((logp.reshape(-1)[-7:], ent.reshape(-1)[-7:], x.grad.reshape(-1, 16)[-7:]))
        for a, b in zip(*results):
            assert torch.equal(a, b)
    finally:
        integration.patch_verl(batch_invariant=False)
