"""The trainable unit: a causal LM whose forward *is* the GRPO loss, computed from hidden states.

``GRPOPolicy.forward`` runs the backbone (``model.base_model``, the decoder without its head), slices the hidden
states that predict the completion tokens, and calls ``grpo_kernels.fused_linear_grpo_loss`` with the LM head's
weight (and bias), so the B x T x V logits never exist. Because the whole loss happens inside ``forward``,
wrapping this module in ``DistributedDataParallel`` sees every parameter (body *and* head) used in its forward:
DDP's hooks, gradient all-reduce and ``no_sync`` work as for any model. Under FSDP2 (``grpo/sharding.py``) this
module is the root unit: its forward gathers the embeddings, final norm and head, so the fused loss gets the
plain unsharded ``lm_head.weight``.

The head goes through ``grpo_kernels.integrations.transformers.get_lm_head``, the package's one fused-head
compatibility check: a model whose logits are ``cap * tanh(logit_scale * (h @ W.T + b) / cap)`` (no cap unless the
config sets ``final_logit_softcapping``, as Gemma 2 does) is scored with the loss options
``temperature / logit_scale`` and ``softcap = cap / logit_scale`` (exact: ``fold_logit_scale``, as in
``causal_lm_token_logprobs``); the kernels apply the cap. The soft cap is a property of the model, so it comes from
its config, never from the loss options (``grpo/cli.py`` ``FROM_MODEL``). Non-linear heads and invalid scales or
caps are refused with a UsageError.

Ids the sampler never draws (``grpo/rollout.py``) get ``SUPPRESSED_LOGIT`` added to their logits, so the loss
normalizes over the same ids as the sampler: exactly (their probability underflows to 0) without a soft cap. With
a cap the bias goes in before it (the kernels cap ``h @ W.T + b``), so a suppressed id's capped logit is ``-cap``,
not ``-1e4``: the loss gives the suppressed ids together a probability of at most
``n_suppressed * exp(-(cap + z_max) / T)`` (z_max the largest capped logit), about ``n * 1e-13`` at Gemma 2's cap of
30 and T = 1 when z_max >= 0, below fp32 resolution; the sampler, which sets them to -inf, never draws them.

Alignment: the sequence is ``[prompt (P tokens, left-padded) | completion (T tokens)]``; the hidden state at
position t predicts token t + 1, so completion token j is predicted by ``hidden[:, P - 1 + j]``, i.e. the slice
``hidden[:, P - 1:-1]``.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

import grpo_kernels as gk
from grpo_kernels.integrations.transformers import cast_to, fold_logit_scale, get_lm_head

from .errors import UsageError
from .rollout import SUPPRESSED_LOGIT, position_ids_from_mask


def checked_lm_head(lm: nn.Module):
    """``get_lm_head(lm)`` with its refusal turned into a UsageError (a model the fused loss cannot train)."""
    try:
        return get_lm_head(lm)
    except ValueError as exc:
        raise UsageError(f"this model cannot use the fused GRPO loss: {exc}")


class LossTerms(NamedTuple):
    """A distillation run's loss of one micro-batch, in two terms that are weighted apart (grpo/update.py): the GRPO
    loss (None with ``--distill-only``), weighted like any GRPO loss, and the distillation loss (already times its
    coefficient), normalized by the optimizer step's token count."""

    grpo: torch.Tensor | None
    distill: torch.Tensor


