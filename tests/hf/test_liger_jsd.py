"""``grpo_kernels.liger``'s JSD entry points against Liger-Kernel 0.8.5 itself (issue 40, item 4): Liger's own tests
(fetched unmodified from its source archive on PyPI by scripts/setup_liger_tests.sh; without them these runs skip,
naming that command) pass with Liger's names bound to ours, every failure a documented deviation
(``EXPECTED_FAILURES``, docs/api.md "Coming from Liger-Kernel"); the signatures, defaults and return types are Liger's;
bad options are ValueErrors naming the argument. The numbers against float64: test_liger_jsd_numerics.py.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from tests.support import liger_upstream as up

pytest.importorskip("liger_kernel.chunked_loss.jsd_loss", reason="needs liger-kernel (test extra)")
import liger_kernel.chunked_loss as liger_chunked  # noqa: E402
import liger_kernel.chunked_loss.jsd_loss as liger_jsd_loss  # noqa: E402
import liger_kernel.transformers as liger_transformers  # noqa: E402
import liger_kernel.transformers.functional as liger_functional  # noqa: E402

from grpo_kernels import liger as ours  # noqa: E402

needs_ligers_tests = pytest.mark.skipif(not up.fetched(), reason=up.SKIP_REASON)


@needs_ligers_tests
def test_fetched_tests_are_liger_085():
    import importlib.metadata

    assert importlib.metadata.version("liger-kernel") == ours.LIGER_VERSION == up.LIGER_VERSION == "0.8.5"
    assert up.file_digests() == up.SHA256


def _check_run(run, found: dict, selection: list[str], expected_failures: dict):
    """Every selected test ran; exactly ``expected_failures`` failed, each with its message; only the CUDA-only
    test skipped, and only without CUDA, for Liger's reason; the calls reached ours."""
    tail = run.stdout[-4000:] + run.stderr[-2000:]
    missing = [n for n in selection if "::" in n and n not in found]
    assert not missing, f"not run: {missing}\n{tail}"
    failed = {n: m for n, (kind, m) in found.items() if kind in ("failed", "error")}
    assert set(failed) == set(expected_failures), f"failed: {sorted(failed)}\n{tail}"
    for node, (says, _why) in expected_failures.items():
        assert says in failed[node], f"{node} failed otherwise:\n{failed[node][-1500:]}"
    skipped = {n: m for n, (kind, m) in found.items() if kind == "skipped"}
    for node, message in skipped.items():
        assert up.CUDA_ONLY in node and not torch.cuda.is_available(), f"{node} skipped: {message}"
        assert "needs torch>=2.8 out_dtype support on CUDA" in message
    summary = up.SUMMARY.search(run.stdout)
    assert summary, tail
    return summary.group(2)


@needs_ligers_tests
def test_liger_jsd_tests_pass_on_ours(tmp_path):
    """One case of each of Liger's JSD tests (``FAST``; every case: the slow test below), on ours."""
    junit = tmp_path / "liger.xml"
    run = up.run_upstream(up.FAST, junit)
    expected = {n: v for n, v in up.EXPECTED_FAILURES.items() if n in up.FAST}
    calls = _check_run(run, up.outcomes(junit), up.FAST, expected)
    for name in ("LigerFusedLinearJSD", "liger_fused_linear_jsd", "LigerFusedLinearJSDLoss",
                 "chunked_liger_fused_linear_jsd"):
        assert f"{name} " in calls and f"{name} 0" not in calls, calls


@pytest.mark.slow  # Liger's 132 JSD cases, at its shapes (up to 1024 tokens x V 4096): ~4 min on 2 cores
@needs_ligers_tests
def test_every_liger_jsd_test_on_ours(tmp_path):
    junit = tmp_path / "liger.xml"
    run = up.run_upstream([up.FUSED, up.CHUNKED], junit, timeout=1800)
    found = up.outcomes(junit)
    assert len(found) == 132, run.stdout[-3000:]
    _check_run(run, found, [], up.EXPECTED_FAILURES)


