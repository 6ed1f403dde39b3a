"""OpenRLHF 0.11.2's own unit tests (shipped in its wheel as a top-level ``tests`` package, which
scripts/setup_openrlhf.sh moves out of site-packages to .venv-openrlhf/openrlhf-tests so that it cannot shadow this
repository's ``tests``) pass with grpo_kernels.openrlhf in effect, every copy of the Actor class patched (the plugin
tests/openrlhf/shipped/grpo_openrlhf_patched.py).

Two of OpenRLHF's modules are not run: test_dataset_utils.py and test_pretrain_loss_mask.py import ``datasets`` (and
pyarrow), which .venv-openrlhf leaves out; neither touches the actor. The one shipped test that calls
``Actor.forward`` (test_actor_entropy_temperature.py) uses a model without an lm_head (a per-token logits table), so
its calls take the fallback, OpenRLHF's own forward: the plugin's count says so, and this test checks it."""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from ..support.openrlhf_env import ROOT, SHIPPED_TESTS, STUBS, require_openrlhf

require_openrlhf()
NOT_RUN = ("tests/test_dataset_utils.py", "tests/test_pretrain_loss_mask.py")  # need `datasets`, no actor


@pytest.mark.slow  # OpenRLHF's ~110 tests in a subprocess: ~40 s on 2 cores
def test_openrlhf_shipped_tests_pass_patched():
    if not (SHIPPED_TESTS / "tests" / "test_actor_entropy_temperature.py").is_file():
        pytest.fail(f"OpenRLHF's own tests are not in {SHIPPED_TESTS}: run bash scripts/setup_openrlhf.sh")
    env = dict(os.environ, DS_ACCELERATOR="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(STUBS), str(ROOT / "tests" / "openrlhf" / "shipped")]))
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-p", "grpo_openrlhf_patched",
           *(f"--ignore={path}" for path in NOT_RUN)]
    run = subprocess.run(cmd, cwd=SHIPPED_TESTS, env=env, capture_output=True, text=True, timeout=900)
    tail = run.stdout[-3000:] + run.stderr[-2000:]
    assert run.returncode == 0, tail
    summary = re.search(r"grpo_kernels\.openrlhf: patched (.*); Actor\.forward calls: (.*)", run.stdout)
    assert summary, tail
    patched, calls = summary.groups()
    assert "openrlhf.models.actor.Actor.forward" in patched and "_openrlhf_actor_test.actor.Actor.forward" in patched
    # the shipped actor test's table model has no lm_head: its calls are OpenRLHF's own forward, none silently ours
    assert re.search(r"\d+ on OpenRLHF \(_TableLM has no lm_head", calls), calls
    assert re.search(r"(\d+) passed", run.stdout) and " failed" not in run.stdout.splitlines()[-1], tail
