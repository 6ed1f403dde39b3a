"""OpenRLHF ``Actor``s as OpenRLHF builds them, their batches and the calls its trainers make, for tests/openrlhf/ and
benchmarks/openrlhf_memory.py (in .venv-openrlhf).

``build_actor`` saves a tiny seeded model (no hub) and loads it with ``openrlhf.models.Actor(path, ...)``, the way
OpenRLHF's launchers do (``from_pretrained`` in bf16, ``use_cache=False``, ``output_router_logits`` for MoE, LoRA
through ``lora_rank``); OpenRLHF loads bf16 / fp16 only, so an fp32 actor is the loaded one cast with ``.float()``.
``CALLS`` are the trainers' calls of ``Actor.forward`` (ppo_actor's training step, the old / reference log-probs,
SFT's training step, DPO's reference pass). ``run_call`` runs one of them through a given forward (the patched
``actor(...)`` or OpenRLHF's own ``stock_forward``) and returns what the trainer reads plus the hidden states the
head received (a forward hook on the backbone) and the gradients of a weighted sum of the results with respect to
those hidden states and ``lm_head.weight``; ``float64_truth`` computes the same from those hidden states in float64.
"""
from __future__ import annotations

import dataclasses

import torch

from grpo_kernels.reference import logprobs_and_entropy

VOCAB, HIDDEN = 131, 16  # a vocabulary that is no multiple of any tile
TEMPERATURE = 0.7


def tiny_model(kind: str = "llama", vocab_size: int = VOCAB, hidden_size: int = HIDDEN, layers: int = 1):
    """A seeded tiny ``LlamaForCausalLM`` (untied head) or ``MixtralForCausalLM`` (2 experts: MoE aux loss)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2,
                  tie_word_embeddings=False, max_position_embeddings=2048)
    if kind == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**common, num_local_experts=2, num_experts_per_tok=1,
                                                output_router_logits=False))
    return LlamaForCausalLM(LlamaConfig(**common))


def build_actor(folder, kind="llama", dtype=torch.float32, packing=False, temperature=TEMPERATURE, lora_rank=0,
                **model_kwargs):
    """``openrlhf.models.Actor`` loaded from a tiny model saved in ``folder`` (sdpa attention), in ``dtype``."""
    from openrlhf.models import Actor

    path = folder / f"{kind}-{model_kwargs.get('vocab_size', VOCAB)}"
    if not path.exists():
        tiny_model(kind, **model_kwargs).save_pretrained(path)
    param_dtype = "fp16" if dtype == torch.float16 else "bf16"
    actor = Actor(str(path), attn_implementation="sdpa", param_dtype=param_dtype, packing_samples=packing,
                  temperature=temperature, lora_rank=lora_rank, target_modules=["q_proj", "v_proj"] if lora_rank
                  else None)
    if dtype == torch.float32:
        actor = actor.float()
    return actor


@dataclasses.dataclass(frozen=True)
class Batch:
    """OpenRLHF's experience layout: prompts left-padded, completions right-padded, ``action_mask`` (B, A) the
    completion tokens up to their end."""

    sequences: torch.Tensor  # (B, T)
    attention_mask: torch.Tensor  # (B, T)
    action_mask: torch.Tensor  # (B, A)


def make_batch(batch=3, prompt=6, completion=5, vocab=VOCAB, seed=0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    seqlen = prompt + completion
    sequences = torch.randint(0, vocab, (batch, seqlen), generator=g)
    attention_mask = torch.ones(batch, seqlen, dtype=torch.long)
    for row in range(batch):
        left = row % 3  # 0, 1, 2 prompt pads
        right = (2 * row) % completion  # completions of different lengths
        attention_mask[row, :left] = 0
        if right:
            attention_mask[row, seqlen - right:] = 0
    sequences = sequences.masked_fill(attention_mask == 0, 0)
    action_mask = attention_mask[:, prompt:].bool()
    return Batch(sequences, attention_mask, action_mask)


@dataclasses.dataclass(frozen=True)
class Call:
    """One way OpenRLHF's trainers call ``Actor.forward``."""

    name: str
    actions: bool  # passes action_mask (else return_logprobs=True)
    entropy: bool  # return_entropy (ppo_actor with --actor.entropy_coef)
    grad: bool  # a training step (else under torch.no_grad())


CALLS = {
    "policy": Call("policy", actions=True, entropy=True, grad=True),  # ppo_actor.training_step
    "old_or_reference": Call("old_or_reference", actions=True, entropy=False, grad=False),  # launcher / ppo_actor
    "sft": Call("sft", actions=False, entropy=False, grad=True),  # SFTTrainer.fit
    "dpo_reference": Call("dpo_reference", actions=False, entropy=False, grad=False),  # DPOTrainer's ref model
}


