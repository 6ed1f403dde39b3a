"""Liger-Kernel 0.8.5's own JSD tests, vendored unmodified under tests/hf/liger_upstream (SOURCE.md there), run in a
subprocess with Liger's JSD names bound to grpo_kernels.liger's (the plugin tests/hf/liger_upstream/grpo_liger_patched.py)
by tests/hf/test_liger_jsd.py: what to run, what may fail and why, and how a run's outcomes are read."""
from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
UPSTREAM = ROOT / "tests" / "hf" / "liger_upstream"
FUSED = "test/transformers/test_fused_linear_jsd.py"
CHUNKED = "test/chunked_loss/test_jsd_loss.py"

# sha256 of each vendored file, as in liger_kernel-0.8.5.tar.gz (PyPI's sdist, sha256 4e8f8f61...9d66): a changed copy
# is no longer Liger's test.
SHA256 = {
    "test/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    "test/conftest.py": "3f39ff918d1d31798bc727fd8949fd0589481707ced67614286b7d0d578de480",
    "test/utils.py": "367df4d2a52b56a0b6204906227cea3adfcc1eaa4e5723da7bdf188093d88e69",
    "test/transformers/test_jsd.py": "93d2b9e95cb9b28626f3c78a6f0784c3e5bd0d9400bd0a7f7a0953aa7faa483d",
    FUSED: "23792bc1a9bf766ca389cf0f8805ada28a2e471e503844effb0578fd0e04fa0a",
    "test/chunked_loss/__init__.py": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855",
    CHUNKED: "9de6cda1f735535262d48448f3ed9eec977d4e828c747679ddc2e1098955f311",
    "LICENSE": "3a1ccb0c7274b68e1af2ca1d54b10b662085ca56753400182ecf87ae33f2d1a8",
    "NOTICE": "9e3c27a0f64b87d00df12250cf1bc218b1e2fbc5fffc0bd64737ba8e8357218f",
}

# One case of each of Liger's test functions (the fast suite's selection; the slow test runs every case): the small
# shapes; fp32 for the correctness tests, whose bf16 tolerances (up to rtol 0.5) pass with beta read backwards
# (tests/hf/test_liger_jsd.py::test_liger_jsd_tests_fail_with_beta_read_backwards), bf16 for the others.
FAST = [
    f"{FUSED}::test_low_probability_vocab_block_is_finite",
    f"{FUSED}::test_correctness[2.0-0.1-1.0-dtype1-1e-05-0.0005-4-423-167-1423]",
    f"{FUSED}::test_correctness_with_ignore_index[1.0-1.0-2-1.0-dtype1-1e-05-0.0005-4-423-167-1423]",
    f"{FUSED}::test_correctness_functional[accum_dtype1-2.0-0.1-42-0.5-dtype1-1e-05-0.0005-9-7-41-41]",
    f"{FUSED}::test_correctness_all_ignored[2.0-0.1-42-1.0-dtype0-0.005-0.05-4-423-167-1423]",
    f"{FUSED}::test_amp[autocast_dtype0-0.005-0.05]",
    f"{FUSED}::test_logits_projection_is_not_rounded_to_input_dtype[0.5-dtype0]",
    f"{CHUNKED}::test_correctness[42-2.0-0.0-1.0-0.8-True-1.0-dtype1-1e-05-0.0005-3-47-31-123]",
    f"{CHUNKED}::test_correctness_functional[2.0-0.1-0.9-0.5-42-True-1.0-dtype1-0.0001-0.005-9-7-41-41]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.0-False-False]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.0-True-True]",
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[0.5-False-True]",
]

# The documented deviations (docs/api.md, "Coming from Liger-Kernel"): node id -> (what the failure must say, why).
EXPECTED_FAILURES = {
    f"{CHUNKED}::test_jsd_hard_loss_computed_only_when_used[{case}]": (
        "assert False == True",
        "the test spies on torch.nn.functional.nll_loss, Liger's implementation of the hard loss; ours takes the "
        "student's log-prob of the label from linear_token_logprobs (no logits held), so the spy sees no call. What "
        "the test means, the hard loss computed exactly when weighted or returned and equal to the cross-entropy, "
        "is tests/hf/test_liger_jsd.py::test_hard_loss_computed_only_when_used")
    for case in ("0.0-True-True", "0.5-False-True")
}
# Skipped by Liger's own skipif on a machine without CUDA (it needs torch.mm's out_dtype on sm_80+): on a GPU it runs.
CUDA_ONLY = "test_logits_projection_is_not_rounded_to_input_dtype"
FLIP_ENV = "GRPO_LIGER_UPSTREAM_FLIP_BETA"
SUMMARY = re.compile(r"grpo_kernels\.liger: bound (.*); calls: (.*)")


def file_digests() -> dict:
    return {name: hashlib.sha256((UPSTREAM / name).read_bytes()).hexdigest() for name in SHA256}


def run_upstream(selection: list[str], junit: Path, timeout: int = 900, flip_beta: bool = False):
    """Liger's tests ``selection`` (node ids or files, relative to the vendored root) in a subprocess from that
    root, with the plugin (``flip_beta``: ours with 1 - beta); its outcomes in ``junit`` (JUnit XML). Returns the
    CompletedProcess."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_") and k != FLIP_ENV}
    if flip_beta:
        env[FLIP_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(UPSTREAM)])
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "grpo_liger_patched",
           "-W", "ignore::RuntimeWarning", f"--junitxml={junit}", *selection]
    return subprocess.run(cmd, cwd=UPSTREAM, env=env, capture_output=True, text=True, timeout=timeout)


def outcomes(junit: Path) -> dict:
    """node id -> ("passed" | "failed" | "skipped" | "error", message) from a JUnit XML report."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        node = f"{case.get('classname').replace('.', '/')}.py::{case.get('name')}"  # test.x.test_y -> test/x/test_y.py
        kind, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                kind = {"failure": "failed"}.get(child.tag, child.tag)
                message = (child.get("message") or "") + "\n" + (child.text or "")
                break
        found[node] = (kind, message)
    return found

