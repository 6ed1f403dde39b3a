"""Tests of the standalone trainer ``python -m grpo.train`` (grpo/).

Fast tests check the pieces (alignment of hidden states with sampled tokens, rewards, sampler, error messages);
slow ones run the real command: a default run whose reward rises, a 2-process torchrun/gloo run whose ranks stay
in sync, and checkpoint/resume reproducing the uninterrupted run exactly. Whole file: about 1.5 min on 2 cores.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from grpo import train
from grpo.checkpoint import latest_checkpoint
from grpo.data import PromptSampler, builtin_copy_task, load_jsonl
from grpo.errors import UsageError
from grpo.modeling import build_char_tokenizer, build_tiny_model
from grpo.policy import GRPOPolicy
from grpo.rewards import (compute_rewards, copy_reward, extract_answer, format_reward, math_reward,
                          parse_number, parse_reward_spec)
from grpo.rollout import completion_mask_after_eos, tokenize_prompts
from grpo.trainer import trim

import grpo_kernels as gk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--prompts-per-step", "4", "-G", "4", "--no-progress"]


def _env():
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)  # CPU runs use the chunked torch path; no interpreter needed
    return env


def _run(cmd, timeout=240):
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    for b in (batch, trim(batch)):
        logp = policy.token_logprobs(b)
        T = logp.shape[1]
        torch.testing.assert_close(logp[cmask[:, :T]], sampled[:, :T][cmask[:, :T]], atol=1e-4, rtol=1e-4)


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
    assert copy_reward(None, ["abc", "ab", "abcd", "x"], ["abc"] * 4) == [1.0, 2 / 3, 0.75, 0.0]
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
    good = tmp_path / "ok.jsonl"
    good.write_text('{"prompt": "ab=", "answer": "ab"}\n\n{"prompt": [{"role": "user", "content": "x"}], '
                    '"answer": "1"}\n')
    assert len(load_jsonl(str(good))) == 2


def _save_tiny_chat_checkpoint(path):
    """A Qwen2-architecture checkpoint with a byte-level BPE tokenizer, a chat template, tied embeddings and a
    generation_config that would change sampling (top_k=1, repetition penalty) if it leaked into generation."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["What is 2 + 3? The answer is \\boxed{5}. #### 5"] * 10, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    torch.manual_seed(0)
    lm = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    lm.generation_config.do_sample, lm.generation_config.top_k = True, 1
    lm.generation_config.repetition_penalty = 1.5
    lm.save_pretrained(path)
    tok.save_pretrained(path)


def test_local_checkpoint_with_chat_template_and_math_dataset(tmp_path):
    """--model (AutoModelForCausalLM/AutoTokenizer, local files), chat template, message-list prompts, math
    rewards by name and by dotted path; the checkpoint's generation_config does not leak into sampling."""
    from grpo.rollout import GenerationSettings, generate_rollout

    model_dir, data = tmp_path / "qwen", tmp_path / "math.jsonl"
    _save_tiny_chat_checkpoint(str(model_dir))
    rows = [{"prompt": f"What is {a} + 3?", "answer": f"so #### {a + 3}"} for a in range(3)]
    rows.append({"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2", "level": 1})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    assert train.main(["--model", str(model_dir), "--dataset", str(data), "--reward", "math",
                       "--reward", "grpo.rewards:format_reward=0.1", "--max-steps", "2", "--max-new-tokens", "8",
                       "--beta", "0.04", "--output-dir", str(out)] + SMALL) == 0
    assert [r["step"] for r in _metrics(out)] == [1, 2] and "reward/grpo.rewards:format_reward" in _metrics(out)[0]

    from grpo.modeling import load_pretrained
    lm, tok = load_pretrained(str(model_dir), torch.float32, "sdpa")
    spec = parse_reward_spec("math")
    torch.manual_seed(0)
    ro = generate_rollout(lm, tok, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"], [rows[0]],
                          GenerationSettings(num_generations=8, max_new_tokens=4), [tok.eos_token_id], [spec],
                          torch.device("cpu"), add_special_tokens=False)
    assert len({tuple(r.tolist()) for r in ro.completion_ids}) > 1  # top_k=1 from generation_config would collapse


