"""Per-token log-probs (and entropy) of a Hugging Face causal LM without the model ever producing logits.

``causal_lm_token_logprobs`` runs the backbone (``model.base_model``, the decoder without its head), keeps the
final hidden states of the positions that predict the kept tokens, and sends them with ``lm_head.weight`` through
``grpo_kernels.linear_token_logprobs``: the (B, T, V) logits are never written, in the forward or the backward.

What the fused path can express: ``logits = cap * tanh(logit_scale * (h @ W.T + b) / cap)`` with ``lm_head`` a
plain ``nn.Linear`` (tied or untied to the input embeddings), a positive scalar ``logit_scale`` and an optional
soft cap ``cap`` (``final_logit_softcapping``: Gemma 2, whose default is 30, or a Gemma 3 config that sets it),
scored at a temperature ``tau`` as ``z = logits / tau``: the order of transformers' Gemma 2 forward (the cap on the
scaled lm_head output) and of TRL's fused head (scale, then cap, then temperature). Since
``cap * tanh(s * x / cap) = s * (cap / s) * tanh(x / (cap / s))``, the scale folds exactly into the kernels'
temperature and cap: ``linear_token_logprobs(..., temperature=tau / s, softcap=cap / s)``
(``fold_logit_scale``, the one place that does it). The scale is read from the text config under the same names
TRL's fused head uses (``logit_scale`` for Cohere, ``output_multiplier``, ``lm_head_multiplier`` for Falcon-H1,
``logits_scaling`` for Granite / MiniCPM3 / HyperCLOVA X). Like TRL's fused head, this assumes
``*ForCausalLM.forward`` does nothing else between the backbone and ``lm_head``; an architecture that transforms
the hidden states there in another way is not detected.

Refused with a ValueError (there is no fallback here, since a fallback would have to build the logits):
- a PEFT (LoRA, ...) adapter on ``lm_head``: merge it (``model.merge_adapter()``) or leave ``lm_head`` out of
  ``target_modules``; adapters elsewhere in the model are fine, they run inside the backbone;
- an ``lm_head`` that is not an ``nn.Linear`` (custom heads), a scale that is not a finite number > 0, a
  ``final_logit_softcapping`` that is neither None nor a finite number > 0, and a DeepSpeed ZeRO-3 partitioned
  ``lm_head`` (``zero3_blocker``): gathering it would be easy (``gather_head=``), but ``causal_lm_token_logprobs``
  and ``grpo``'s policy call the backbone and the head outside the model's own forward, where ZeRO-3 cannot take
  the head's gradient (the contract of TRL's ``maybe_gather_lm_head_ctx``; measured with DeepSpeed 0.19.8,
  docs/distributed.md "DeepSpeed ZeRO-3": gathered in the forward and the backward, the head's full gradient still
  fails to accumulate into its emptied partition). Under ZeRO-3 use TRL with ``patch_trl()``, whose fused head runs
  inside the model's forward and gathers the head through ``gather_head``.

An FSDP2-sharded ``lm_head`` (a DTensor weight) is gathered by ``get_lm_head`` with the gradient averaged back
over the mesh, like every other FSDP2 parameter (``grpo_kernels/distributed/sharded_head.py``): a collective, so every rank
calls it; ``get_lm_head(model, gather=False)`` validates without gathering.
"""
from __future__ import annotations

import math
import torch
from torch import nn

from ..distributed.sharded_head import check_dtensor_head, gathered_dtensor_head

__all__ = ["LMHead", "get_lm_head", "causal_lm_token_logprobs", "logit_scale_of", "fold_logit_scale",
           "fused_head_blocker", "zero3_blocker", "cast_to", "text_config", "is_peft_layer", "unwrap_peft"]


