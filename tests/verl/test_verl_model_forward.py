"""verl's own model forward on grpo_kernels: ``verl.models.transformers.dense_common.forward_with_triton_backend`` (the
FSDP engine's forward with ``use_fused_kernels=True``, ``fused_kernel_options.impl_backend=triton``) on a tiny
packed Qwen2 built here, against verl's torch backend (``forward_with_torch_backend``: ``FusedLinearForPPO``, chunks
of logits in the model's dtype) and float64 truth.

The batch is verl's remove-padding layout: three sequences packed into input_ids (1, total_nnz) with position_ids
restarting at 0 per sequence, labels the engine's ``input_ids_rmpad_rolled`` passed as ``shift_labels``. The hidden
states the head receives are captured (a forward hook on the backbone) and the truth is computed from them in
float64: log-probs, entropy, and the gradients of sum(a * log_probs + b * entropy) with respect to those hidden
states and ``lm_head.weight``; the three-way rule with plain PyTorch in the model's dtype and, in turn, verl's torch
backend as the middle term.
"""
from __future__ import annotations

import pytest
import torch

from ..support.tolerances import assert_three_way, grad_scale, naive_logprobs_entropy
from ..support.verl_env import require_verl

require_verl()
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from verl.models.transformers import dense_common  # noqa: E402

import grpo_kernels.verl as gk_verl  # noqa: E402
from grpo_kernels.reference import logprobs_and_entropy  # noqa: E402

SEQ_LENS = (7, 1, 12)  # a one-token sequence among them
VOCAB = 1003  # not a multiple of any tile
TEMPERATURE = 0.7


def tiny_qwen2(dtype):
    """A one-layer Qwen2 (untied head), randomly initialised from a seed: the same weights for every call."""
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         initializer_range=0.2, tie_word_embeddings=False, attn_implementation="sdpa")
    return Qwen2ForCausalLM(config).to(dtype)


