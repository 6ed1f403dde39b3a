"""Tests of the pieces of the standalone trainer ``python -m grpo.train`` (grpo/): alignment of hidden states with
sampled tokens, the sampler's restricted distribution against the loss's, rewards, the prompt sampler, the fused
head check, local checkpoints. Whole runs (learning, resume, torchrun, run folders, errors): test_train_runs.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from grpo import train
from grpo.data import PRINTABLE_ASCII, PromptSampler, builtin_copy_task, load_jsonl, split_eval
from grpo.errors import UsageError
from grpo.modeling import build_char_tokenizer, build_tiny_model
from grpo.policy import GRPOPolicy
from grpo.rewards import (compute_rewards, copy_reward, extract_answer, format_reward, math_reward,
                          parse_number, parse_reward_spec)
from grpo.rollout import (completion_mask_after_eos, decode_completions, sample_completions,
                          suppressed_token_ids, tokenize_prompts)
from grpo.update import trim

import grpo_kernels as gk

from ..support.tolerances import assert_three_way, grad_scale
from ..support.train_runs import SMALL, read_metrics, save_tiny_chat_checkpoint


def _logprobs64(lm, seq, attn, P, temperature, comp, banned=None):
    """The ground truth of the three-way rule for the policy's log-probs: a float64 copy of the model, full forward
    with positions over the real tokens (as generate counts them), logits / temperature (banned ids -inf)."""
    import copy

    from grpo.rollout import position_ids_from_mask

    lm64 = copy.deepcopy(lm).double()
    with torch.no_grad():
        logits = lm64(input_ids=seq, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits
    logits = logits[:, P - 1:-1] / temperature
    if banned is not None:
        logits[..., banned] = float("-inf")
    return logits.log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)


# ------------------------------------------------------------------------------------------------- pieces
def test_hidden_states_aligned_with_sampled_tokens():
    """The loss path (decoder body -> hidden[:, P-1:-1] -> fused head) scores each sampled token with exactly the
    distribution generate() sampled it from: left-padded prompts of different lengths, EOS masking, trimming."""
    from transformers import GenerationConfig

    torch.manual_seed(0)
    tok = build_char_tokenizer("abcdefgh=")
    lm = build_tiny_model(tok).eval()
    prompts = ["a=", "bcd=", "hh=", "efgh="]
    ids, mask = tokenize_prompts(tok, prompts, True, None, torch.device("cpu"))
    assert (mask == 0).any(), "prompts should be left-padded"
    temperature = 0.7
    gen = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=6,
                           eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)
    out = lm.generate(input_ids=ids, attention_mask=mask, generation_config=gen, output_scores=True,
                      return_dict_in_generate=True)
    P = ids.shape[1]
    comp = out.sequences[:, P:]
    cmask, _ = completion_mask_after_eos(comp, [tok.eos_token_id])
    sampled = torch.stack(out.scores, 1).log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    policy = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=temperature))
    batch = {"input_ids": out.sequences, "attention_mask": torch.cat([mask, cmask.long()], 1), "prompt_length": P,
             "completion_ids": comp, "completion_mask": cmask}
    # three-way: the truth a float64 copy of the model; the middle term generate's own fp32 scores (the
    # distribution each token was sampled from); a misaligned position would be off by O(1)
    truth = _logprobs64(lm, out.sequences, batch["attention_mask"], P, temperature, comp)
    for b in (batch, trim(batch)):
        logp = policy.token_logprobs(b)
        T = logp.shape[1]
        keep = cmask[:, :T]
        assert_three_way(logp[keep], sampled[:, :T][keep], truth[:, :T][keep], torch.float32, "logp")


def test_completion_mask_stops_after_first_eos():
    ids = torch.tensor([[5, 1, 7, 1], [5, 6, 7, 8], [1, 0, 0, 0]])
    mask, truncated = completion_mask_after_eos(ids, [1])
    assert mask.tolist() == [[True, True, False, False], [True] * 4, [True, False, False, False]]
    assert truncated.tolist() == [False, True, False]


def test_rewards_parsing_and_specs():
    assert extract_answer(r"so \boxed{\frac{1}{2}} and 7") == r"\frac{1}{2}"
    assert parse_number(r"\frac{1}{2}") == 0.5 and parse_number("1,234") == 1234.0 and parse_number("-3") == -3.0
    assert math_reward(None, ["the answer is 42.", r"\boxed{41}", "#### 1,000", "none"],
                       ["42", "Step... #### 42", "1000", "5"]) == [1.0, 0.0, 1.0, 0.0]
    assert format_reward(None, [r"\boxed{3}", "it is 3", "no"]) == [1.0, 0.5, 0.0]
    # (right characters + 1 for stopping right after len(target)) / (max length + 1): full credit needs the EOS
    assert copy_reward(None, ["abc", "ab", "abcd", "x", ""], ["abc"] * 5) == [1.0, 0.5, 0.6, 0.0, 0.0]
    assert copy_reward(None, ["abc", "abc"], ["abc"] * 2, truncated=[True, False]) == [0.75, 1.0]
    spec = parse_reward_spec("grpo.rewards:format_reward=0.25")
    assert spec.fn is format_reward and spec.weight == 0.25
    assert parse_reward_spec("grpo.rewards.math_reward").fn is math_reward
    table = compute_rewards([parse_reward_spec("copy"), parse_reward_spec("math=2")], ["p"], ["ab"],
                            [{"prompt": "p", "answer": "ab"}])
    assert table[0][0] == 1.0 and table[0][1] == 1.0  # non-numeric answer: exact match
    for bad in ("copy=x", "no_such_module_xyz:fn", "grpo.rewards:nope", "=1"):
        with pytest.raises(UsageError):
            parse_reward_spec(bad)


def test_prompt_sampler_shards_and_resumes():
    a, b = PromptSampler(10, seed=3, rank=0, world_size=2), PromptSampler(10, seed=3, rank=1, world_size=2)
    first_a, first_b = a.next(5), b.next(5)
    assert not set(first_a) & set(first_b) and sorted(first_a + first_b) == list(range(10))
    a.next(3)
    state = a.state_dict()
    expected = a.next(7)
    c = PromptSampler(10, seed=3, rank=0, world_size=2)
    c.load_state_dict(state)
    assert c.next(7) == expected


def test_builtin_task_and_dataset_validation(tmp_path):
    rows = builtin_copy_task()
    assert rows[0] == {"prompt": "a=", "answer": "a"} and len(rows) == 8 + 64 + 512
    train_rows, held = split_eval(rows, None)
    assert len(held) == 58 and not {r["prompt"] for r in held} & {r["prompt"] for r in train_rows}
    assert split_eval(rows, None)[1] == held  # a property of the dataset: the same split every time
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "ab=", "answer": "ab"}\n\n{"prompt": [{"role": "user", "content": "x"}], '
                    '"answer": "1"}\n')
    assert len(load_jsonl(str(good))) == 2


def test_local_checkpoint_with_chat_template_and_math_dataset(tmp_path):
    """--model (AutoModelForCausalLM/AutoTokenizer, local files), chat template, message-list prompts, math
    rewards by name and by dotted path; the checkpoint's generation_config does not leak into sampling."""
    from grpo.rollout import GenerationSettings, Sampler

    model_dir, data = tmp_path / "qwen", tmp_path / "math.jsonl"
    save_tiny_chat_checkpoint(str(model_dir))
    rows = [{"prompt": f"What is {a} + 3?", "answer": f"so #### {a + 3}"} for a in range(3)]
    rows.append({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2", "level": 1})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert train.main(["--model", str(model_dir), "--dataset", str(data), "--reward", "math",
                       "--reward", "grpo.rewards:format_reward=0.1", "--max-steps", "2", "--max-new-tokens", "8",
                       "--beta", "0.04", "--output-dir", str(out)] + SMALL) == 0
    metrics = read_metrics(out)
    assert [r["step"] for r in metrics] == [1, 2] and "reward/grpo.rewards:format_reward" in metrics[0]

    from grpo.modeling import load_pretrained
    lm, tok = load_pretrained(str(model_dir), torch.float32, "sdpa")
    spec = parse_reward_spec("math")
    torch.manual_seed(0)
    eos = [tok.eos_token_id]
    banned = suppressed_token_ids(tok, lm.config.vocab_size, eos)
    assert tok.convert_tokens_to_ids("<|im_start|>") in banned and tok.pad_token_id in banned and eos[0] not in banned
    sampler = Sampler(lm, tok, GenerationSettings(num_generations=8, max_new_tokens=4), eos, banned, [spec],
                      torch.device("cpu"), add_special_tokens=False)
    ro = sampler.rollout(["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"], [rows[0]])
    assert len({tuple(r.tolist()) for r in ro.completion_ids}) > 1  # top_k=1 from generation_config would collapse


