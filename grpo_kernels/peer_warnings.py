"""What the peers say about a loss configuration, said here too (issue 30).

grpo_kernels computes every configuration as TRL 1.16's ``GRPOTrainer._compute_loss`` does; where TRL warns at
trainer setup, or Liger-Kernel 0.8.5 refuses a configuration that TRL computes, ``GRPOLossConfig`` warns once with
TRL's words (a ``UserWarning``). Only the sequence-level combinations are covered: TRL's advisory that luspo
mirrors its paper with ``importance_sampling_level="sequence"`` is not repeated (it would fire on token-level
luspo, which is a valid TRL configuration).
"""
from __future__ import annotations

import warnings

import torch

# TRL 1.16 (GRPOTrainer.__init__) warns when these sum per-token contributions of a sequence-level ratio
SEQUENCE_LEVEL_SUMS = ("bnpo", "dr_grpo", "dapo", "cispo")
# Liger-Kernel 0.8.5 raises a ValueError for these at importance_sampling_level="sequence"
LIGER_REFUSES_SEQUENCE = ("cispo", "sapo", "vespo")

_TRL_SEQUENCE_SUMS = (
    "When using `importance_sampling_level='sequence'`, the `'{loss_type}'` loss sums per-token contributions, which "
    "effectively weights each sequence by its completion length instead of optimizing the per-sequence objective. "
    "To reproduce the GSPO paper's setup, set `loss_type='grpo'` "
    "(see https://huggingface.co/docs/trl/main/en/paper_index#group-sequence-policy-optimization).")
_TRL_VESPO = ("VESPO computes sequence-level importance weights internally. `importance_sampling_level` should be "
              "set to `'token'` (the default).")
_SAPO = ("importance_sampling_level='sequence' with loss_type='sapo': the soft gate acts on each sequence's ratio, as "
         "TRL 1.16 computes it; SAPO is defined on token ratios (set importance_sampling_level='token').")
_LIGER = " Liger-Kernel 0.8.5 refuses loss_type='{loss_type}' at importance_sampling_level='sequence' (ValueError)."


def sequence_level_messages(loss_type: str, importance_sampling_level: str) -> list[str]:
    """The peers' warnings for this pair (empty for token-level ratios and for grpo / luspo at sequence level)."""
    if importance_sampling_level != "sequence":
        return []
    if loss_type in SEQUENCE_LEVEL_SUMS:
        message = _TRL_SEQUENCE_SUMS.format(loss_type=loss_type)
    elif loss_type == "vespo":
        message = _TRL_VESPO
    elif loss_type == "sapo":
        message = _SAPO
    else:
        return []
    if loss_type in LIGER_REFUSES_SEQUENCE:
        message += _LIGER.format(loss_type=loss_type)
    return [message]


def warn_like_peers(loss_type: str, importance_sampling_level: str) -> None:
    """Warn (UserWarning, prefixed ``grpo_kernels:``) where TRL warns or Liger refuses; silent while compiling (a
    config built inside a compiled step must not break the graph)."""
    if torch.compiler.is_compiling():
        return
    for message in sequence_level_messages(loss_type, importance_sampling_level):
        warnings.warn(f"grpo_kernels: {message}", UserWarning, stacklevel=4)
