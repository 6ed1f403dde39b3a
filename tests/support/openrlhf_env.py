"""The OpenRLHF tests' environment: OpenRLHF 0.11.2 lives in its own venv (.venv-openrlhf, scripts/setup_openrlhf.sh),
since it pins transformers 5.15 and deepspeed 0.19.6 and needs flash-attn's padding helpers (a test-only stand-in,
``STUBS``, tests/openrlhf/conftest.py); elsewhere the tests of tests/openrlhf/ skip, saying how to run them."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STUBS = ROOT / "tests" / "openrlhf" / "stubs"  # the flash_attn stand-in, put on sys.path by tests/openrlhf/conftest.py
VENV = ROOT / ".venv-openrlhf"
SHIPPED_TESTS = VENV / "openrlhf-tests"  # OpenRLHF's own tests, moved out of site-packages by the setup script
RUN_COMMAND = "bash scripts/setup_openrlhf.sh && .venv-openrlhf/bin/python -m pytest tests/openrlhf -q"
SKIP_REASON = (f"needs OpenRLHF 0.11.2, which pins transformers 5.15 / deepspeed 0.19.6 and so has its own "
               f"environment: {RUN_COMMAND} (CI's slow step runs it)")


def require_openrlhf():
    """``grpo_kernels.openrlhf`` (imported: OpenRLHF's Actor is patched), or skip the calling test module."""
    try:
        import openrlhf  # noqa: F401
    except ImportError:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    import grpo_kernels.openrlhf as gk_openrlhf

    return gk_openrlhf