@dataclasses.dataclass
class Result:
    logp: torch.Tensor  # what the call returns: (B, A) or (B, T - 1)
    entropy: torch.Tensor | None  # output.entropy[:, -A:] * action_mask: where ppo_actor reads it
    hidden: torch.Tensor  # the backbone's output the head received (detached)
    d_hidden: torch.Tensor | None
    d_weight: torch.Tensor | None
    output: object


def _weights(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), 0.3 * torch.randn(shape, generator=g)


def patched_forward(actor, *args, **kwargs):
    """The Actor's own ``forward`` (grpo_kernels.openrlhf's once patched): ``run_call``'s ``forward`` for ours."""
    return actor(*args, **kwargs)


def run_call(actor, forward, batch: Batch, call: Call) -> Result:
    """``forward(actor, ...)`` as the trainer calls it; the gradients of sum(a * logp + b * entropy read)."""
    from grpo_kernels.integrations.openrlhf import _unwrap

    lm = _unwrap(actor.model)
    kept = []

    def keep(module, args, out):
        hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
        if hidden.requires_grad:
            hidden.retain_grad()
        kept.append(hidden)

    handle = lm.base_model.register_forward_hook(keep)
    weight = lm.get_output_embeddings().weight
    weight.grad = None
    kwargs = dict(attention_mask=batch.attention_mask, return_output=True)
    if call.actions:
        args = (batch.sequences, batch.action_mask)
        kwargs["return_entropy"] = call.entropy
    else:
        args = (batch.sequences,)
        kwargs["return_logprobs"] = True
    try:
        with torch.set_grad_enabled(call.grad):
            logp, output = forward(actor, *args, **kwargs)
    finally:
        handle.remove()
    entropy = None
    if call.entropy:
        entropy = output.entropy[:, -batch.action_mask.shape[1]:] * batch.action_mask
    d_hidden = d_weight = None
    if call.grad:
        a, b = _weights(logp.shape, seed=7)
        loss = (a * logp).sum() + ((b * entropy).sum() if entropy is not None else 0.0)
        loss.backward()
        d_hidden = kept[-1].grad
        d_weight = None if weight.grad is None else weight.grad.clone()
    return Result(logp.detach(), None if entropy is None else entropy.detach(), kept[-1].detach(), d_hidden,
                  d_weight, output)


def padded_hidden(hidden: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The (B, T, H) grid of hidden states; a packed (1, N, H) row is scattered back (zeros at padding)."""
    bsz, seqlen = batch.sequences.shape
    if hidden.shape[:2] == (bsz, seqlen):
        return hidden
    grid = hidden.new_zeros(bsz * seqlen, hidden.shape[-1])
    grid[batch.attention_mask.flatten().nonzero().flatten()] = hidden[0]
    return grid.reshape(bsz, seqlen, -1)


def float64_truth(actor, batch: Batch, call: Call, result: Result, rounding=None, temperature=TEMPERATURE):
    """(logp, entropy read, d hidden, d weight) of ``call`` in float64 from the hidden states ``result`` holds,
    shaped as ``result``'s (d hidden in its packed or padded layout)."""
    from grpo_kernels.integrations.openrlhf import _unwrap

    lm = _unwrap(actor.model)
    packed = result.hidden.shape[:2] != batch.sequences.shape
    h64 = result.hidden.double().requires_grad_(True)
    w64 = lm.get_output_embeddings().weight.detach().double().requires_grad_(True)
    grid = padded_hidden(h64, batch)
    logp, entropy = logprobs_and_entropy(grid[:, :-1] @ w64.T, batch.sequences[:, 1:], temperature, None, rounding)
    if packed:  # OpenRLHF's packed results are 0 where there is no token
        real = batch.attention_mask[:, :-1].bool()
        logp, entropy = logp * real, entropy * real
    if call.actions:
        actions = batch.action_mask.shape[1]
        logp = logp[:, -actions:] * batch.action_mask
        entropy = entropy[:, -actions:] * batch.action_mask
    entropy = entropy if call.entropy else None
    d_hidden = d_weight = None
    if call.grad:
        a, b = _weights(logp.shape, seed=7)
        loss = (a.double() * logp).sum() + ((b.double() * entropy).sum() if entropy is not None else 0.0)
        d_hidden, d_weight = torch.autograd.grad(loss, (h64, w64))
    return logp.detach(), None if entropy is None else entropy.detach(), d_hidden, d_weight
