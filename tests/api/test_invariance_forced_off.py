"""The invariance tests can fail (docs/contributing.md, "The forced-off check"): with the option forced off
(``GRPO_KERNELS_TEST_FORCE_VARIANT=1``, the ``force_variant`` knob: every call ignores ``batch_invariant=True`` and
runs the default paths, ``invariance.requested``), exactly the tests that credit the option fail, each on a number
(two arrangements, layouts or calls that differ) or, for the tests of the option's way into the plan, on the plan;
every other test of the invariance files passes (what the default paths give by construction, validation, the
checker's own test). One pytest run of those files' fast selection in a subprocess, under -m slow (CI's second
step).

What the failures rest on is this machine's arithmetic, two dependences and nothing else of it: its BLAS computing a
GEMM of one to three rows with other kernels than a larger GEMM, and torch splitting a one-row reduction of at least
32768 elements across two threads (tests/api/test_batch_invariance.py says where each enters). A row's place among
more than three rows changes no bits on some CPUs (MKL on AVX-512), so every invariance test that compares a head's
rows across calls runs a sequence of 1 to 3 tokens (or a single token) alone and in a batch, and the logits path's
test one-token calls of 40000 logits; the padded-vs-packed comparisons also see the default paths' plain sums, which
follow the layout (not the machine). Both dependences are probed first; where a probe finds no difference the check
is skipped, saying which.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import torch

from grpo_kernels._testing import FORCE_VARIANT_ENV

ROOT = Path(__file__).resolve().parents[2]
FILES = ("tests/api/test_batch_invariance.py", "tests/api/test_batch_invariance_entry_points.py",
         "tests/train/test_batch_invariant_training.py", "tests/distributed/test_dist_batch_invariance.py",
         "tests/distill/test_distill_batch_invariance.py")
TIMEOUT_S = 1800  # the run takes a few minutes on two cores; this bounds a hung subprocess
BI, EP = "tests/api/test_batch_invariance.py::", "tests/api/test_batch_invariance_entry_points.py::"
TRAIN, DIST = "tests/train/test_batch_invariant_training.py::", "tests/distributed/test_dist_batch_invariance.py::"
DISTILL = "tests/distill/test_distill_batch_invariance.py::"
LOSS_CASES = [f"{impl}-{fn}-{config}" for impl in ("torch", "triton") for fn in ("fused_linear_grpo_loss", "grpo_loss")
              for config in ("dapo-num-items", "gspo")]

# node id -> what it fails on with the option forced off: "numbers" (a message naming two results that differ) or
# "plan" (the plan is not the batch-invariant one)
EXPECTED_FAILURES = {
    BI + "test_a_token_alone_is_the_same_as_in_a_batch_on_the_torch_logits_path": "numbers",
    **{BI + f"test_linear_token_logprobs_and_trl_extras_are_batch_invariant[{case}]": "numbers"
       for case in ("torch-fp32", "torch-bf16", "torch-fp16", "triton-fp32")},
    # every loss case but triton-grpo_loss-dapo-num-items (LOSS_BY_CONSTRUCTION: it passes)
    **{BI + f"test_losses_are_batch_invariant_and_the_same_padded_or_packed[{case}]": "numbers"
       for case in LOSS_CASES if case != "triton-grpo_loss-dapo-num-items"},
    **{BI + f"test_the_losses_take_their_batch_invariant_paths[{case}]": "plan" for case in LOSS_CASES},
    # from the head only: from logits the ratio is exactly 1 by construction (those cases pass)
    **{BI + f"test_old_logps_without_gradients_give_a_ratio_of_exactly_one[{dtype}-fused_linear_grpo_loss-{config}]":
       "numbers" for dtype in ("torch-fp32", "torch-bf16", "torch-fp16", "triton-fp32")
       for config in ("dapo-num-items", "gspo")},
    # the caller's block (invariant_block_rows): the same tests with a block of 8 rows, and the option's reach
    **{BI + f"test_a_chosen_block_is_batch_invariant_at_its_size[{impl}]": "numbers" for impl in ("torch", "triton")},
    **{BI + f"test_a_chosen_block_gives_a_ratio_of_exactly_one[{impl}]": "numbers" for impl in ("torch", "triton")},
    EP + "test_explain_shows_the_chosen_block": "plan",
    EP + "test_patch_trl_passes_the_chosen_block_to_every_seam_call": "plan",
    EP + "test_modules_take_the_option[GRPOLoss]": "numbers",
    EP + "test_modules_take_the_option[FusedLinearGRPOLoss]": "numbers",
    EP + "test_explain_says_it": "plan",
    EP + "test_patch_trl_makes_every_seam_call_batch_invariant": "numbers",
    **{TRAIN + f"test_a_packed_step_equals_the_padded_step_bitwise[{loss}]": "numbers"
       for loss in ("dapo", "grpo", "dr_grpo")},
    DIST + "test_vocab_parallel_rows_are_batch_invariant[torch]": "numbers",
    DIST + "test_vocab_parallel_rows_are_batch_invariant[triton]": "numbers",
    # distillation: the device's block (the knob's 4 rows) and a chosen one, the module, explain, TRL's seams
    **{DISTILL + f"{test}[{impl}]": "numbers" for impl in ("torch", "triton")
       for test in ("test_a_sequence_is_the_same_alone_and_in_any_batch",
                    "test_a_chosen_block_is_batch_invariant_at_its_size")},
    DISTILL + "test_the_module_takes_the_option": "numbers",
    DISTILL + "test_explain_shows_the_chosen_block": "plan",
    DISTILL + "test_patch_trl_makes_the_distillation_calls_batch_invariant": "numbers",
    DISTILL + "test_patch_trl_passes_the_chosen_block_to_the_distillation_calls": "plan",
}
MESSAGES = {"numbers": re.compile(r"differs|!="), "plan": re.compile(r"not batch-invariant|did not reach the plan")}


def _missing_arithmetic() -> str | None:
    """What this machine's arithmetic does not show of the two dependences the forced-off failures rest on (None:
    both show)."""
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(46, 16, generator=g), torch.randn(83, 16, generator=g)
    many = hidden @ weight.T
    if all(torch.equal((hidden[r:r + 1] @ weight.T)[0], many[r]) for r in range(46)):
        return "its BLAS gives a one-row GEMM the bits of the same row in a 46-row GEMM"
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(16, 40_000, generator=g)
        sums = x.sum(-1)
        same = all(torch.equal(x[r:r + 1].sum(-1), sums[r:r + 1]) for r in range(16))
    finally:
        torch.set_num_threads(before)
    if same:
        return "torch sums one row of 40000 elements alone as it sums that row among 16"
    return None


def _outcomes(junit: Path) -> dict:
    """{node id: (outcome, message)} from pytest's JUnit XML: "passed", "failure", "error" or "skipped"."""
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = case.get("classname").replace(".", "/") + ".py::" + case.get("name")
        found = [(tag, el.get("message", "")) for tag in ("failure", "error", "skipped")
                 if (el := case.find(tag)) is not None]
        out[node] = found[0] if found else ("passed", "")
    return out


