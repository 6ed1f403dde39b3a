"""Packed rows through every model family of docs/api.md's Models list (tiny random configs, float64): the per-token
log-probs of packed rows equal the padded batch's, and so do the policy's GRPO loss, its metrics and the gradient of
every parameter; for sdpa and eager attention, rows of the longest length and one row (the varlen layout). With CUDA
and flash-attn, the varlen path (flash_attention_2) is checked by the three-way rule."""
from __future__ import annotations

import importlib.util

import pytest
import torch

import grpo_kernels as gk
from grpo.packing import Packing, is_varlen, pack_rows, packing_unsupported
from grpo.policy import GRPOPolicy
from grpo.update import rollout_logprobs, trim

from ..support.tolerances import ATOL, K, U, same_maths_slack
from .packing_cases import COMPLETIONS, FAMILIES, PROMPTS, ragged_rollout, tiny_model

ATTENTION = ("sdpa", "eager")
# Packed and padded rows run the same maths; only the order of their sums differs (attention over a row's keys,
# the loss's sums over tokens), so the two agree within tests/support/tolerances.py's same_maths_slack of the
# precision the sums run in, relative to max(1, max |value|): float64 for these float64 models, float32 where
# transformers computes in float32 whatever the model's dtype: eager attention takes its softmax in float32;
# Gemma's RMSNorm scales by (1 + weight) in float32, so its weights' gradients are float32 sums over the tokens.
FLOAT64, FLOAT32 = same_maths_slack(torch.float64), same_maths_slack(torch.float32)
FLOAT32_NORM_WEIGHTS = ("gemma2", "gemma3")


def assert_equal_within(got, want, allowance, what=""):
    scale = max(1.0, want.abs().max().item())
    err = (got.double() - want.double()).abs().max().item() / scale
    assert err <= allowance, f"{what}: relative error {err:.2e} > {allowance:.1e}"


def _allowance(name, attn, gradient=False):
    return FLOAT32 if attn == "eager" or (gradient and name in FLOAT32_NORM_WEIGHTS) else FLOAT64


def _model_or_skip(name, attn, dtype=torch.float64):
    try:
        return tiny_model(name, attn, dtype)
    except (ValueError, ImportError) as exc:  # a family without this attention kernel
        pytest.skip(f"{name} with {attn}: {exc}")


def alone_hidden(policy, rollout) -> torch.Tensor:
    """(B, T, H) hidden states predicting each completion token, every sequence run alone (no padding, no
    packing; 0 past its length): the ground truth both layouts must reproduce."""
    P, (prompt, completion) = rollout.prompt_length, rollout.sequence_lengths
    out = None
    for b, (p, c) in enumerate(zip(prompt, completion)):
        ids = rollout.input_ids[b:b + 1, P - p:P + c - 1]
        h = policy.lm.base_model(input_ids=ids, use_cache=False).last_hidden_state[0, p - 1:]
        if out is None:
            out = h.new_zeros(rollout.batch_size, rollout.completion_ids.shape[1], h.shape[-1])
        out = out.index_put((torch.full((c,), b), torch.arange(c)), h)
    return out


@pytest.mark.parametrize("attn", ATTENTION)
@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_rows_give_the_padded_log_probs(name, attn):
    """Hidden states and log-probs of packed rows equal each sequence's alone and the padded batch's (float64
    models; eager within its float32 softmax's allowance).
    The padded batch is transformers' under sdpa; under eager its float64 left padding gives NaN (eager's float32
    softmax turns the float64 mask's minimum into -inf), so there the batch is assembled from the sequences run
    alone, which is what padding computes."""
    lm = _model_or_skip(name, attn)
    assert packing_unsupported(lm) is None
    policy = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=0.8), impl="torch")
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    mask = rollout.completion_mask
    with torch.no_grad():
        truth = alone_hidden(policy, rollout)
        padded_batch = rollout.batch()
        want = policy.token_logprobs(padded_batch, hidden=None if attn == "sdpa" else truth)  # float64 (B, T)
        if attn == "sdpa":
            padded_hidden = policy.completion_hidden(rollout.input_ids, rollout.attention_mask, rollout.prompt_length)
            assert_equal_within(padded_hidden * mask[..., None], truth, FLOAT64, "padded hidden")
    padded = rollout_logprobs(policy, rollout, micro_batch_size=3) if attn == "sdpa" else want.float()
    for packing in (Packing(), Packing(max_tokens=9), Packing(one_row=True)):
        batch = pack_rows(rollout, list(range(8)), packing.one_row)
        with torch.no_grad():
            hidden = policy.packed_hidden(batch)
            got = policy.token_logprobs({"packed": batch})
        assert_equal_within(hidden, truth[batch.token_rows, batch.token_cols], _allowance(name, attn), "hidden")
        assert got.dtype == torch.float64
        want_packed = want[batch.token_rows, batch.token_cols] * batch.completion_mask
        assert_equal_within(got, want_packed, _allowance(name, attn), "logp")
        # the trainer's pass over micro-batches (here also cut by a token budget) puts each one back in its place
        stored = rollout_logprobs(policy, rollout, micro_batch_size=8, packing=packing)
        assert stored.dtype == torch.float32 and (stored[~mask] == 0).all()
        allowance = _allowance(name, attn) * max(1.0, padded.abs().max().item())
        # bound: fp32 copies of float64 values within the allowance of each other: the two roundings to fp32 add at
        #   most one fp32 ulp (2 u relative)
        torch.testing.assert_close(stored, padded * mask, rtol=2 * U[torch.float32], atol=allowance)