class GRPOPolicy(nn.Module):
    """Wraps a ``*ForCausalLM``. ``forward(batch) -> (loss, metrics)``; ``token_logprobs(batch)`` under no_grad.

    batch: ``input_ids`` (B, P+T), ``attention_mask`` (B, P+T), ``prompt_length`` P (int), ``completion_ids``
    (B, T), ``completion_mask`` (B, T) bool, ``advantages`` (B,), optional ``old_logps`` / ``ref_logps`` (B, T).
    ``compute_dtype`` (e.g. bfloat16 under autocast) is the dtype the fused head runs in; the fp32 master
    weights receive the gradient through the cast. ``banned_ids``: ids the sampler never draws. ``loss_config``'s
    ``softcap`` must be None or the model's own ``final_logit_softcapping`` (it is read from the model).
    ``distill``: None, or the distillation term of a ``--teacher`` run (``grpo.distillation.DistillTerm``, set by
    the trainer): a plain attribute, so the teacher it holds is no part of this module (not in its parameters, its
    state dict, the optimizer, DDP's buckets or FSDP's shards).
    """

    def __init__(self, lm: nn.Module, loss_config: gk.GRPOLossConfig, impl: str = "auto",
                 compute_dtype: torch.dtype | None = None, autocast_dtype: torch.dtype | None = None,
                 banned_ids: list[int] | None = None):
        super().__init__()
        self.lm = lm
        head = checked_lm_head(lm)
        if loss_config.softcap is not None and loss_config.softcap != head.softcap:
            raise UsageError(f"loss softcap={loss_config.softcap} differs from the model's final_logit_softcapping="
                             f"{head.softcap}: the soft cap is read from the model's config; leave it None")
        # The logit scale folds exactly into the temperature and the cap: cap*tanh(s*l/cap)/T, as the model computes.
        temperature, softcap = fold_logit_scale(loss_config.temperature, head.logit_scale, head.softcap)
        self.loss_config = loss_config.replace(temperature=temperature, softcap=softcap)
        self.impl = impl
        self.compute_dtype = compute_dtype
        self.autocast_dtype = autocast_dtype
        bias = None
        if banned_ids:
            bias = torch.zeros(head.weight.shape[0], dtype=torch.float32, device=head.weight.device)
            bias[torch.tensor(banned_ids, dtype=torch.long)] = SUPPRESSED_LOGIT
        self.register_buffer("suppress_bias", bias, persistent=False)
        self.distill = None

    def _autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def completion_hidden(self, input_ids, attention_mask, prompt_length: int) -> torch.Tensor:
        """(B, T, H) final hidden states (after the final norm) predicting the T completion tokens."""
        with self._autocast(input_ids.device):
            out = self.lm.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        return out.last_hidden_state[:, prompt_length - 1:-1]

    def packed_hidden(self, packed) -> torch.Tensor:
        """(N, H) final hidden states predicting a packed micro-batch's completion tokens (``grpo/packing.py``), in
        sequence order: the backbone runs on the packed rows with ``position_ids`` restarting per sequence and no
        attention mask, so transformers keeps each sequence to itself (varlen flash-attn gets ``cu_seq_lens``)."""
        with self._autocast(packed.input_ids.device):
            out = self.lm.base_model(input_ids=packed.input_ids, position_ids=packed.position_ids,
                                     use_cache=False, **packed.attention_kwargs)
        hidden = out.last_hidden_state
        return hidden.reshape(-1, hidden.shape[-1]).index_select(0, packed.token_index)

    def _hidden_and_head(self, batch, hidden: torch.Tensor | None = None):
        if hidden is None:
            if "packed" in batch:
                hidden = self.packed_hidden(batch["packed"])
            else:
                hidden = self.completion_hidden(batch["input_ids"], batch["attention_mask"], batch["prompt_length"])
        weight, bias = self.head()
        return cast_to(self.compute_dtype or weight.dtype, hidden, weight, bias)

    def head(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight, bias) of the LM head as the loss scores it: the model's bias plus ``SUPPRESSED_LOGIT`` on the
        ids the sampler never draws (not cast)."""
        head = get_lm_head(self.lm)
        bias = head.bias
        if self.suppress_bias is not None:
            bias = self.suppress_bias if bias is None else bias + self.suppress_bias
        return head.weight, bias

    def forward(self, batch: dict, num_items_in_batch=None, hidden: torch.Tensor | None = None,
                distill_num_items=None):
        """(loss, metrics). ``hidden``: the completion hidden states when the caller already has them (the
        sampling forward kept with its graph: no second forward of the backbone). A packed batch
        (``{"packed": PackedBatch, "advantages": (S,), "old_logps" / "ref_logps": (N,)}``) takes the packed loss.
        With ``distill`` set (and the batch's ``teacher_hidden``), ``loss`` is ``LossTerms`` (the distillation loss
        divided by ``distill_num_items``, the step's token count) and the metrics add ``distill/divergence`` and
        ``distill/entropy``."""
        hidden, weight, bias = self._hidden_and_head(batch, hidden)
        if self.distill is None:
            return self._grpo_loss(batch, hidden, weight, bias, num_items_in_batch)
        loss, metrics = (None, {}) if self.distill.only else \
            self._grpo_loss(batch, hidden, weight, bias, num_items_in_batch)
        distill, distill_metrics = self.distill.loss(batch, hidden, weight, bias, distill_num_items, self.impl)
        return LossTerms(loss, distill), {**metrics, **distill_metrics}

    def _grpo_loss(self, batch: dict, hidden, weight, bias, num_items_in_batch):
        if "packed" in batch:
            packed = batch["packed"]
            return packed_loss(hidden, weight, packed.completion_ids, batch["advantages"], packed.cu_seqlens,
                               mask=packed.completion_mask, bias=bias, old_logps=batch.get("old_logps"),
                               ref_logps=batch.get("ref_logps"), num_items_in_batch=num_items_in_batch,
                               config=self.loss_config, impl=self.impl)
        return gk.fused_linear_grpo_loss(
            hidden, weight, batch["completion_ids"], batch["advantages"], mask=batch["completion_mask"], bias=bias,
            old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"),
            num_items_in_batch=num_items_in_batch, config=self.loss_config, impl=self.impl)

    @torch.no_grad()
    def token_logprobs(self, batch: dict, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T) fp32 log-probs of the completion tokens at the loss temperature and soft cap (old / reference
        policy); (N,) for a packed batch, in its token order. ``hidden``: the completion hidden states, when the
        caller has them (as for ``forward``)."""
        packed = batch.get("packed")
        ids = batch["completion_ids"] if packed is None else packed.completion_ids
        mask = batch["completion_mask"] if packed is None else packed.completion_mask
        hidden, weight, bias = self._hidden_and_head(batch, hidden)
        return gk.linear_token_logprobs(hidden, weight, ids, bias=bias, temperature=self.loss_config.temperature,
                                        softcap=self.loss_config.softcap, impl=self.impl, mask=mask,
                                        batch_invariant=self.loss_config.batch_invariant,
                                        invariant_block_rows=self.loss_config.invariant_block_rows,
                                        round_logits=self.loss_config.round_logits)


def packed_loss(hidden, weight, ids, advantages, cu_seqlens, *, mask, bias, old_logps, ref_logps,
                num_items_in_batch, config: gk.GRPOLossConfig, impl: str):
    """``fused_linear_grpo_loss`` on packed tokens: hidden (N, H), ids / mask / old / ref (N,), advantages (S,),
    ``cu_seqlens`` (S + 1,) (sequence s is tokens ``cu_seqlens[s]:cu_seqlens[s+1]``); the same numbers as the
    padded (S, longest) call, with no (S, longest) tensor anywhere (docs/api.md, "Packed sequences"). dr_grpo's
    normalizer comes from ``config.max_completion_length`` (TrainConfig sets it to --max-new-tokens)."""
    return gk.fused_linear_grpo_loss(hidden, weight, ids, advantages, mask=mask, bias=bias, old_logps=old_logps,
                                     ref_logps=ref_logps, num_items_in_batch=num_items_in_batch, config=config,
                                     impl=impl, cu_seqlens=cu_seqlens)