# ------------------------------------------------------------------------------------------------- bad arguments
@pytest.mark.parametrize("argv, message", [
    (["-G", "1"], "--num-generations must be >= 2"),
    (["--dataset", "/no/such/file.jsonl"], "file not found"),
    (["--model", "/no/such/model"], "not a directory"),
    (["--reward", "no_such_pkg_xyz.mod:fn"], "cannot import module"),
    (["--epsilon-low", "1.5"], "epsilon_low"),
    (["--mini-batch-size", "5"], "must divide"),
    (["--resume"], "no complete checkpoint"),
], ids=["G<2", "missing-dataset", "missing-model", "bad-reward", "bad-loss-option", "bad-minibatch", "no-ckpt"])
def test_bad_arguments_exit_with_one_clear_message(argv, message, tmp_path, capsys):
    assert train.main(SMALL + ["--output-dir", str(tmp_path / "run"), "--max-steps", "1"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo.train: error:") and message in err and "Traceback" not in err
    assert err.count("\n") == 1


def test_dataset_line_without_prompt(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "a=", "answer": "a"}\n{"question": "b=", "answer": "b"}\n')
    assert train.main(["--dataset", str(data), "--output-dir", str(tmp_path / "run")] + SMALL) == 2
    err = capsys.readouterr().err
    assert f"{data}:2: missing field 'prompt'" in err and "Traceback" not in err


def test_cli_unknown_loss_type_exits_cleanly(tmp_path):
    proc = _run([sys.executable, "-m", "grpo.train", "--loss-type", "nope", "--output-dir", str(tmp_path)])
    assert proc.returncode == 2
    assert "invalid choice: 'nope'" in proc.stderr and "Traceback" not in proc.stderr
    proc = _run([sys.executable, "-m", "grpo.train", "-G", "1", "--output-dir", str(tmp_path)])
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "grpo.train: error: --num-generations must be >= 2 (GRPO compares completions within a group), got 1"


# ------------------------------------------------------------------------------------------------- runs
def test_resume_reproduces_uninterrupted_run(tmp_path, capsys):
    """Checkpoint at step 4 (end of the first rollout: 2 iterations x 2 mini-batches), resume: steps 5-8 have the
    very same losses as the uninterrupted run (model, AdamW, scheduler, RNG and sampler state restored; old and
    ref log-probs in play)."""
    opts = SMALL + ["--max-steps", "8", "--save-steps", "4", "--beta", "0.04", "--num-iterations", "2",
                    "--mini-batch-size", "8", "--micro-batch-size", "4", "--seed", "5"]
    full, part = tmp_path / "full", tmp_path / "part"
    assert train.main(opts + ["--output-dir", str(full)]) == 0
    capsys.readouterr()
    shutil.copytree(full / "checkpoint-4", part / "checkpoint-4")
    assert latest_checkpoint(str(part)) == str(part / "checkpoint-4")
    assert train.main(opts + ["--output-dir", str(part), "--resume"]) == 0
    assert f"resumed from {part / 'checkpoint-4'} at step 4" in capsys.readouterr().out
    a, b = _metrics(full), _metrics(part)
    assert [r["step"] for r in b] == [5, 6, 7, 8]
    for ra, rb in zip(a[4:], b):
        assert ra["loss"] == rb["loss"] and ra["reward_mean"] == rb["reward_mean"], (ra, rb)
    # a saved checkpoint is a regular --model directory, usable with a JSONL dataset and a custom reward
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": s + "=", "answer": s}) + "\n" for s in ("ab", "c", "hgf", "d")))
    assert train.main(SMALL + ["--model", str(full / "checkpoint-8" / "model"), "--dataset", str(data),
                               "--reward", "copy", "--reward", "grpo.rewards:format_reward=0.1",
                               "--max-steps", "2", "--output-dir", str(tmp_path / "m")]) == 0
    assert [r["step"] for r in _metrics(tmp_path / "m")] == [1, 2]


@pytest.mark.slow
def test_default_run_reward_rises(tmp_path):
    """The default job, shortened to 120 steps (~15 s): mean reward of the last 20 steps clearly above the first 20."""
    out = tmp_path / "run"
    proc = _run([sys.executable, "-m", "grpo.train", "--max-steps", "120", "--output-dir", str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _metrics(out)
    assert [r["step"] for r in records] == list(range(1, 121))
    for key in ("step", "reward_mean", "kl", "loss", "clip_ratio", "tokens_per_s", "lr", "grad_norm"):
        assert key in records[0]
    first = sum(r["reward_mean"] for r in records[:20]) / 20
    last = sum(r["reward_mean"] for r in records[-20:]) / 20
    assert last > first + 0.07 and last > 1.6 * first, (first, last)
    assert records[-1]["kl"] > 0
    assert (out / "curves.png").stat().st_size > 1000
    assert (out / "checkpoint-120" / "COMPLETE").exists()
    assert "reward" in proc.stderr and "tok/s" in proc.stderr  # the tqdm bar's postfix


@pytest.mark.slow
def test_torchrun_two_processes_stay_in_sync(tmp_path):
    """torchrun + gloo: each rank samples its own groups, DDP averages gradients, parameters stay identical."""
    out = tmp_path / "ddp"
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                 "-m", "grpo.train", "--max-steps", "4", "--output-dir", str(out), "--beta", "0.04",
                 "--micro-batch-size", "8"] + SMALL)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[:6000]
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and len(summary["param_checksums"]) == 2
    assert summary["param_checksums"][0] == summary["param_checksums"][1]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3, 4]
    assert "WARNING" not in proc.stdout


def test_liger_layers_flag_patches_rmsnorm_swiglu_rope():
    """--liger-layers swaps in Liger's RMSNorm / SwiGLU / RoPE (checked by name: the kernels need a GPU). Runs in a
    subprocess because Liger's RoPE patch is process-global."""
    code = ("import torch\n"
            "from grpo.modeling import build_char_tokenizer, build_tiny_model, apply_liger_layers\n"
            "m = build_tiny_model(build_char_tokenizer('ab='))\n"
            "apply_liger_layers(m, torch.device('cuda'))\n"
            "import transformers.models.llama.modeling_llama as ml\n"
            "print(m.model.norm._get_name(), m.model.layers[0].mlp.forward.__qualname__,"
            " ml.apply_rotary_pos_emb.__module__)\n")
    proc = _run([sys.executable, "-c", code])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["LigerRMSNorm", "LigerSwiGLUMLP.forward", "liger_kernel.transformers.rope"]
