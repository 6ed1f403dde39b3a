"""Sampling a rollout: G completions per prompt, masks after EOS, rewards.

Rows are ordered group by group (the G completions of prompt i are rows i*G .. i*G+G-1), the layout
``grpo_kernels.group_advantages`` expects.

Sampling is a short loop over the model's backbone and head with a KV cache (no ``generate``): each prompt is run
once and its cache repeated G times, every knob is explicit (a checkpoint's generation_config cannot change the
distribution), and the tokens that are neither text nor EOS (pad, bos, unk, other special tokens, ids past the
tokenizer) are never sampled. The distribution a token is drawn from is therefore
``softmax(logits / temperature)`` restricted to the allowed ids (optionally truncated by top-k / top-p). The loss
scores tokens under the same restricted softmax: the policy adds ``SUPPRESSED_LOGIT`` to the suppressed ids'
logits (see ``grpo/policy.py``), so their probability is exactly 0 in both places and the normalizer is the
sampler's (with a soft-capped head the bias goes in before the cap: about 1e-13 of probability at Gemma 2's cap,
``grpo/policy.py``). Only top-k / top-p truncation is not modelled by the loss (as in TRL); both are off by default.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from .rewards import RewardSpec, compute_rewards

# Added to the logits of suppressed ids in the loss head. Finite on purpose: exp() of it underflows to exactly 0
# in fp32 (as -inf would), but p * logit stays 0 instead of NaN in the entropy.
SUPPRESSED_LOGIT = -1.0e4


@dataclass(frozen=True)
class GenerationSettings:
    num_generations: int
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_prompt_length: int | None = None


@dataclass
class Rollout:
    """One rank's batch of B = prompts x G completions (device tensors, CPU rewards)."""

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
    hidden: torch.Tensor | None = None  # (B, T, H) with its autograd graph, when sampled with keep_graph
    teacher_hidden: torch.Tensor | None = None  # (B, T, H_teacher), no graph: the teacher's pass (--teacher)

    @property
    def batch_size(self) -> int:
        return self.completion_ids.shape[0]

    @functools.cached_property
    def sequence_lengths(self) -> tuple[list[int], list[int]]:
        """(prompt tokens, completion tokens) per row, host ints read once (``grpo/packing.py``)."""
        from .packing import sequence_lengths

        return sequence_lengths(self.attention_mask, self.completion_mask, self.prompt_length)

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