# Liger's fp32 correctness cases with beta != 0.5 in the fast selection: where reading beta the other way changes the
# divergence (at 0.5 the generalized JSD is symmetric; every token ignored gives 0 either way). Liger's bf16 cases do
# not catch it: with its torch.rand inputs both models' distributions are close and its bf16 tolerances loose.
FLIPPED_BETA_FAILURES = {
    f"{up.FUSED}::test_correctness[2.0-0.1-1.0-dtype1-1e-05-0.0005-4-423-167-1423]": ("Mismatch", "beta 0.1 vs 0.9"),
    f"{up.FUSED}::test_correctness_with_ignore_index[1.0-1.0-2-1.0-dtype1-1e-05-0.0005-4-423-167-1423]":
        ("Mismatch", "reverse vs forward KL"),
    f"{up.FUSED}::test_correctness_functional[accum_dtype1-2.0-0.1-42-0.5-dtype1-1e-05-0.0005-9-7-41-41]":
        ("Mismatch", "beta 0.1 vs 0.9 against Liger's own Function"),
    f"{up.CHUNKED}::test_correctness[42-2.0-0.0-1.0-0.8-True-1.0-dtype1-1e-05-0.0005-3-47-31-123]":
        ("Mismatch", "beta 0.8 vs 0.2"),
}


@pytest.mark.slow  # the fast selection once more, in a subprocess: ~35 s on 2 cores
@needs_ligers_tests
def test_liger_jsd_tests_fail_with_beta_read_backwards(tmp_path):
    """Liger's tests can fail on ours, and they pin the beta convention: with ``1 - beta`` (the plugin's knob) the
    cases that make beta matter fail."""
    junit = tmp_path / "liger.xml"
    run = up.run_upstream(up.FAST, junit, flip_beta=True)
    expected = {n: v for n, v in up.EXPECTED_FAILURES.items() if n in up.FAST} | FLIPPED_BETA_FAILURES
    calls = _check_run(run, up.outcomes(junit), up.FAST, expected)
    assert calls.endswith("(beta flipped)"), calls


# ------------------------------------------------------------------------------------------- the drop-in contract

def _params(fn, *, skip=0):
    """(name, default, kind) of each parameter but the keyword-only ones (grpo_kernels' additions)."""
    params = list(inspect.signature(fn).parameters.values())[skip:]
    return [(p.name, p.default, p.kind) for p in params if p.kind != p.KEYWORD_ONLY]


def _extras(fn):
    return [p.name for p in inspect.signature(fn).parameters.values() if p.kind == p.KEYWORD_ONLY]


@pytest.mark.parametrize("ours_fn, liger_fn", [
    (ours.LigerFusedLinearJSD.__init__, liger_transformers.LigerFusedLinearJSD.__init__),
    (ours.LigerFusedLinearJSD.forward, liger_transformers.LigerFusedLinearJSD.forward),
    (ours.liger_fused_linear_jsd, liger_functional.liger_fused_linear_jsd),
    (ours.LigerFusedLinearJSDLoss.__init__, liger_chunked.LigerFusedLinearJSDLoss.__init__),
    (ours.LigerFusedLinearJSDLoss.forward, liger_chunked.LigerFusedLinearJSDLoss.forward),
], ids=["fused-init", "fused-forward", "fused-function", "chunked-init", "chunked-forward"])
def test_signatures_are_ligers(ours_fn, liger_fn):
    assert _params(ours_fn) == _params(liger_fn)
    assert set(_extras(ours_fn)) <= {"round_logits", "batch_invariant", "impl"}


def test_chunked_function_takes_ligers_positional_arguments():
    """``chunked_liger_fused_linear_jsd`` is Liger's chunked ``liger_fused_linear_jsd`` (its Function's ``apply``):
    the same parameters in the same order, Liger's defaults (the two biases, required there, default to None)."""
    liger = _params(liger_jsd_loss.LigerFusedLinearJSDFunction.forward, skip=1)  # ctx (forward is a classmethod)
    mine = _params(ours.chunked_liger_fused_linear_jsd)
    assert [p[0] for p in mine] == [p[0] for p in liger]
    for (name, default, _), (_, liger_default, _) in zip(mine, liger):
        want = None if name in ("student_bias", "teacher_bias") else liger_default
        assert default == want, name


