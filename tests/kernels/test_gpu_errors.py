"""What a value check's failure gives on a GPU (docs/api.md, "What bad input raises"; skipped elsewhere): an id
outside [0, V) in ``token_logprobs`` on CUDA tensors, eager and compiled, with and without
``GRPO_KERNELS_CHECK_VALUES=1``. Each case runs in a child process (``tests/support/error_modes.py``), since a
device-side assert ends the process's CUDA context; tests/api/test_errors_by_mode.py runs the same child on the CPU
and the CPU rows in its own process.

- eager, default: a device-side assert, no ``ValueError``: the CUDA error (a RuntimeError) at the next synchronizing
  call, the CUDA context unusable afterwards;
- eager, ``GRPO_KERNELS_CHECK_VALUES=1``: the ``ValueError`` naming ids (the verdict read on the host), the device
  still usable;
- compiled (the check is the graph's ``aten._assert_async``), with or without the variable: the device-side assert.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
ROOT = Path(__file__).resolve().parents[2]


def _child(mode: str, check_values: bool) -> dict:
    env = dict(os.environ, GRPO_KERNELS_CHECK_VALUES="1" if check_values else "0", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.support.error_modes", "cuda", mode], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"exit {done.returncode}; stderr: {done.stderr[-3000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("check_values", [False, True], ids=["default", "GRPO_KERNELS_CHECK_VALUES=1"])
@pytest.mark.parametrize("mode", ["eager", "compiled"])
def test_a_bad_id_on_the_gpu(mode, check_values):
    out = _child(mode, check_values)
    if mode == "eager" and check_values:
        assert out["value_error"] and "ids must lie in [0, V)" in out["message"], out
        assert out["device_usable"], out
    else:
        assert out["runtime_error"] and not out["value_error"], out
        assert "device-side assert" in out["message"], out
        assert not out["device_usable"], out
