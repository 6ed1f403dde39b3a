"""TRL 1.12-1.14's ``GRPOTrainer._get_per_token_logps_and_entropies`` (``RLOOTrainer``'s alike) on grpo_kernels'
fused head: the model's backbone gives the hidden states, and only the positions that predict completion tokens go
through ``linear_token_logprobs``; the completion logits TRL's own method has the model write are never built.

Same call and results as TRL's method: ``(model, input_ids, attention_mask, logits_to_keep, batch_size=None,
compute_entropy=False, compute_aux_loss=False, <vision inputs>=None)`` returns ``(logps (B, K), entropies (B, K) |
None, aux_loss | None)``, rows of ``batch_size`` sequences at a time through the backbone as TRL does, position
``L - K - 1 + t`` predicting ``input_ids[:, L - K + t]`` at TRL's ``temperature``, the model's soft cap and logit
scale folded in (``fold_logit_scale``). Per version, as TRL computes them:
- 1.12 / 1.13: every completion position is scored (padding too, whose values TRL's loss masks out);
- 1.14: positions where ``attention_mask`` is 0 hold 0 (TRL's ``row_mask``) and are not computed;
- the entropy carries a gradient where TRL's does: GRPO with an entropy bonus (``_entropy_bonus_enabled``), RLOO
  never; log-probs are fp32 (float64 for a float64 model), TRL's are in the logits' dtype.
Under TRL 1.14 with ``use_liger_kernel=True`` (and no aux loss) TRL's own method runs: it takes its chunked path,
whose ``_ChunkedLogProbFunction`` ``patch_trl`` has swapped for ours, with TRL's own ZeRO-3 and FSDP handling.

Calls this cannot serve go to TRL's own method, unchanged, with a warning once per reason (a ValueError under
``patch_trl(strict=True)``): vision-language inputs (``pixel_values`` and the rest: they go through the model's vision
tower), ``compute_aux_loss=True`` (the MoE loss comes out of the model's own forward), FSDP and DeepSpeed ZeRO-3 (the
head would be read outside the owning module's forward), a vision-language model's composite config, and a head
``get_lm_head`` refuses (not an ``nn.Linear``, a PEFT adapter on ``lm_head``, a scale or cap that does not fold) or a
model without a backbone. A model wrapped for DDP or DeepSpeed ZeRO <= 2 runs through the wrapper's forward (TRL's
``_ForwardRedirection``), so the wrapper's gradient hooks see the call as they see TRL's.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch

from .transformers import get_lm_head, zero3_enabled

__all__ = ["PerTokenLogpsMethod"]

# The arguments of TRL's method that grpo_kernels serves; any other one that is not None is a vision input.
_TEXT_ARGUMENTS = ("self", "model", "input_ids", "attention_mask", "logits_to_keep", "batch_size", "compute_entropy",
                   "compute_aux_loss")
# TRL's vocabulary tile, passed on for the calls the head function hands back to TRL's own (ours picks its own).
_CHUNK_SIZE = 8192
# Series whose method zeroes (and skips) the positions outside the completion mask.
_ROW_MASKED = ("1.14",)
# Series whose method, under use_liger_kernel=True, takes TRL's chunked path through the swapped function.
_CHUNKED_PATH = ("1.14",)


class PerTokenLogpsMethod:
    """The replacement of ``owner._get_per_token_logps_and_entropies`` for TRL ``series``; ``bound()`` is the function
    patch_trl sets on the class. ``original`` is TRL's method, read when this is built (patch time)."""

    NAME = "_get_per_token_logps_and_entropies"

    def __init__(self, owner: type, series: str, seam):
        self.owner, self.series, self.seam = owner, series, seam
        self.original = getattr(owner, self.NAME)
        # TRL 1.14's method takes (model, *args, **kwargs) and passes them to _full_logits_logps: bind against that
        self.signature = inspect.signature(getattr(owner, "_full_logits_logps", self.original))

    def bound(self) -> Callable:
        method = self

        @functools.wraps(self.original)
        def _get_per_token_logps_and_entropies(trainer, model, *args, **kwargs):
            return method(trainer, model, *args, **kwargs)

        _get_per_token_logps_and_entropies.grpo_kernels_method = self
        return _get_per_token_logps_and_entropies

    def __call__(self, trainer, model, *args, **kwargs):
        call = self.signature.bind(trainer, model, *args, **kwargs)
        call.apply_defaults()
        values = dict(call.arguments)
        if self.series in _CHUNKED_PATH and getattr(trainer, "use_liger_kernel", False) and \
                not values["compute_aux_loss"]:
            return self.original(trainer, model, *args, **kwargs)  # TRL's chunked path: our function inside
        blocker = self.blocker(trainer, model, values)
        if blocker is not None:
            self.seam.fallback(*blocker, f"TRL's own {self.owner.__name__}.{self.NAME} (full logits)")
            return self.original(trainer, model, *args, **kwargs)
        unwrapped = trainer.accelerator.unwrap_model(model)
        score = functools.partial(self.score, trainer, unwrapped, values)
        if unwrapped is not model:  # DDP / DeepSpeed: through the wrapper's forward, as TRL's own chunked path does
            from trl.models.utils import _ForwardRedirection

            return _ForwardRedirection()(model, unwrapped, score)
        return score()

    def blocker(self, trainer, model, values) -> tuple[str, str] | None:
        """``(option, reason)`` when this call goes to TRL's own method, else None."""
        if values["compute_aux_loss"]:
            return ("compute_aux_loss=True", "the MoE load-balancing loss comes out of the model's own forward")
        vision = [name for name, value in values.items() if name not in _TEXT_ARGUMENTS and value is not None]
        if vision:
            return (f"{vision[0]} (vision inputs)", "they go through the model's own forward (its vision tower)")
        if getattr(trainer, "is_fsdp_enabled", False) or zero3_enabled():
            return ("FSDP / DeepSpeed ZeRO-3", "the head would be read outside the forward of the module that owns "
                    "it" + ("; use_liger_kernel=True serves it on grpo_kernels" if self.series in _CHUNKED_PATH
                            else ""))
        lm = _language_model(trainer.accelerator.unwrap_model(model))
        config = lm.config
        if hasattr(config, "get_text_config") and config.get_text_config() is not config:
            return (f"{type(lm).__name__} (a vision-language model)", "its backbone takes the vision inputs")
        if getattr(lm, "base_model", lm) is lm:
            return (type(lm).__name__, "it exposes no backbone (base_model_prefix) to run without its head")
        try:
            get_lm_head(lm, gather=False)
        except ValueError as exc:
            return ("the model's lm_head", str(exc))
        return None

    def score(self, trainer, model, values):
        """TRL's three-tuple from the backbone and the fused head, ``batch_size`` sequences at a time."""
        lm = _language_model(model)
        head = get_lm_head(lm, gather=False)
        input_ids, attention_mask, keep = values["input_ids"], values["attention_mask"], values["logits_to_keep"]
        batch_size = values["batch_size"] or input_ids.size(0)
        outputs = ("log_probs", "entropy") if values["compute_entropy"] else ("log_probs",)
        entropy_grad = bool(getattr(trainer, "_entropy_bonus_enabled", False))  # RLOO has none: never a gradient
        logps, entropies = [], []
        for start in range(0, input_ids.size(0), batch_size):
            ids, mask = input_ids[start:start + batch_size], attention_mask[start:start + batch_size]
            hidden = lm.base_model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            hidden = hidden[:, -keep - 1:-1].to(head.weight.device)
            targets = ids[:, -keep:].to(head.weight.device)
            rows = mask[:, -keep:].bool() if self.series in _ROW_MASKED else torch.ones_like(targets, dtype=torch.bool)
            logp, entropy, *_ = self.seam.head(hidden[rows], head.weight, head.bias, targets[rows], trainer.temperature,
                                               _CHUNK_SIZE, head.softcap, head.logit_scale, outputs)
            logps.append(logp.new_zeros(rows.shape).masked_scatter(rows, logp))
            if entropy is not None:
                entropy = entropy if entropy_grad else entropy.detach()
                entropies.append(entropy.new_zeros(rows.shape).masked_scatter(rows, entropy))
        return torch.cat(logps), torch.cat(entropies) if values["compute_entropy"] else None, None


def _language_model(model):
    """The transformers model under a PEFT wrapper (its adapters stay in the layers), else ``model``."""
    from accelerate.utils import is_peft_model

    return model.get_base_model() if is_peft_model(model) else model
