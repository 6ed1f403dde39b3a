"""Ray's fresh worker processes: ``python -m grpo_kernels.openrlhf MODULE`` makes the ``ray.init`` of an
OpenRLHF-shaped driver (tests/openrlhf/ray_driver.py: OpenRLHF 0.11.2's call, its runtime_env env_vars) add the
``worker_process_setup_hook``, so an actor in a new worker process runs the patched ``Actor.forward`` while OpenRLHF's
env_vars still reach it; the same driver run directly leaves the worker unpatched (the hook is what patches it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ..support.openrlhf_env import ROOT, STUBS, require_openrlhf

require_openrlhf()
pytest.importorskip("ray")
PATCHED = "grpo_kernels.integrations.openrlhf.fused_actor_forward"


def run_driver(*launcher):
    env = dict(os.environ, DS_ACCELERATOR="cpu", PYTHONPATH=os.pathsep.join([str(ROOT), str(STUBS)]),
               NCCL_DEBUG="INFO", RAY_USAGE_STATS_ENABLED="0")
    env = {k: v for k, v in env.items() if not k.startswith("PYTEST_")}
    run = subprocess.run([sys.executable, "-m", *launcher, "tests.openrlhf.ray_driver"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    probes = [line for line in run.stdout.splitlines() if line.startswith("PROBE ")]
    assert run.returncode == 0 and probes, run.stdout[-2000:] + run.stderr[-3000:]
    return json.loads(probes[-1][len("PROBE "):])


@pytest.mark.slow  # two Ray starts: ~30 s on 2 cores
def test_ray_workers_patch_through_the_launcher():
    hooked = run_driver("grpo_kernels.openrlhf")
    assert hooked["pid"] != hooked["driver_pid"]  # a separate worker process
    assert hooked["forward"] == PATCHED
    assert hooked["NCCL_DEBUG"] == "INFO" and hooked["TOKENIZERS_PARALLELISM"] == "true"  # OpenRLHF's env_vars kept
    plain = run_driver()
    assert plain["forward"] == "openrlhf.models.actor.forward"