def test_sampler_and_loss_use_the_same_restricted_distribution():
    """Suppressed ids (pad / bos / unk, made very likely here) are never sampled, and the loss path scores every
    sampled token with the sampler's distribution: softmax(logits / T) renormalized over the allowed ids."""
    torch.manual_seed(0)
    tok = build_char_tokenizer(PRINTABLE_ASCII)
    lm = build_tiny_model(tok).eval()
    eos = [tok.eos_token_id]
    banned = suppressed_token_ids(tok, lm.config.vocab_size, eos)
    assert banned == sorted([tok.pad_token_id, tok.bos_token_id, tok.unk_token_id])
    with torch.no_grad():
        lm.lm_head.weight[banned] = lm.model.norm.weight * 3.0  # aligned with every hidden state: huge logits
    ids, mask = tokenize_prompts(tok, ["a=", "bcd=", "hh="], True, None, torch.device("cpu"))
    temperature = 0.7
    comp, _ = sample_completions(lm, ids, mask, repeats=4, max_new_tokens=5, eos_ids=eos, pad_id=tok.pad_token_id,
                                 banned=torch.tensor(banned), temperature=temperature)
    cmask, truncated = completion_mask_after_eos(comp, eos)
    assert not torch.isin(comp[cmask], torch.tensor(banned)).any()
    seq = torch.cat([ids.repeat_interleave(4, 0), comp], 1)
    attn = torch.cat([mask.repeat_interleave(4, 0), cmask.long()], 1)
    P = ids.shape[1]
    from grpo.rollout import position_ids_from_mask
    logits = lm(input_ids=seq, attention_mask=attn, position_ids=position_ids_from_mask(attn)).logits[:, P - 1:-1]
    logits = logits / temperature
    logits[..., banned] = float("-inf")
    expected = logits.log_softmax(-1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
    batch = {"input_ids": seq, "attention_mask": attn, "prompt_length": P, "completion_ids": comp,
             "completion_mask": cmask}
    got = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=temperature), banned_ids=banned).token_logprobs(batch)
    truth = _logprobs64(lm, seq, attn, P, temperature, comp, banned)  # three-way: fp32 full forward the middle term
    assert_three_way(got[cmask], expected[cmask], truth[cmask], torch.float32, "restricted logp")
    unrestricted = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=temperature)).token_logprobs(batch)
    # bound: not a tolerance: the renormalization matters here (log-probs move by O(1))
    assert (unrestricted[cmask] - expected[cmask]).abs().max() > 0.5
    # completion_chars: only those characters (and EOS) remain samplable
    allowed = set(range(len(tok))) - set(suppressed_token_ids(tok, lm.config.vocab_size, eos, "ab"))
    assert allowed == {tok.convert_tokens_to_ids("a"), tok.convert_tokens_to_ids("b"), eos[0]}


