"""tests/openrlhf/ run in .venv-openrlhf (scripts/setup_openrlhf.sh). There OpenRLHF imports flash-attn's padding
helpers at module load, and flash-attn has no CPU build: this conftest puts the TEST-ONLY stand-in
(tests/openrlhf/stubs/flash_attn, its docstring says what it holds) first on sys.path, only where OpenRLHF is
installed and no real flash-attn is (elsewhere these tests skip, and no other test sees the stand-in)."""
import importlib.util
import sys

import pytest

from ..support.openrlhf_env import STUBS

if importlib.util.find_spec("openrlhf") is not None and importlib.util.find_spec("flash_attn") is None:
    sys.path.insert(0, str(STUBS))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Where a module's tiny models are saved (tests/support/openrlhf_actors.py ``build_actor``)."""
    return tmp_path_factory.mktemp("openrlhf-models")


@pytest.fixture
def openrlhf_patched(monkeypatch):
    """OpenRLHF's Actor patched with the default options (neither environment knob set) for the test, and patched
    again after it, as importing grpo_kernels.openrlhf leaves it, whatever the test did."""
    import grpo_kernels.openrlhf as gk_openrlhf
    from grpo_kernels.integrations import openrlhf as integration

    monkeypatch.delenv(integration.ROUND_LOGITS_ENV, raising=False)
    monkeypatch.delenv(integration.BATCH_INVARIANT_ENV, raising=False)
    gk_openrlhf.patch()
    yield
    monkeypatch.undo()
    gk_openrlhf.unpatch()
    gk_openrlhf.patch()