def _inputs(dtype=torch.float32, n=6, hs=8, ht=12, v=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, hs, generator=g, dtype=dtype).requires_grad_(True),
            torch.randn(v, hs, generator=g, dtype=dtype).requires_grad_(True),
            torch.randn(n, ht, generator=g, dtype=dtype), torch.randn(v, ht, generator=g, dtype=dtype),
            torch.randint(0, v, (n,), generator=g))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_return_types_are_ligers(dtype):
    """0-dim fp32 losses (Liger's accumulators are fp32), gradients in the inputs' dtypes, none to the teacher."""
    si, sw, ti, tw, labels = _inputs(dtype)
    tw.requires_grad_(True)
    for out in (ours.LigerFusedLinearJSD()(si, sw, ti, tw, labels), ours.liger_fused_linear_jsd(si, sw, ti, tw),
                ours.LigerFusedLinearJSDLoss()(si, sw, ti, tw, labels)):
        assert out.shape == () and out.dtype == torch.float32
        gs, gw, gt = torch.autograd.grad(out, (si, sw, tw), allow_unused=True)
        assert gs.dtype == gw.dtype == dtype and gt is None
    parts = ours.LigerFusedLinearJSDLoss(return_soft_hard_loss=True)(si, sw, ti, tw, labels)
    assert isinstance(parts, tuple) and len(parts) == 3
    assert all(t.shape == () and t.dtype == torch.float32 for t in parts)


def test_options_are_attributes_read_at_forward():
    """As Liger's modules: the constructor's options are attributes, and a change is seen by the next forward."""
    si, sw, ti, tw, labels = _inputs()
    fused = ours.LigerFusedLinearJSD(jsd_beta=0.5)
    fused.jsd_beta = 0.0
    assert torch.equal(fused(si, sw, ti, tw, labels), ours.liger_fused_linear_jsd(si, sw, ti, tw, labels, 0.0))
    chunked = ours.LigerFusedLinearJSDLoss()
    chunked.return_soft_hard_loss = True
    assert len(chunked(si, sw, ti, tw, labels)) == 3


@pytest.mark.parametrize("make, name", [
    (lambda: ours.LigerFusedLinearJSD(jsd_beta=1.5), "jsd_beta"),
    (lambda: ours.LigerFusedLinearJSD(temperature=0.0), "temperature"),
    (lambda: ours.LigerFusedLinearJSD(temperature=-1.0), "temperature"),
    (lambda: ours.LigerFusedLinearJSD(ignore_index=1.5), "ignore_index"),
    (lambda: ours.LigerFusedLinearJSD(accum_dtype=torch.int32), "accum_dtype"),
    (lambda: ours.LigerFusedLinearJSD(round_logits="fp8"), "round_logits"),
    (lambda: ours.LigerFusedLinearJSDLoss(beta=-0.1), "beta"),
    (lambda: ours.LigerFusedLinearJSDLoss(weight_hard_loss=float("nan")), "weight_hard_loss"),
    (lambda: ours.LigerFusedLinearJSDLoss(weight_soft_loss="1"), "weight_soft_loss"),
    (lambda: ours.LigerFusedLinearJSDLoss(temperature=0.0), "temperature"),
])
def test_bad_options_name_the_argument(make, name):
    with pytest.raises(ValueError, match=name):
        make()


def test_bad_inputs_name_the_argument():
    si, sw, ti, tw, labels = _inputs()
    with pytest.raises(ValueError, match="shift_labels"):
        ours.liger_fused_linear_jsd(si, sw, ti, tw, labels[:-1])
    with pytest.raises(ValueError, match="true_labels"):
        ours.LigerFusedLinearJSDLoss()(si, sw, ti, tw, labels.float())
    with pytest.raises(ValueError, match="teacher_weight"):  # V mismatch (a smaller teacher vocabulary)
        ours.liger_fused_linear_jsd(si, sw, ti, tw[:-1], labels)
    with pytest.raises(ValueError, match="teacher_weight"):  # Liger pads only a smaller student vocabulary
        ours.LigerFusedLinearJSDLoss()(si, sw, ti, tw[:-1], labels)
    with pytest.raises(ValueError, match="student_weight"):
        ours.liger_fused_linear_jsd(si, sw[:, :-1], ti, tw, labels)