def suppressed_token_ids(tokenizer, vocab_size: int, eos_ids: list[int], allowed_chars: str | None = None) -> list[int]:
    """Ids a completion may not contain: special tokens other than EOS (pad, bos, unk, chat markers, ...), the
    model's vocabulary rows past the tokenizer (padding of the embedding matrix, which decode to nothing), and,
    when ``allowed_chars`` is given, every token whose text uses another character (action masking: the answers
    of the task are known to be strings over that alphabet)."""
    eos = set(eos_ids)
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    ids = {int(i) for i in special if i is not None and 0 <= int(i) < vocab_size}
    ids.update(range(len(tokenizer), vocab_size))
    if allowed_chars is not None:
        allowed = set(allowed_chars)
        for i in range(min(len(tokenizer), vocab_size)):
            if i not in eos and i not in ids:
                text = tokenizer.decode([i], skip_special_tokens=False)
                if not text or not set(text) <= allowed:
                    ids.add(i)
    return sorted(ids - eos)


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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only, as ``generate`` does for left-padded prompts."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def next_tokens(logits: torch.Tensor, banned: torch.Tensor | None, temperature: float, top_k: int, top_p: float,
                greedy: bool) -> torch.Tensor:
    """(B,) ids drawn from softmax(logits / temperature) over the allowed ids (argmax when greedy)."""
    z = logits.float() / temperature
    if banned is not None:
        z[:, banned] = float("-inf")
    if greedy:
        return z.argmax(dim=-1)
    if 0 < top_k < z.shape[-1]:
        kth = z.topk(top_k, dim=-1).values[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if top_p < 1.0:  # smallest set of ids whose probability reaches top_p (the most likely id always stays)
        sorted_z, order = z.sort(dim=-1, descending=True)
        cum = sorted_z.softmax(dim=-1).cumsum(dim=-1)
        drop = cum - sorted_z.softmax(dim=-1) >= top_p
        z = z.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(z.softmax(dim=-1), 1).squeeze(-1)


def sample_completions(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, *, repeats: int,
                       max_new_tokens: int, eos_ids: list[int], pad_id: int, banned: torch.Tensor | None,
                       temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                       keep_graph: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(completion ids (B * repeats, T <= max_new_tokens), hidden (B * repeats, T, H) or None).

    Rows of one prompt are consecutive, pad after EOS. One forward of the backbone over the (unrepeated) prompts
    fills the KV cache, which is then repeated ``repeats`` times; each further forward feeds one token per row.
    Logits come from the head as the loss sees it (``get_lm_head``: ``cap * tanh(scale * (h @ W.T + b) / cap)``,
    folded as the loss folds it, ``fold_logit_scale``; no cap unless the model has one). Stops early once
    every row has emitted an EOS; under FSDP2 on several ranks (``synced_decoding``) a rank whose rows are done keeps
    running the backbone on pad tokens until every rank is done (its outputs unchanged), since each forward is a
    collective. ``keep_graph``: run the backbone with autograd on and return the final hidden
    states that predicted each completion token, so that the loss can backpropagate through this very forward
    instead of recomputing it (``hidden[:, t]`` predicts ``ids[:, t]``).
    """
    from grpo_kernels.integrations.transformers import fold_logit_scale, get_lm_head
    from grpo_kernels.reference import soft_cap

    device = prompt_ids.device
    backbone, head = model.base_model, get_lm_head(model)
    cache_arg = _cache_argument(backbone)
    # The logits at temperature 1 as the loss computes them: soft_cap(x, cap / s) / (1 / s) (= cap * tanh(s x / cap)).
    unit_temperature, softcap = fold_logit_scale(1.0, head.logit_scale, head.softcap)

    def logits_of(h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            z = soft_cap(torch.nn.functional.linear(h.detach(), head.weight, head.bias).float(), softcap)
            return z if unit_temperature == 1.0 else z / unit_temperature

    with torch.set_grad_enabled(keep_graph):
        positions = position_ids_from_mask(prompt_mask)
        out = backbone(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions, use_cache=True)
        cache, hidden = getattr(out, cache_arg), out.last_hidden_state[:, -1]
        if repeats > 1:
            cache.batch_repeat_interleave(repeats)
            hidden = hidden.repeat_interleave(repeats, dim=0)
        mask = prompt_mask.repeat_interleave(repeats, dim=0)
        position = positions[:, -1:].repeat_interleave(repeats, dim=0)
        eos = torch.tensor(eos_ids, device=device)
        rows = mask.shape[0]
        tokens = torch.full((rows, max_new_tokens), pad_id, dtype=torch.long, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        kept = [hidden] if keep_graph else None
        synced = synced_decoding(model)
        step, own_steps = 0, None  # own_steps: the step at which this rank's rows were all done
        while True:
            if own_steps is None:
                token = next_tokens(logits_of(hidden), banned, temperature, top_k, top_p, greedy)
                token = token.masked_fill(done, pad_id)
                tokens[:, step] = token
                done |= torch.isin(token, eos)
            step += 1
            if own_steps is None and (step == max_new_tokens or bool(done.all())):
                own_steps = step
            if step == max_new_tokens or not _any_rank_decoding(own_steps is None, synced, device):
                break
            # A finished rank keeps feeding pad (draws no random numbers, keeps nothing) while another rank decodes:
            # under FSDP every forward all-gathers each layer, a collective all ranks must join.
            if own_steps is not None:
                token = torch.full_like(token, pad_id)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            position = position + 1
            with torch.set_grad_enabled(keep_graph and own_steps is None):
                out = backbone(input_ids=token[:, None], attention_mask=mask, position_ids=position,
                               use_cache=True, **{cache_arg: cache})
            hidden = out.last_hidden_state[:, -1]
            if keep_graph and own_steps is None:
                kept.append(hidden)
    return tokens[:, :own_steps], torch.stack(kept, dim=1) if keep_graph else None


def synced_decoding(model) -> bool:
    """Whether the decoding loop must run in lockstep across ranks: ``model`` holds FSDP2 units (each forward
    all-gathers their parameters, a collective) and there is more than one rank."""
    import torch.distributed as dist

    from .sharding import is_fsdp

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(is_fsdp(m) for m in model.modules())


def _any_rank_decoding(decoding: bool, synced: bool, device: torch.device) -> bool:
    """``decoding`` of this rank, or-ed over all ranks when ``synced`` (one tiny all-reduce per decoding step,
    like transformers' ``synced_gpus``)."""
    if not synced:
        return decoding
    import torch.distributed as dist

    flag = torch.tensor([int(decoding)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _cache_argument(model) -> str:
    """The KV-cache keyword of this model's forward and output: ``cache`` (transformers >= 5.2x) or the older
    ``past_key_values``."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_completions(tokenizer, completion_ids: torch.Tensor, completion_mask: torch.Tensor,
                       truncated: torch.Tensor) -> list[str]:
    """The text each row emitted before its EOS. Special tokens are not skipped: whatever the policy produced
    (other than the final EOS) reaches the rewards."""
    lengths = (completion_mask.sum(dim=1) - (~truncated).long().to(completion_mask.device)).tolist()
    rows = completion_ids.tolist()
    return tokenizer.batch_decode([row[:n] for row, n in zip(rows, lengths)], skip_special_tokens=False)


class Sampler:
    """Turns prompts into scored rollouts (training, sampled) or scored greedy completions (evaluation)."""

    def __init__(self, model, tokenizer, settings: GenerationSettings, eos_ids: list[int], banned_ids: list[int],
                 reward_specs: list[RewardSpec], device: torch.device, add_special_tokens: bool = True,
                 autocast_dtype: torch.dtype | None = None):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.eos_ids, self.reward_specs, self.device = eos_ids, reward_specs, device
        self.banned = torch.tensor(banned_ids, dtype=torch.long, device=device) if banned_ids else None
        self.add_special_tokens, self.autocast_dtype = add_special_tokens, autocast_dtype
        self.weights = torch.tensor([s.weight for s in reward_specs], dtype=torch.float32)

    def rollout(self, prompt_texts: list[str], rows: list[dict], greedy: bool = False,
                keep_graph: bool = False) -> Rollout:
        """``num_generations`` sampled completions per prompt (one greedy completion when ``greedy``), scored.
        ``keep_graph``: also keep the final hidden states with their autograd graph (see sample_completions)."""
        s = self.settings
        repeats = 1 if greedy else s.num_generations
        prompt_ids, prompt_mask = tokenize_prompts(self.tokenizer, prompt_texts, self.add_special_tokens,
                                                   s.max_prompt_length, self.device)
        was_training = self.model.training
        self.model.eval()
        try:
            ctx = torch.autocast(self.device.type, dtype=self.autocast_dtype) if self.autocast_dtype is not None \
                else contextlib.nullcontext()
            with ctx:
                completion_ids, hidden = sample_completions(
                    self.model, prompt_ids, prompt_mask, repeats=repeats, max_new_tokens=s.max_new_tokens,
                    eos_ids=self.eos_ids, pad_id=self.tokenizer.pad_token_id, banned=self.banned,
                    temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, greedy=greedy, keep_graph=keep_graph)
        finally:
            self.model.train(was_training)
        prompt_ids = prompt_ids.repeat_interleave(repeats, dim=0)
        prompt_mask = prompt_mask.repeat_interleave(repeats, dim=0)
        completion_mask, truncated = completion_mask_after_eos(completion_ids, self.eos_ids)
        completions = decode_completions(self.tokenizer, completion_ids, completion_mask, truncated)
        truncated = truncated.cpu()
        expanded_prompts = [p for p in prompt_texts for _ in range(repeats)]
        expanded_rows = [r for r in rows for _ in range(repeats)]
        table = compute_rewards(self.reward_specs, expanded_prompts, completions, expanded_rows,
                                truncated=truncated.tolist())
        rewards = torch.tensor(table, dtype=torch.float32)
        unscorable = torch.isnan(rewards).all(dim=1)
        total = torch.nansum(rewards * self.weights, dim=1).masked_fill(unscorable, float("nan"))
        return Rollout(input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
                       attention_mask=torch.cat([prompt_mask, completion_mask.long()], dim=1),
                       prompt_length=prompt_ids.shape[1], completion_ids=completion_ids,
                       completion_mask=completion_mask, rewards=rewards, reward_total=total, truncated=truncated,
                       prompts=expanded_prompts, completions=completions, hidden=hidden)