def test_rewards_see_what_the_policy_emitted():
    """Decoding keeps special tokens other than the final EOS (nothing is silently dropped before the reward)."""
    tok = build_char_tokenizer("abc=")
    a, eos, bos, pad = (tok.convert_tokens_to_ids(t) for t in ("a", "<eos>", "<bos>", "<pad>"))
    comp = torch.tensor([[a, bos, a, eos, pad], [a, a, a, a, a]])
    mask, truncated = completion_mask_after_eos(comp, [eos])
    assert decode_completions(tok, comp, mask, truncated) == ["a<bos>a", "aaaaa"]


def test_builtin_tokenizer_covers_printable_ascii():
    tok = build_char_tokenizer(PRINTABLE_ASCII)
    text = "12 + 34 = 46\n(x*y)/z! ~{ok}"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == 4 + 96


def test_fused_head_check_folds_logit_scale_and_refuses_an_invalid_softcap():
    """The trainer goes through grpo_kernels' get_lm_head: Cohere's logit_scale folds into the temperature (log-probs
    equal the model's own logits' log-softmax); an invalid soft cap is refused with a UsageError (valid ones train:
    tests/train/test_train_gemma.py)."""
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    lm = CohereForCausalLM(CohereConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=4, logit_scale=0.25,
                                        pad_token_id=0)).eval()
    ids = torch.randint(1, 50, (2, 7))
    attn = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": attn, "prompt_length": 3, "completion_ids": ids[:, 3:],
             "completion_mask": torch.ones(2, 4, dtype=torch.bool)}
    got = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=0.5)).token_logprobs(batch)
    logits = lm(input_ids=ids, attention_mask=attn).logits[:, 2:-1] / 0.5
    # three-way: a float64 copy of the model (logit scale in its forward) the truth, its fp32 logits the middle term
    assert_three_way(got, logits.log_softmax(-1).gather(-1, ids[:, 3:, None]).squeeze(-1),
                     _logprobs64(lm, ids, attn, 3, 0.5, ids[:, 3:]), torch.float32, "logp")
    gemma = Gemma2ForCausalLM(Gemma2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                           final_logit_softcapping=0.0))
    with pytest.raises(UsageError, match="final_logit_softcapping=0.0"):
        GRPOPolicy(gemma, gk.GRPOLossConfig())


