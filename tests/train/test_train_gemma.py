"""``grpo.train`` on a soft-capped model (Gemma 2: ``final_logit_softcapping``, 30 by default): the policy's loss
and log-probs, and the sampler's logits, apply the model's cap (folded with a logit scale as TRL orders them:
``cap * tanh(scale * x / cap) / T``), and a local Gemma 2 checkpoint trains end to end through ``--model``.

The soft cap is read from the model's config, never from a flag (``grpo/cli.py`` ``FROM_MODEL``). The tiny models'
raw logits are ~1, so the head weight is scaled until they reach ~2x the cap: the cap changes the answer.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch

import grpo_kernels as gk
from grpo import rollout as grpo_rollout
from grpo import train
from grpo.data import PRINTABLE_ASCII
from grpo.errors import UsageError
from grpo.modeling import build_char_tokenizer
from grpo.policy import GRPOPolicy
from grpo.rollout import position_ids_from_mask, sample_completions, suppressed_token_ids, tokenize_prompts
from grpo_kernels.reference import reference_grpo_loss

from ..support.tolerances import assert_same_maths, assert_three_way, grad_scale

CAP = 30.0  # Gemma 2's default


def _gemma(tok, logit_scale: float = 1.0, dtype=torch.float64):
    """A tiny random Gemma 2 (tied head, as Gemma's) whose raw logits reach ~2x the cap (after the logit scale)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    config = Gemma2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                          tie_word_embeddings=False, attn_implementation="eager")
    assert config.final_logit_softcapping == CAP
    if logit_scale != 1.0:
        config.logit_scale = logit_scale  # read by get_lm_head as TRL reads it; Gemma 2's own forward has none
    lm = Gemma2ForCausalLM(config).to(dtype).eval()
    with torch.no_grad():
        raw = lm.lm_head(lm.model(input_ids=torch.arange(4, len(tok))[None]).last_hidden_state)
        lm.lm_head.weight.mul_(CAP / (logit_scale * raw.std()))
    return lm


def _capped_logits(lm, input_ids, attention_mask, logit_scale):
    """cap * tanh(scale * x / cap) from the backbone and the head, outside the policy (the expected values)."""
    hidden = lm.model(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids_from_mask(attention_mask)).last_hidden_state
    return CAP * torch.tanh(logit_scale * lm.lm_head(hidden) / CAP)


def _batch(tok, banned):
    # prompts of one length: in float64, Gemma 2's eager attention gives NaN on fully masked (left-pad) query rows,
    # which no loss uses but whose NaN would reach the backbone's gradients
    ids, mask = tokenize_prompts(tok, ["ab=", "co=", "he="], True, None, torch.device("cpu"))
    g = torch.Generator().manual_seed(3)
    allowed = torch.tensor(sorted(set(range(4, len(tok))) - set(banned)))
    comp = allowed[torch.randint(0, len(allowed), (3, 5), generator=g)]
    cmask = torch.ones(3, 5, dtype=torch.bool)
    cmask[1, 3:] = False
    seq, attn = torch.cat([ids, comp], 1), torch.cat([mask, cmask.long()], 1)
    return {"input_ids": seq, "attention_mask": attn, "prompt_length": ids.shape[1], "completion_ids": comp,
            "completion_mask": cmask, "advantages": torch.tensor([1.0, -0.5, 0.25], dtype=torch.float64)}


@pytest.mark.parametrize("logit_scale", [1.0, 0.5])
def test_policy_loss_and_logprobs_apply_the_models_soft_cap(logit_scale):
    """The policy's loss config carries the folded cap: its log-probs (restricted to the allowed ids) and its loss
    and head / embedding gradients equal the reference loss on the capped logits, in float64."""
    tok = build_char_tokenizer("abcdefghlo=")
    lm = _gemma(tok, logit_scale)
    banned = suppressed_token_ids(tok, lm.config.vocab_size, [tok.eos_token_id])
    batch = _batch(tok, banned)
    config = gk.GRPOLossConfig(temperature=0.7, beta=0.0)
    policy = GRPOPolicy(lm, config, impl="torch", banned_ids=banned)
    assert (policy.loss_config.softcap, policy.loss_config.temperature) == (CAP / logit_scale, 0.7 / logit_scale)

    P = batch["prompt_length"]
    logits = _capped_logits(lm, batch["input_ids"], batch["attention_mask"], logit_scale)[:, P - 1:-1]
    if logit_scale == 1.0:  # the expected values are the model's own logits
        own = lm(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 position_ids=position_ids_from_mask(batch["attention_mask"])).logits[:, P - 1:-1]
        assert_same_maths(own, logits, torch.float64, "the model's own logits")  # float64, the same ops
    restricted = logits.clone()
    restricted[..., banned] = float("-inf")  # the sampler's support
    # bound: not a tolerance: raw logits beyond 0.9 c: the cap bends the distribution
    assert logits.abs().max() > 0.9 * CAP

    params = [lm.lm_head.weight, lm.get_input_embeddings().weight]
    loss, _ = policy(batch)
    ours = torch.autograd.grad(loss, params)
    expected, _ = reference_grpo_loss(restricted, batch["completion_ids"], batch["advantages"],
                                      mask=batch["completion_mask"], config=config)
    truth = torch.autograd.grad(expected, params)
    # Suppressed ids are capped to -cap inside the loss (not -inf, grpo/policy.py): their relative mass is at most
    # n * exp(-(cap + z_max) / T), ~1e-37 here (z_max ~ cap).
    # Otherwise float64 rounding of the same maths in another order (same_maths_slack, gradients relative to their
    # largest value), far below any real difference.
    assert_same_maths(loss, expected, torch.float64, "loss")
    for got, want, what in zip(ours, truth, ("lm_head.weight", "embed_tokens.weight")):
        assert want.abs().max() > 1e-4, what  # bound: not a tolerance: an informative gradient
        assert_same_maths(got, want, torch.float64, what, scale=grad_scale(want))

    logp = policy.token_logprobs(batch)
    want = (restricted / 0.7).log_softmax(-1).gather(-1, batch["completion_ids"][..., None]).squeeze(-1)
    assert_same_maths(logp[batch["completion_mask"]], want[batch["completion_mask"]], torch.float64, "log-probs")
    uncapped = (logit_scale * lm.lm_head(lm.model(input_ids=batch["input_ids"]).last_hidden_state))[:, P - 1:-1]
    assert (uncapped - logits).abs().max() > 1.0


def test_sampler_logits_apply_the_soft_cap(monkeypatch):
    """The logits the sampler draws from are the capped ones (cap * tanh(scale * x / cap), before the temperature)."""
    tok = build_char_tokenizer("abcdefghlo=")
    lm = _gemma(tok, 0.5, dtype=torch.float32)
    seen = []
    real = grpo_rollout.next_tokens
    monkeypatch.setattr(grpo_rollout, "next_tokens",
                        lambda logits, *a, **k: seen.append(logits) or real(logits, *a, **k))
    ids, mask = tokenize_prompts(tok, ["ab=", "hello="], True, None, torch.device("cpu"))
    sample_completions(lm, ids, mask, repeats=1, max_new_tokens=1, eos_ids=[tok.eos_token_id],
                       pad_id=tok.pad_token_id, banned=None, temperature=0.7)
    with torch.no_grad():
        expected = _capped_logits(lm, ids, mask, 0.5)[:, -1]
    assert expected.abs().max() > 0.9 * CAP  # bound: not a tolerance: logits reach the cap's bend
    # three-way: the truth the same capped logits from a float64 copy of the model, the middle term the fp32 full
    # forward (expected); the sampler's are from generate's incremental fp32 forward
    with torch.no_grad():
        truth = _capped_logits(copy.deepcopy(lm).double(), ids, mask, 0.5)[:, -1]
    assert_three_way(seen[0], expected, truth, torch.float32, "sampler logits")


def test_loss_softcap_must_be_the_models():
    tok = build_char_tokenizer("abc=")
    lm = _gemma(tok, dtype=torch.float32)
    GRPOPolicy(lm, gk.GRPOLossConfig(softcap=CAP))  # the model's own value: accepted
    with pytest.raises(UsageError, match="loss softcap=5.0 differs from the model's final_logit_softcapping=30.0"):
        GRPOPolicy(lm, gk.GRPOLossConfig(softcap=5.0))


def test_grpo_train_on_a_local_gemma2_checkpoint(tmp_path, capsys):
    """--model PATH with a saved tiny Gemma 2 (soft cap 30) and its character tokenizer: a 2-step run finishes with
    finite losses, and there is no soft-cap flag (a property of the model). transformers' Gemma 2 has no sdpa
    attention (its attention logits are soft-capped too): the default --attn-implementation auto leaves the choice to
    transformers (eager here) instead of asking for sdpa."""
    tok = build_char_tokenizer(PRINTABLE_ASCII)
    lm = _gemma(tok, dtype=torch.float32)
    model_dir, data, out = tmp_path / "gemma2", tmp_path / "copy.jsonl", tmp_path / "run"
    lm.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    data.write_text("".join(json.dumps({"prompt": f"{w}=", "answer": w}) + "\n"
                            for w in ("ab", "ba", "abc", "cab", "bb", "ca")))
    assert train.main(["--model", str(model_dir), "--dataset", str(data), "--reward", "copy", "--max-steps", "2",
                       "--max-new-tokens", "4", "--prompts-per-step", "2", "-G", "4", "--no-progress",
                       "--output-dir", str(out)]) == 0
    with open(out / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows)
    capsys.readouterr()
    assert train.main(["--softcap", "30"]) == 2
    assert "unrecognized arguments: --softcap 30" in capsys.readouterr().err