@pytest.mark.slow
def test_with_the_option_forced_off_exactly_the_tests_that_credit_it_fail(tmp_path):
    missing = _missing_arithmetic()
    if missing:
        pytest.skip(f"this machine: {missing}, so the tests crediting the option could not fail here; the check runs "
                    "where both show (x86 with torch's MKL, as CI)")
    junit = tmp_path / "forced-off.xml"
    run = subprocess.run([sys.executable, "-m", "pytest", *FILES, "-q", "-m", "not slow", "-p", "no:cacheprovider",
                          f"--junitxml={junit}"], cwd=ROOT, env={**os.environ, FORCE_VARIANT_ENV: "1"},
                         capture_output=True, text=True, timeout=TIMEOUT_S)
    assert run.returncode in (0, 1) and junit.is_file(), run.stdout[-4000:] + run.stderr[-4000:]
    outcomes = _outcomes(junit)
    not_run = sorted(set(EXPECTED_FAILURES) - set(outcomes))
    assert not not_run, f"expected failures not collected (renamed?): {not_run}"
    passed = {n: outcomes[n] for n in EXPECTED_FAILURES if outcomes[n][0] != "failure"}
    assert not passed, f"these credit the option but did not fail without it: {passed}"
    extra = {n: o for n, o in outcomes.items() if o[0] != "passed" and n not in EXPECTED_FAILURES}
    assert not extra, f"these did not pass with the option forced off, though they do not credit it: {extra}"
    for node, kind in EXPECTED_FAILURES.items():
        message = outcomes[node][1]
        assert MESSAGES[kind].search(message), f"{node} failed on something else than its {kind}: {message[:400]}"