def packed_batch(seed=0):
    """verl's remove-padding micro-batch: (1, total_nnz) ids, per-sequence position_ids, the rolled labels."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB, (1, sum(SEQ_LENS)), generator=g)
    position_ids = torch.cat([torch.arange(n) for n in SEQ_LENS]).unsqueeze(0)
    shift_labels = torch.roll(input_ids, shifts=-1, dims=-1)  # the engine's input_ids_rmpad_rolled
    n = input_ids.shape[1]
    a = torch.randn(n, generator=g)  # d loss / d log_probs
    b = 0.3 * torch.randn(n, generator=g)  # d loss / d entropy (an entropy bonus)
    return input_ids, position_ids, shift_labels, a, b


def run_forward(model, forward, batch, no_grad=False):
    """One call of a verl model forward as the engine makes it; returns (log_probs (N,), entropy (N,), the hidden
    states the head received (detached), d hidden, d lm_head.weight) for the loss sum(a logp + b entropy)."""
    input_ids, position_ids, shift_labels, a, b = batch
    captured = {}

    def keep(module, args, output):
        hidden = output.last_hidden_state
        if hidden.requires_grad:
            hidden.retain_grad()
        captured["hidden"] = hidden

    model.zero_grad(set_to_none=True)
    handle = model.model.register_forward_hook(keep)
    try:
        with torch.set_grad_enabled(not no_grad):
            out = forward(model, input_ids=input_ids, position_ids=position_ids, shift_labels=shift_labels,
                          temperature=TEMPERATURE, return_dict=True)
    finally:
        handle.remove()
    logp, entropy = out.log_probs.squeeze(0), out.entropy.squeeze(0)  # the engine's .squeeze(0)
    if no_grad:
        return logp, entropy, captured["hidden"], None, None
    ((a.to(logp.dtype) * logp).sum() + (b.to(entropy.dtype) * entropy).sum()).backward()
    hidden = captured["hidden"]
    return logp.detach(), entropy.detach(), hidden.detach(), hidden.grad, model.lm_head.weight.grad


def head_of(hidden, weight, labels, a, b, fn):
    """(logp, entropy, d hidden, d weight) of ``fn(logits, labels)`` on the given hidden states and head."""
    h = hidden.reshape(-1, hidden.shape[-1]).detach().clone().requires_grad_(True)
    w = weight.detach().clone().requires_grad_(True)
    logp, entropy = fn(h @ w.T, labels.reshape(-1))
    dh, dw = torch.autograd.grad((a.to(logp.dtype) * logp).sum() + (b.to(entropy.dtype) * entropy).sum(), (h, w))
    return logp.detach(), entropy.detach(), dh.reshape(hidden.shape), dw


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_forward_with_triton_backend_on_grpo_kernels(dtype, plans):
    """verl's Triton-backend forward runs ours (verl's own kernel cannot run on CPU tensors) and returns verl's
    layout: log_probs / entropy (total_nnz,) float32; each output and gradient passes the three-way rule against
    float64 truth with plain PyTorch in ``dtype`` and verl's torch backend as middle terms."""
    assert dense_common.__name__ and gk_verl.is_verl_patched()
    model = tiny_qwen2(dtype)
    batch = packed_batch()
    _, _, labels, a, b = batch
    ours = run_forward(model, dense_common.forward_with_triton_backend, batch)
    assert [p.op for p in plans] == ["linear_token_logprobs"]  # the head ran on grpo_kernels' planner, once
    verl_torch = run_forward(model, dense_common.forward_with_torch_backend, batch)
    n = sum(SEQ_LENS)
    assert ours[0].shape == ours[1].shape == (n,) and ours[0].dtype == ours[1].dtype == torch.float32
    assert torch.equal(ours[2], verl_torch[2])  # the same backbone, the same hidden states into both heads
    hidden, weight = ours[2], model.lm_head.weight
    truth = head_of(hidden.double(), weight.double(), labels, a.double(), b.double(),
                    lambda z, y: logprobs_and_entropy(z, y, TEMPERATURE))
    naive = head_of(hidden, weight, labels, a, b, lambda z, y: naive_logprobs_entropy(z, y, TEMPERATURE))
    got = (ours[0], ours[1], ours[3], ours[4])
    middles = {"plain torch in the model's dtype": naive,
               "verl's torch backend": (verl_torch[0], verl_torch[1], verl_torch[3], verl_torch[4])}
    for k, what in enumerate(("log_probs", "entropy", "d hidden", "d lm_head.weight")):
        for name, middle in middles.items():
            assert_three_way(got[k], middle[k], truth[k], dtype, f"{dtype} {what} (middle term: {name})",
                             scale=grad_scale(truth[k]) if k >= 2 else None)
    assert truth[2].abs().sum() > 0 and truth[3].abs().sum() > 0


def test_no_grad_forward_for_old_and_reference_logprobs():
    """The engine's compute_log_prob runs the same forward under no_grad: the no-grad path, the same values as the
    forward with gradients to float rounding (the three-way rule, fp32)."""
    model = tiny_qwen2(torch.float32)
    batch = packed_batch(seed=1)
    _, _, labels, a, b = batch
    logp, entropy, hidden, _, _ = run_forward(model, dense_common.forward_with_triton_backend, batch, no_grad=True)
    assert not logp.requires_grad and logp.shape == (sum(SEQ_LENS),)
    truth = head_of(hidden.double(), model.lm_head.weight.double(), labels, a.double(), b.double(),
                    lambda z, y: logprobs_and_entropy(z, y, TEMPERATURE))
    naive = head_of(hidden, model.lm_head.weight, labels, a, b, lambda z, y: naive_logprobs_entropy(z, y, TEMPERATURE))
    assert_three_way(logp, naive[0], truth[0], torch.float32, "no-grad log_probs")
    assert_three_way(entropy, naive[1], truth[1], torch.float32, "no-grad entropy")
