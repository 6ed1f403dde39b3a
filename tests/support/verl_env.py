"""The verl tests' environment: verl 0.9.1 lives in its own venv (.venv-verl, scripts/setup_verl.sh), since it pins
transformers < 5.11; elsewhere the tests of tests/verl/ that need it skip, saying how to run them."""
from __future__ import annotations

import pytest

RUN_COMMAND = "bash scripts/setup_verl.sh && .venv-verl/bin/python -m pytest tests/verl -q"
SKIP_REASON = (f"needs verl 0.9.1, which pins transformers < 5.11 and so has its own environment: {RUN_COMMAND} "
               "(CI's slow step runs it)")
CUDA_SKIP_REASON = ("verl's own Triton kernel (efficient_entropy_forward) asserts CUDA tensors: this comparison runs "
                    "on a CUDA machine with verl installed")


def require_verl():
    """verl (imported), or skip the calling test module with SKIP_REASON."""
    try:
        import verl
    except ImportError:
        pytest.skip(SKIP_REASON, allow_module_level=True)
    return verl
