"""OpenRLHF's ``Actor.forward`` on grpo_kernels: importing this module patches OpenRLHF (0.11.x).

In one process (SFT / DPO under the ``deepspeed`` launcher, a script of your own)::

    import grpo_kernels.openrlhf   # before the first Actor forward

For OpenRLHF's Ray trainer every worker process must import it: run OpenRLHF's entry point through this module,
which adds Ray's setup hook to OpenRLHF's ``ray.init`` and then runs the entry point as ``__main__``::

    python -m grpo_kernels.openrlhf openrlhf.cli.train_ppo_ray --actor.model_name_or_path ... (OpenRLHF's arguments)
    deepspeed --module grpo_kernels.openrlhf openrlhf.cli.train_sft ...

or, with a driver of your own, ``ray.init(runtime_env=grpo_kernels.openrlhf.ray_runtime_env({...}))`` before
OpenRLHF's ``train(args)`` (OpenRLHF 0.11.2 calls ``ray.init`` only when Ray is not initialized yet). Options reach the
workers through the environment: ``GRPO_KERNELS_OPENRLHF_ROUND_LOGITS`` (model | none | bf16 | fp16) and
``GRPO_KERNELS_BATCH_INVARIANT=1`` (docs/openrlhf.md). ``REPORT`` says what runs where; ``unpatch()`` restores
OpenRLHF exactly, ``patch()`` applies it again. The logic is in ``grpo_kernels.integrations.openrlhf``; nothing in
grpo_kernels imports this module.
"""
from __future__ import annotations

import sys

try:
    import openrlhf as _openrlhf  # noqa: F401  (absolute: the openrlhf package, not this module)
except ImportError as _exc:
    raise ImportError("grpo_kernels.openrlhf patches OpenRLHF's Actor and needs OpenRLHF 0.11.x installed: "
                      "pip install 'openrlhf==0.11.2' (scripts/setup_openrlhf.sh makes such an environment, "
                      f".venv-openrlhf); importing openrlhf failed: {_exc}") from _exc

from .integrations.openrlhf import (SETUP_HOOK, OpenRLHFPatchReport, fused_actor_forward, is_openrlhf_patched,
                                    patch_openrlhf as patch, ray_runtime_env, stock_forward,
                                    unpatch_openrlhf as unpatch)

__all__ = ["REPORT", "OpenRLHFPatchReport", "SETUP_HOOK", "fused_actor_forward", "is_openrlhf_patched", "main",
           "patch", "ray_runtime_env", "stock_forward", "unpatch"]

REPORT: OpenRLHFPatchReport = patch()


def _hooked_ray_init(ray_init):
    """``ray.init`` that adds the setup hook to the runtime_env it is given (OpenRLHF's env_vars are kept)."""
    import functools

    @functools.wraps(ray_init)
    def init(*args, runtime_env=None, **kwargs):
        return ray_init(*args, runtime_env=ray_runtime_env(runtime_env), **kwargs)

    return init


def main(argv=None) -> None:
    """``python -m grpo_kernels.openrlhf MODULE [ARGS...]``: patch here, make every ``ray.init`` of this process add
    the setup hook (so Ray's workers patch too), then run ``MODULE`` as ``__main__`` with ``ARGS``."""
    import runpy

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m grpo_kernels.openrlhf MODULE [ARGS...]  (e.g. openrlhf.cli.train_ppo_ray)")
    try:
        import ray
    except ImportError:
        ray = None
    if ray is not None:
        ray.init = _hooked_ray_init(ray.init)
    sys.argv = [argv[0], *argv[1:]]
    runpy.run_module(argv[0], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
