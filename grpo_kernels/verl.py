"""verl's fused-kernel path on grpo_kernels: importing this module patches verl (verl 0.9.x).

Load it in verl's workers with the model's ``external_lib`` (docs/verl.md)::

    actor_rollout_ref.model.external_lib=grpo_kernels.verl
    actor_rollout_ref.model.use_fused_kernels=True
    actor_rollout_ref.model.fused_kernel_options.impl_backend=triton   # FSDP engine; Megatron always takes it

Then every ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` call (FSDP's Triton-backend forwards,
Megatron's fused forward with its tensor-parallel group) runs ``grpo_kernels.linear_token_logprobs``. ``REPORT``
says what was swapped and what stays verl's; ``unpatch()`` restores verl exactly, ``patch()`` applies it again.
The logic is in ``grpo_kernels.integrations.verl``; nothing in grpo_kernels imports this module.
"""
from __future__ import annotations

try:
    import verl as _verl  # noqa: F401  (absolute: the verl package, not this module)
except ImportError as _exc:
    raise ImportError("grpo_kernels.verl patches verl's fused kernels and needs verl 0.9.x installed: "
                      "pip install 'verl==0.9.1' (scripts/setup_verl.sh makes such an environment, .venv-verl); "
                      f"importing verl failed: {_exc}") from _exc

from .integrations.verl import (VerlPatchReport, is_verl_patched, linear_cross_entropy, patch_verl as patch,
                                unpatch_verl as unpatch)

__all__ = ["REPORT", "VerlPatchReport", "is_verl_patched", "linear_cross_entropy", "patch", "unpatch"]

REPORT: VerlPatchReport = patch()
