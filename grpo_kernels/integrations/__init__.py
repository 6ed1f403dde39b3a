"""Integrations of grpo_kernels with Hugging Face libraries.

- ``patch_trl()`` / ``unpatch_trl()`` (``.trl``): TRL's GRPOTrainer, RLOOTrainer, SFTTrainer, DPOTrainer and
  KTOTrainer (and the packed rows of the padding-free AsyncGRPOTrainer) compute their per-token log-probs, entropies
  and the SFT / DPO / KTO metrics' outputs with ``grpo_kernels.linear_token_logprobs``, and the DistillationTrainer
  its loss with ``grpo_kernels.fused_linear_distill_loss`` (``.trl_distill``);
  supported TRL series in ``SUPPORTED_TRL_VERSIONS``. ``patch_trl`` returns a ``TRLPatchReport`` (print it;
  ``with patch_trl():`` unpatches on exit).
- ``patch_verl()`` / ``unpatch_verl()`` (``.verl``): verl 0.9's fused-kernel path (``linear_cross_entropy``) on
  ``grpo_kernels.linear_token_logprobs``; verl loads it as ``external_lib=grpo_kernels.verl`` (that module patches
  on import).
- ``causal_lm_token_logprobs`` (``.transformers``): per-token log-probs / entropy of a transformers causal LM from
  its final hidden states and ``lm_head``, without the model producing logits.

Neither TRL, verl nor transformers is imported until one of these is used: all are optional dependencies.
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "patch_trl": "trl",
    "unpatch_trl": "trl",
    "is_trl_patched": "trl",
    "TRLPatchReport": "trl",
    "SUPPORTED_TRL_VERSIONS": "trl",
    "patch_verl": "verl",
    "unpatch_verl": "verl",
    "is_verl_patched": "verl",
    "VerlPatchReport": "verl",
    "causal_lm_token_logprobs": "transformers",
    "get_lm_head": "transformers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    # Lazy (PEP 562): `import grpo_kernels.integrations` must not pull in torch-heavy optional packages.
    if name in _EXPORTS:
        module = importlib.import_module(f".{_EXPORTS[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
