"""tests/openrlhf/ run in .venv-openrlhf (scripts/setup_openrlhf.sh). There OpenRLHF imports flash-attn's padding
helpers at module load, and flash-attn has no CPU build: this conftest puts the TEST-ONLY stand-in
(tests/openrlhf/stubs/flash_attn, its docstring says what it holds) first on sys.path, only where OpenRLHF is
installed and no real flash-attn is (elsewhere these tests skip, and no other test sees the stand-in)."""
import importlib.util
import sys

from ..support.openrlhf_env import STUBS

if importlib.util.find_spec("openrlhf") is not None and importlib.util.find_spec("flash_attn") is None:
    sys.path.insert(0, str(STUBS))