class LMHead:
    """The output projection of a causal LM as the fused path sees it.

    weight (V, H), bias (V,) or None (plain tensors, gathered from DTensors when sharded by FSDP2, with the
    gradient averaged back over the mesh; the module's parameters as they are with ``get_lm_head(gather=False)``),
    ``logit_scale`` (float > 0), the factor the model multiplies its logits by before any softmax, and ``softcap``
    (float > 0, or None): the model's ``final_logit_softcapping``, ``cap * tanh(.. / cap)`` applied to the scaled
    logits. ``fold_logit_scale`` turns both into the kernels' ``temperature`` / ``softcap``.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, logit_scale: float,
                 softcap: float | None = None):
        self.weight, self.bias, self.logit_scale, self.softcap = weight, bias, logit_scale, softcap


def text_config(model):
    """The text part of ``model``'s config (a vision-language model's ``get_text_config()``), else the config."""
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def logit_scale_of(config) -> float:
    """The scalar the architecture multiplies its logits by (1.0 when it has none), read like TRL 1.16 reads it.

    config: a (text) ``PretrainedConfig``. Kept in step with ``trl.trainer.utils.add_fused_lm_head`` so that the
    standalone helper and the TRL hook agree on every architecture.
    """
    scale = getattr(config, "logit_scale", None)
    if scale is None:
        scale = getattr(config, "output_multiplier", None)
    if scale is None:
        scale = getattr(config, "lm_head_multiplier", None)
    if scale is None and getattr(config, "logits_scaling", None) is not None:
        # Granite and MiniCPM3 divide the logits by `logits_scaling`; HyperCLOVA X multiplies them by it.
        scaling = config.logits_scaling
        scale = scaling if getattr(config, "model_type", None) == "hyperclovax" else 1 / scaling
    return 1.0 if scale is None else scale


def fold_logit_scale(temperature: float, logit_scale: float, softcap: float | None) -> tuple[float, float | None]:
    """``(temperature', softcap')`` for ``linear_token_logprobs`` / ``GRPOLossConfig`` that score the model's logits
    ``cap * tanh(s * x / cap)`` (x = h @ W.T + b, s = ``logit_scale``, cap = ``softcap`` or no cap when None) at
    ``temperature``: the one place that folds the scale (used by ``causal_lm_token_logprobs``, the TRL patch, and
    ``grpo``'s policy and sampler).

    The order is TRL's ``ChunkedLogProbFunction`` (scale, then cap, then temperature) and transformers' Gemma 2
    (the cap on the lm_head output). The kernels compute ``softcap' * tanh(x / softcap') / temperature'``, and
    ``cap * tanh(s x / cap) / T = (cap / s) * tanh(x / (cap / s)) / (T / s)`` for any s > 0, so the fold is exact:
    ``temperature' = T / s``, ``softcap' = cap / s``. Arguments are checked by ``fused_head_blocker``.
    """
    temperature = float(temperature) / float(logit_scale)
    return temperature, None if softcap is None else float(softcap) / float(logit_scale)


def zero3_enabled() -> bool:
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # pragma: no cover
        return False
    return bool(is_deepspeed_zero3_enabled())


def _positive_finite(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def fused_head_blocker(softcap=None, logit_scale=1.0) -> tuple[str, str] | None:
    """``(option, reason)`` when a head cannot go through the fused path, else None: the one compatibility check of
    the standalone helper (``get_lm_head``), the TRL patch and ``grpo.train``.

    softcap: the config's ``final_logit_softcapping`` (None, or a finite number > 0: the kernels apply it);
    logit_scale: ``logit_scale_of(config)``.
    """
    if softcap is not None and not _positive_finite(softcap):
        return (f"final_logit_softcapping={softcap!r}", "a soft cap cap*tanh(logits/cap) needs a finite cap > 0 "
                "(None: no cap)")
    if not _positive_finite(logit_scale):
        return (f"logit_scale={logit_scale!r}", "only a finite logit scale > 0 (logit_scale / output_multiplier / "
                "lm_head_multiplier / logits_scaling) folds into the temperature")
    return None


def zero3_blocker(weight) -> tuple[str, str] | None:
    """``(option, reason)`` when ``weight`` is (or, with ZeRO-3 enabled, may be) a DeepSpeed ZeRO-3 partition, for
    the callers that run the head outside the model's forward (``get_lm_head``, hence ``causal_lm_token_logprobs``
    and ``grpo``'s policy); TRL's fused head runs inside it and gathers the head itself."""
    if zero3_enabled() or hasattr(weight, "ds_id"):
        return ("DeepSpeed ZeRO-3", "the lm_head is partitioned, and ZeRO-3 takes a gathered parameter's gradient "
                "only when it was used inside the model's forward, while this helper runs the backbone and the head "
                "outside it; use TRL with grpo_kernels.patch_trl() (its fused head gathers the partition "
                "inside the forward), fused_linear_grpo_loss(..., gather_head=grpo_kernels.zero3_gather_head(w, b)) "
                "inside your own model forward, or ZeRO stage <= 2")
    return None


def is_peft_layer(module) -> bool:
    """Whether ``module`` is a PEFT wrapper or adapter layer (any class of the ``peft`` package in its MRO)."""
    # Checked by module path so that peft need not be installed (it is an optional dependency here).
    return any(cls.__module__.split(".")[0] == "peft" for cls in type(module).__mro__)


def unwrap_peft(model):
    """The transformers model under a ``PeftModel`` wrapper (adapters stay injected in its layers)."""
    if is_peft_layer(model) and hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model


def get_lm_head(model, gather: bool = True) -> LMHead:
    """Validate that ``model``'s head can go through the fused path and return its parameters.

    Raises a ValueError naming the model option that prevents it (see the module docstring).

    gather: with an FSDP2-sharded head (a DTensor weight), ``get_lm_head`` all-gathers it, a collective recorded
    by autograd (its backward reduce-scatters the gradient): call it on every rank of the mesh at the same point,
    where the head is about to be used (calling it on some ranks only hangs the others). ``gather=False`` only
    validates: no collective, no graph, and ``weight`` / ``bias`` are the module's parameters as they are
    (DTensors stay DTensors; ``weight.shape`` is the full shape); use it for checks at setup time.
    """
    model = unwrap_peft(model)
    config = text_config(model)
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
    if is_peft_layer(head):
        raise ValueError(
            f"a PEFT adapter on lm_head ({type(head).__name__}) is not supported by the fused linear head: merge "
            "it into the weight (model.merge_adapter()) or remove 'lm_head' from the adapter's target_modules."
        )
    if not isinstance(head, nn.Linear):
        raise ValueError(
            f"lm_head must be a torch.nn.Linear for the fused linear head, got {type(head).__name__}"
        )
    scale = logit_scale_of(config)
    softcap = getattr(config, "final_logit_softcapping", None)
    blocker = fused_head_blocker(softcap, scale) or zero3_blocker(head.weight)
    if blocker is not None:
        option, reason = blocker
        raise ValueError(f"{option} ({type(model).__name__}) is not supported by the fused linear head: {reason}")
    if not gather:
        check_dtensor_head(head.weight, head.bias)  # the layout checks of the gather, without its collective
        return LMHead(head.weight, head.bias, float(scale), None if softcap is None else float(softcap))
    # FSDP2 shards parameters as DTensors; the kernel needs plain tensors. Unlike a bare full_tensor() (whose
    # backward keeps only this rank's own gradient), the gather averages the gradient over the mesh, as FSDP2 does.
    weight, bias = gathered_dtensor_head(head.weight, head.bias)
    return LMHead(weight, bias, float(scale), None if softcap is None else float(softcap))


def cast_to(dtype: torch.dtype, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """``(hidden, weight, bias)`` in ``dtype`` (the kernels take one dtype); differentiable, no copy when equal."""
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def causal_lm_token_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                             logits_to_keep: int | None = None, temperature: float = 1.0,
                             return_entropy: bool = False, impl: str = "auto", **model_kwargs):
    """Log-probs of the last ``logits_to_keep`` tokens of ``input_ids`` under a causal LM, without its logits.

    model: a ``transformers`` causal LM (``*ForCausalLM``, or a PEFT wrapper of one) whose head passes
        ``get_lm_head``; its backbone is ``model.base_model``.
    input_ids (B, L) int; attention_mask (B, L) or None, passed to the backbone unchanged (left padding of prompts
        and right padding of completions both work as they do in the model's own forward).
    logits_to_keep: the number T of trailing tokens to score, 1 <= T <= L - 1; None scores tokens 1..L-1.
        Position ``L - T - 1 + t`` predicts ``input_ids[:, L - T + t]``, as TRL's ``logits_to_keep``.
    temperature: the logits (soft-capped first when the model has ``final_logit_softcapping``) are divided by it
        (> 0), like TRL's sampling temperature.
    return_entropy: also return the entropy of each predicted distribution.
    impl: "auto" | "triton" | "torch", forwarded to ``grpo_kernels.linear_token_logprobs``.
    model_kwargs: extra backbone inputs (position_ids, pixel_values, ...).
    Returns logp (B, T) fp32 [and entropy (B, T)] (fp64 for an fp64 model), differentiable w.r.t. the model's
    parameters.
    """
    import grpo_kernels as gk  # at call time: grpo_kernels/__init__.py may import this package

    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a (B, L) tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    length = input_ids.shape[1]
    if logits_to_keep is None:
        logits_to_keep = length - 1
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or \
            not 1 <= logits_to_keep <= length - 1:
        raise ValueError(f"logits_to_keep must be an int in [1, L - 1] = [1, {length - 1}], got {logits_to_keep!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or \
            not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")

    lm_model = unwrap_peft(model)
    head = get_lm_head(lm_model)
    backbone = lm_model.base_model
    if backbone is lm_model:
        raise ValueError(f"{type(lm_model).__name__} exposes no backbone (base_model_prefix): cannot skip its head")
    # No KV cache in a scoring pass; MoE router logits are not needed for log-probs.
    outputs = backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **model_kwargs)
    # Only the positions predicting the kept tokens go through the head: T rows instead of L.
    hidden = outputs.last_hidden_state[:, length - logits_to_keep - 1:length - 1]
    ids = input_ids[:, length - logits_to_keep:]
    # With the model split across devices (device_map), the backbone can end on another device than the head.
    hidden = hidden.to(head.weight.device)
    ids = ids.to(head.weight.device)
    weight, bias = head.weight, head.bias
    if weight.dtype != hidden.dtype:  # e.g. an fp32 head on a bf16 backbone: compute in the wider dtype
        hidden, weight, bias = cast_to(torch.promote_types(hidden.dtype, weight.dtype), hidden, weight, bias)
    # under autocast linear_token_logprobs runs the head in the autocast dtype, as F.linear would
    kernel_temperature, kernel_softcap = fold_logit_scale(temperature, head.logit_scale, head.softcap)
    return gk.linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=kernel_temperature,
                                    softcap=kernel_softcap, return_entropy=return_entropy, impl=impl)
