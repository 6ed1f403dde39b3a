"""``grpo_kernels.openrlhf`` is only ever imported on purpose: importing grpo_kernels (its integrations included)
never imports it nor OpenRLHF, and without OpenRLHF importing it is a clear ImportError naming the setup script.
Runs in any environment: one subprocess where OpenRLHF is hidden (``sys.modules["openrlhf"] = None``, as if it were
not installed, also where it is)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ..support.ranks import REPO

PROBE = r"""
import sys

def loaded():
    return sorted(m for m, v in sys.modules.items()
                  if v is not None and (m == "openrlhf" or m.startswith(("openrlhf.", "grpo_kernels.openrlhf",
                                                                          "grpo_kernels.integrations.openrlhf"))))

import grpo_kernels, grpo_kernels.integrations as integrations
integrations.get_lm_head, integrations.patch_trl
print("after import grpo_kernels:", loaded())
sys.modules["openrlhf"] = None
try:
    import grpo_kernels.openrlhf
except ImportError as exc:
    print("ImportError:", exc)
print("after the failed import:", [m for m in loaded() if not m.startswith("grpo_kernels.integrations")])
"""


@pytest.fixture(scope="module")
def probe() -> str:
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def test_grpo_kernels_never_imports_the_openrlhf_module(probe):
    assert "after import grpo_kernels: []" in probe, probe


def test_without_openrlhf_the_import_says_how_to_install_it(probe):
    assert "ImportError: grpo_kernels.openrlhf patches OpenRLHF's Actor and needs OpenRLHF 0.11.x" in probe, probe
    assert "scripts/setup_openrlhf.sh" in probe and "after the failed import: []" in probe, probe
