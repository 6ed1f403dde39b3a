"""grpo-kernels: fused Triton kernels for the GRPO loss, with TRL's semantics.

Public API: ``GRPOLossConfig``, ``group_advantages``, ``token_logprobs``, ``grpo_loss``, ``GRPOLoss``,
``linear_token_logprobs`` (``TokenOutputs`` with ``extra_outputs=``), ``fused_linear_grpo_loss``, ``FusedLinearGRPOLoss``,
``zero3_gather_head``, ``explain``
(which path a call takes, why, and its transient memory); distillation: ``DistillLossConfig``,
``linear_token_divergence``, ``fused_linear_distill_loss``, ``FusedLinearDistillLoss``. Triton is imported lazily, on the first kernel launch.
"""
from .config import GRPOLossConfig
from .distill import FusedLinearDistillLoss, fused_linear_distill_loss, linear_token_divergence
from .distill_config import DistillLossConfig
from .distributed.sharded_head import zero3_gather_head
from .explain import explain
from .logprobs import TokenOutputs, linear_token_logprobs, token_logprobs
from .loss import FusedLinearGRPOLoss, GRPOLoss, fused_linear_grpo_loss, grpo_loss
from .reference import group_advantages

__version__ = "0.1.0"

_INTEGRATIONS = ("patch_trl", "unpatch_trl")


def __getattr__(name):
    # Lazy (PEP 562): TRL is imported only when its patch is asked for.
    if name in _INTEGRATIONS:
        from . import integrations
        return getattr(integrations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GRPOLossConfig",
    "group_advantages",
    "token_logprobs",
    "grpo_loss",
    "GRPOLoss",
    "linear_token_logprobs",
    "TokenOutputs",
    "fused_linear_grpo_loss",
    "FusedLinearGRPOLoss",
    "zero3_gather_head",
    "explain",
    "DistillLossConfig",
    "linear_token_divergence",
    "fused_linear_distill_loss",
    "FusedLinearDistillLoss",
    "patch_trl",
    "unpatch_trl",
]