def _loss_and_grads(policy, batch, hidden=None):
    policy.zero_grad(set_to_none=True)
    loss, metrics = policy(batch, hidden=hidden() if hidden is not None else None)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
    return loss.detach(), {k: v.detach() for k, v in metrics.items()}, grads


# each family's default attention (sdpa; eager for Gemma 2, which has no sdpa kernel); the log-prob test covers both
DEFAULT_ATTENTION = {name: "eager" if name == "gemma2" else "sdpa" for name in FAMILIES}


@pytest.mark.parametrize("name, attn", list(DEFAULT_ATTENTION.items()))
def test_packed_loss_and_gradients_equal_the_padded_ones(name, attn):
    """The policy's GRPO loss (grpo: per-sequence means, beta > 0, old log-probs), its metrics and every
    parameter's gradient on packed rows equal the padded batch's (float64 models, within the allowances above; the
    batch assembled from the sequences alone under eager, see above)."""
    lm = _model_or_skip(name, attn)
    cfg = gk.GRPOLossConfig(loss_type="grpo", beta=0.05, temperature=0.8, max_completion_length=12)
    policy = GRPOPolicy(lm.train(), cfg, impl="torch")
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    g = torch.Generator().manual_seed(5)
    adv = torch.randn(8, generator=g, dtype=torch.float64)
    with torch.no_grad():
        logp = policy.token_logprobs(rollout.batch(), hidden=alone_hidden(policy, rollout)).double()
    old = (logp + 0.05 * torch.randn(logp.shape, generator=g, dtype=torch.float64)) * rollout.completion_mask
    ref = (logp - 0.05 * torch.randn(logp.shape, generator=g, dtype=torch.float64)) * rollout.completion_mask
    padded = trim(rollout.batch(advantages=adv, old_logps=old, ref_logps=ref))
    hidden = None if attn == "sdpa" else (lambda: alone_hidden(policy, rollout))
    want_loss, want_metrics, want_grads = _loss_and_grads(policy, padded, hidden)
    for one_row in (False, True):
        packed = pack_rows(rollout, list(range(8)), one_row)
        batch = {"packed": packed, "advantages": adv, "old_logps": packed.gather(old), "ref_logps": packed.gather(ref)}
        loss, metrics, grads = _loss_and_grads(policy, batch)
        assert_equal_within(loss, want_loss, _allowance(name, attn), "loss")
        assert metrics.keys() == want_metrics.keys()
        for k in metrics:
            assert_equal_within(metrics[k], want_metrics[k], _allowance(name, attn), k)
        assert grads.keys() == want_grads.keys() and len(grads) > 5
        for n in grads:
            assert_equal_within(grads[n], want_grads[n], _allowance(name, attn, gradient=True), n)


def test_packing_is_refused_where_transformers_cannot_pack():
    lm = tiny_model("llama", "sdpa")
    lm.config._attn_implementation = "my_custom_kernel"
    assert "attention implementation 'my_custom_kernel' is not one of" in packing_unsupported(lm)
    lm = tiny_model("llama", "sdpa")
    lm.config.layer_types = ["full_attention", "linear_attention"]
    assert packing_unsupported(lm) == "layer types linear_attention are not attention layers"
    lm.config.layer_types = ["full_attention", "sliding_attention"]
    assert packing_unsupported(lm) is None and not is_varlen(lm)


CUDA_FLASH = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA_FLASH, reason="needs CUDA and flash_attn (flash_attention_2's varlen kernels)")
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3"])
def test_flash_attention_varlen_rows_on_cuda(name):
    """One packed row through flash_attention_2's varlen kernels (cu_seq_lens from grpo/packing.py), bf16: its
    hidden states' error against float64 sdpa (each sequence alone) is at most twice that of the padded bf16 sdpa
    batch (what --no-packing runs), plus the bf16 ATOL of the three-way rule (relative to max(1, max |value|))."""
    truth_lm = tiny_model(name, "sdpa", torch.float64).cuda()
    flash_lm = tiny_model(name, "flash_attention_2", torch.bfloat16).cuda()
    naive_lm = tiny_model(name, "sdpa", torch.bfloat16).cuda()
    assert is_varlen(flash_lm) and packing_unsupported(flash_lm) is None
    rollout = ragged_rollout(PROMPTS, COMPLETIONS, device="cuda")
    batch = pack_rows(rollout, list(range(8)), one_row=True)
    cfg = gk.GRPOLossConfig()
    with torch.no_grad():
        truth = alone_hidden(GRPOPolicy(truth_lm, cfg), rollout)[batch.token_rows, batch.token_cols]
        naive = GRPOPolicy(naive_lm, cfg).completion_hidden(rollout.input_ids, rollout.attention_mask,
                                                             rollout.prompt_length)
        naive = naive[batch.token_rows, batch.token_cols].double()
        flash = GRPOPolicy(flash_lm, cfg).packed_hidden(batch).double()
    scale = max(1.0, truth.abs().max().item())
    err_naive, err_flash = [(x - truth).abs().max().item() / scale for x in (naive, flash)]
    assert err_flash <= K * err_naive + ATOL[torch.bfloat16], (err_flash, err_naive)
