"""Rollouts with ragged prompts and completions, and tiny models of every family in docs/api.md's Models list, for
the packing tests (nothing downloaded: random configs)."""
from __future__ import annotations

import pytest
import torch

from grpo.rollout import Rollout, completion_mask_after_eos

EOS = 1
COMMON = dict(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=EOS)
# name -> (config class, model class, extra config). A sliding window of 4 tokens (where the family has one) bites
# inside the test sequences, so the packed sliding-window masks are exercised too.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 4}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 4}),
}


def tiny_model(name: str, attn: str | None = None, dtype: torch.dtype = torch.float64):
    """A seeded random model of family ``name`` in eval mode (no dropout), ``attn`` its attention implementation
    (None: transformers' default for it)."""
    import transformers

    config_cls, model_cls, extra = FAMILIES[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    kwargs = dict(COMMON, **extra)
    if attn is not None:
        kwargs["attn_implementation"] = attn
    config = getattr(transformers, config_cls)(**kwargs)
    return getattr(transformers, model_cls)(config).to(dtype).eval()


def ragged_rollout(prompt_lengths, completion_lengths, T: int | None = None, vocab: int = 61, seed: int = 0,
                   device: str = "cpu") -> Rollout:
    """A rollout of len(prompt_lengths) rows: left-padded prompts of those lengths, completions of those lengths
    (the last token EOS when it is shorter than T, else truncated: no EOS), pad after EOS; random tokens in
    [2, vocab). Rewards are zeros."""
    g = torch.Generator().manual_seed(seed)
    B, P = len(prompt_lengths), max(prompt_lengths)
    T = T or max(completion_lengths)
    prompt = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion = torch.zeros(B, T, dtype=torch.long)
    for b, (p, c) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt[b, P - p:] = torch.randint(2, vocab, (p,), generator=g)
        prompt_mask[b, P - p:] = 1
        completion[b, :c] = torch.randint(2, vocab, (c,), generator=g)
        if c < T:
            completion[b, c - 1] = EOS
    mask, truncated = completion_mask_after_eos(completion, [EOS])
    rollout = Rollout(input_ids=torch.cat([prompt, completion], 1),
                      attention_mask=torch.cat([prompt_mask, mask.long()], 1),
                      prompt_length=P, completion_ids=completion, completion_mask=mask, rewards=torch.zeros(B, 1),
                      reward_total=torch.zeros(B), truncated=truncated, prompts=[""] * B, completions=[""] * B)
    for name in ("input_ids", "attention_mask", "completion_ids", "completion_mask"):
        setattr(rollout, name, getattr(rollout, name).to(device))
    return rollout


# lengths with the awkward cases: 1-token completions, a 1-token prompt, a truncated row (no EOS), a long tail
PROMPTS = [3, 1, 5, 2, 4, 3, 2, 5]
COMPLETIONS = [9, 1, 2, 12, 1, 4, 7, 3]
