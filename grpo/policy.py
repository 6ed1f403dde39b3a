"""The trainable unit: a causal LM whose forward *is* the GRPO loss, computed from hidden states.

``GRPOPolicy.forward`` runs the decoder body (``model.get_decoder()``), slices the hidden states that predict the
completion tokens, and calls ``grpo_kernels.fused_linear_grpo_loss`` with the LM head's weight (and bias), so the
B x T x V logits never exist. Because the whole loss happens inside ``forward``, wrapping this module in
``DistributedDataParallel`` sees every parameter (body *and* head) used in its forward: DDP's hooks, gradient
all-reduce and ``no_sync`` work as for any model. (Calling ``model.model`` directly on a DDP-wrapped causal LM
would bypass them.)

Alignment: the sequence is ``[prompt (P tokens, left-padded) | completion (T tokens)]``; the hidden state at
position t predicts token t + 1, so completion token j is predicted by ``hidden[:, P - 1 + j]``, i.e. the slice
``hidden[:, P - 1:-1]``.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

import grpo_kernels as gk


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as ``generate`` does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


class GRPOPolicy(nn.Module):
    """Wraps a ``*ForCausalLM``. ``forward(batch) -> (loss, metrics)``; ``token_logprobs(batch)`` under no_grad.

    batch: ``input_ids`` (B, P+T), ``attention_mask`` (B, P+T), ``prompt_length`` P (int), ``completion_ids``
    (B, T), ``completion_mask`` (B, T) bool, ``advantages`` (B,), optional ``old_logps`` / ``ref_logps`` (B, T).
    ``compute_dtype`` (e.g. bfloat16 under autocast) is the dtype the fused head runs in; the fp32 master
    weights receive the gradient through the cast.
    """

    def __init__(self, lm: nn.Module, loss_config: gk.GRPOLossConfig, impl: str = "auto",
                 compute_dtype: torch.dtype | None = None, autocast_dtype: torch.dtype | None = None):
        super().__init__()
        self.lm = lm
        self.loss_config = loss_config
        self.impl = impl
        self.compute_dtype = compute_dtype
        self.autocast_dtype = autocast_dtype

    def _autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)

    def completion_hidden(self, input_ids, attention_mask, prompt_length: int) -> torch.Tensor:
        """(B, T, H) final hidden states (after the final norm) predicting the T completion tokens."""
        with self._autocast(input_ids.device):
            out = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                                        position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        return out.last_hidden_state[:, prompt_length - 1:-1]

    def head(self, dtype: torch.dtype):
        """LM head weight (V, H) and bias (V,) or None, cast (differentiably) to the dtype of the hidden states."""
        linear = self.lm.get_output_embeddings()
        weight, bias = linear.weight, linear.bias
        return weight.to(dtype), None if bias is None else bias.to(dtype)

    def _hidden_and_head(self, batch):
        hidden = self.completion_hidden(batch["input_ids"], batch["attention_mask"], batch["prompt_length"])
        dtype = self.compute_dtype or self.lm.get_output_embeddings().weight.dtype
        hidden = hidden.to(dtype)
        weight, bias = self.head(dtype)
        return hidden, weight, bias

    def forward(self, batch: dict, num_items_in_batch=None):
        hidden, weight, bias = self._hidden_and_head(batch)
        return gk.fused_linear_grpo_loss(
            hidden, weight, batch["completion_ids"], batch["advantages"], mask=batch["completion_mask"], bias=bias,
            old_logps=batch.get("old_logps"), ref_logps=batch.get("ref_logps"),
            num_items_in_batch=num_items_in_batch, config=self.loss_config, impl=self.impl)

    @torch.no_grad()
    def token_logprobs(self, batch: dict) -> torch.Tensor:
        """(B, T) fp32 log-probs of the completion tokens at the loss temperature (old / reference policy)."""
        hidden, weight, bias = self._hidden_and_head(batch)
        return gk.linear_token_logprobs(hidden, weight, batch["completion_ids"], bias=bias,
                                        temperature=self.loss_config.temperature, impl=self.impl,
                                        mask=batch["completion_mask"])
