"""Sampling a rollout: G completions per prompt with ``transformers`` generation, masks after EOS, rewards.

Rows are ordered group by group (the G completions of prompt i are rows i*G .. i*G+G-1), the layout
``grpo_kernels.group_advantages`` expects.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .rewards import RewardSpec, compute_rewards


@dataclass
class GenerationSettings:
    num_generations: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int | None = None


@dataclass
class Rollout:
    """One rank's batch of B = prompts x G completions (CPU or device tensors, see ``to``)."""

    input_ids: torch.Tensor        # (B, P+T) prompt (left-padded) then completion (pad after EOS)
    attention_mask: torch.Tensor   # (B, P+T) 1 on prompt tokens and completion tokens up to and including EOS
    prompt_length: int             # P
    completion_ids: torch.Tensor   # (B, T)
    completion_mask: torch.Tensor  # (B, T) bool, loss mask
    rewards: torch.Tensor          # (B, R) one column per reward function (NaN = not scored)
    reward_total: torch.Tensor     # (B,) weighted sum
    truncated: torch.Tensor        # (B,) bool, no EOS within max_new_tokens
    prompts: list
    completions: list

    @property
    def batch_size(self) -> int:
        return self.completion_ids.shape[0]

    def batch(self, rows: torch.Tensor | slice | None = None, **extra) -> dict:
        """The tensors GRPOPolicy needs for ``rows`` (all rows when None) plus per-row extras."""
        idx = slice(None) if rows is None else rows
        out = {"input_ids": self.input_ids[idx], "attention_mask": self.attention_mask[idx],
               "prompt_length": self.prompt_length, "completion_ids": self.completion_ids[idx],
               "completion_mask": self.completion_mask[idx]}
        for key, value in extra.items():
            if value is not None:
                out[key] = value[idx]
        return out


def completion_mask_after_eos(completion_ids: torch.Tensor, eos_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(mask, truncated): mask keeps tokens up to and including the first EOS; truncated rows have no EOS."""
    is_eos = torch.isin(completion_ids, torch.tensor(eos_ids, device=completion_ids.device))
    T = completion_ids.shape[1]
    has_eos = is_eos.any(dim=1)
    first = torch.where(has_eos, is_eos.int().argmax(dim=1), torch.full_like(has_eos, T, dtype=torch.long))
    mask = torch.arange(T, device=completion_ids.device)[None, :] <= first[:, None]
    return mask, ~has_eos


def tokenize_prompts(tokenizer, texts: list[str], add_special_tokens: bool, max_prompt_length: int | None,
                     device: torch.device):
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=add_special_tokens)
    ids, mask = enc["input_ids"], enc["attention_mask"]
    if max_prompt_length is not None and ids.shape[1] > max_prompt_length:
        ids, mask = ids[:, -max_prompt_length:], mask[:, -max_prompt_length:]  # keep the end (left truncation)
    return ids.to(device), mask.to(device)


@torch.no_grad()
def generate_rollout(model, tokenizer, prompt_texts: list[str], rows: list[dict], settings: GenerationSettings,
                     eos_ids: list[int], reward_specs: list[RewardSpec], device: torch.device,
                     add_special_tokens: bool = True, autocast_dtype: torch.dtype | None = None) -> Rollout:
    """Generate ``settings.num_generations`` completions for each prompt and score them."""
    from transformers import GenerationConfig

    G = settings.num_generations
    prompt_ids, prompt_mask = tokenize_prompts(tokenizer, prompt_texts, add_special_tokens,
                                               settings.max_prompt_length, device)
    prompt_ids = prompt_ids.repeat_interleave(G, dim=0)
    prompt_mask = prompt_mask.repeat_interleave(G, dim=0)
    P = prompt_ids.shape[1]
    # Every sampling knob explicit: a checkpoint's generation_config (top_k=20, repetition_penalty...) must not
    # silently change the distribution the loss assumes (softmax(logits / temperature), optionally top-p).
    gen_config = GenerationConfig(
        do_sample=True, temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k,
        min_p=None, typical_p=1.0, repetition_penalty=1.0, no_repeat_ngram_size=0,
        max_new_tokens=settings.max_new_tokens, min_new_tokens=0, eos_token_id=eos_ids,
        pad_token_id=tokenizer.pad_token_id, use_cache=True)
    was_training = model.training
    model.eval()
    try:
        ctx = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype is not None \
            else contextlib.nullcontext()
        with ctx:
            sequences = model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen_config)
    finally:
        model.train(was_training)
    completion_ids = sequences[:, P:]
    if completion_ids.shape[1] == 0:  # nothing generated at all (max_new_tokens reached immediately)
        completion_ids = torch.full((sequences.shape[0], 1), tokenizer.pad_token_id, device=device)
        sequences = torch.cat([sequences, completion_ids], dim=1)
    completion_mask, truncated = completion_mask_after_eos(completion_ids, eos_ids)
    attention_mask = torch.cat([prompt_mask, completion_mask.long()], dim=1)

    completions = tokenizer.batch_decode(torch.where(completion_mask, completion_ids, tokenizer.pad_token_id),
                                         skip_special_tokens=True)
    expanded_prompts = [p for p in prompt_texts for _ in range(G)]
    expanded_rows = [r for r in rows for _ in range(G)]
    table = compute_rewards(reward_specs, expanded_prompts, completions, expanded_rows)
    rewards = torch.tensor(table, dtype=torch.float32)
    weights = torch.tensor([s.weight for s in reward_specs], dtype=torch.float32)
    unscorable = torch.isnan(rewards).all(dim=1)
    total = torch.nansum(rewards * weights, dim=1).masked_fill(unscorable, float("nan"))
    return Rollout(input_ids=sequences, attention_mask=attention_mask, prompt_length=P,
                   completion_ids=completion_ids, completion_mask=completion_mask, rewards=rewards,
                   reward_total=total, truncated=truncated.cpu(), prompts=expanded_prompts, completions=completions)

