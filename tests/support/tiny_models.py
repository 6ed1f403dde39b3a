"""The tiny Llama the sharded-head tests build on every rank (and once unsharded for the ground truth)."""
from __future__ import annotations

import torch


def tiny_llama(vocab_size: int = 43, hidden_size: int = 16, dtype: torch.dtype = torch.float32):
    """One-layer ``LlamaForCausalLM`` with an untied head, seeded: the same weights on every rank and process.

    ``initializer_range=0.2`` keeps the log-probs away from uniform, so a wrong head gradient shows."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).to(dtype)
