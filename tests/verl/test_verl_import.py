"""``grpo_kernels.verl`` is only ever imported on purpose: importing grpo_kernels (its integrations included) never
imports it, and without verl importing it is a clear ImportError. Runs in any environment: one subprocess where verl
is hidden (``sys.modules["verl"] = None``, as if it were not installed, also where it is)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ..support.ranks import REPO

PROBE = r"""
import sys

def loaded():
    return sorted(m for m, v in sys.modules.items()
                  if v is not None and (m == "verl" or m.startswith(("verl.", "grpo_kernels.verl"))))

import grpo_kernels, grpo_kernels.integrations as integrations
integrations.get_lm_head, integrations.patch_trl, integrations.patch_verl
print("after import grpo_kernels:", loaded())
sys.modules["verl"] = None
try:
    import grpo_kernels.verl
except ImportError as exc:
    print("ImportError:", exc)
print("after the failed import:", loaded())
"""


@pytest.fixture(scope="module")
def probe() -> str:
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_grpo_kernels_never_imports_the_verl_module(probe):
    assert "after import grpo_kernels: []" in probe, probe


def test_import_without_verl_is_a_clear_import_error(probe):
    assert "ImportError: grpo_kernels.verl patches verl's fused kernels and needs verl 0.9.x installed: " \
           "pip install 'verl==0.9.1' (scripts/setup_verl.sh makes such an environment, .venv-verl)" in probe, probe
    assert "after the failed import: []" in probe, probe  # nothing half-imported is left behind