def test_single_pass_gradient_equals_recomputed_forward():
    """Single-pass mode (the loss backpropagates through the sampling forward's kept hidden states) gives the same
    loss and parameter gradients as recomputing the forward from the sampled ids (left-padded prompts, EOS masks,
    trimming, suppressed ids)."""
    from grpo.rollout import GenerationSettings, Sampler

    torch.manual_seed(0)
    tok = build_char_tokenizer(PRINTABLE_ASCII)
    lm = build_tiny_model(tok, num_layers=2)
    eos = [tok.eos_token_id]
    banned = suppressed_token_ids(tok, lm.config.vocab_size, eos, "abcd")
    sampler = Sampler(lm, tok, GenerationSettings(num_generations=4, max_new_tokens=5, temperature=0.9), eos,
                      banned, [parse_reward_spec("copy")], torch.device("cpu"))
    rows = [{"prompt": p, "answer": p[:-1]} for p in ("a=", "bcd=", "dd=")]
    ro = sampler.rollout([r["prompt"] for r in rows], rows, keep_graph=True)
    assert ro.hidden is not None and ro.hidden.requires_grad and ro.completion_mask.sum() < ro.completion_mask.numel()
    policy = GRPOPolicy(lm, gk.GRPOLossConfig(temperature=0.9), banned_ids=banned)
    adv = gk.group_advantages(ro.rewards, 4) + 0.1 * torch.randn(12)
    batch = trim(ro.batch(advantages=adv))
    results = []
    for hidden in (ro.hidden[:, :batch["completion_ids"].shape[1]], None):
        lm.zero_grad()
        loss, _ = policy(batch, hidden=hidden)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in lm.named_parameters()}))
    (loss1, g1), (loss2, g2) = results
    assert loss1 != 0
    # three-way: the truth the recomputed forward on a float64 copy of the model, the middle term the fp32
    # recomputed forward (loss2, g2): the single pass may not be much less accurate than recomputing
    import copy
    lm64 = copy.deepcopy(lm).double()
    loss64, _ = GRPOPolicy(lm64, gk.GRPOLossConfig(temperature=0.9), banned_ids=banned)(batch, hidden=None)
    loss64.backward()
    assert_three_way(loss1, loss2, loss64.detach(), torch.float32, "loss")
    for name, p in lm64.named_parameters():
        assert_three_way(g1[name], g2[name], p.grad, torch.float32, name, scale=grad_scale(p.grad))


def test_next_tokens_top_k_top_p_and_banned_ids():
    from grpo.rollout import next_tokens

    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).repeat(4000, 1)
    banned = torch.tensor([0])
    draws = next_tokens(logits.clone(), banned, 1.0, 0, 1.0, False)
    freq = torch.bincount(draws, minlength=4).float() / len(draws)
    # bound: renormalized; seeded draws (the same on every machine): binomial std <= sqrt(0.25 / 4000) = 0.008,
    #   atol ~4 std
    torch.testing.assert_close(freq, torch.tensor([0.0, 0.6, 0.3, 0.1]), atol=0.03, rtol=0)
    assert set(next_tokens(logits.clone(), None, 1.0, 2, 1.0, False).tolist()) == {0, 1}
    assert set(next_tokens(logits.clone(), None, 1.0, 0, 0.75, False).tolist()) == {0, 1}  # 0.5 + 0.3 >= 0.75
    assert set(next_tokens(logits.clone(), None, 1.0, 0, 0.85, False).tolist()) == {0, 1, 2}
    assert next_tokens(logits[:1].clone(), banned, 1.0, 0, 1.0, True).item() == 1  # greedy skips banned ids
