"""Data guards of ``python -m grpo.train`` (grpo/data.py): prompts that do not fit the model's context (refused with
row and lengths, or cut by --truncate-prompts), files that are not UTF-8 (one line with the line number), the
held-out split over distinct prompts (duplicates cannot leak a held-out prompt into training), --completion-chars
the tokenizer cannot produce, and "held-out" said only of an evaluation set disjoint from training.
"""
from __future__ import annotations

import json
import re

import pytest
import torch

from grpo import train
from grpo.data import (EVAL_SPLIT_SEED, PRINTABLE_ASCII, builtin_copy_task, check_completion_chars, fit_prompts,
                       load_jsonl, prompt_key, split_eval, training_overlap)
from grpo.errors import UsageError
from grpo.evaluation import Evaluator
from grpo.modeling import build_char_tokenizer

SMALL = ["--prompts-per-step", "4", "-G", "4", "--no-progress", "--max-steps", "1", "--save-steps", "0"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def _sums(n, start=0):
    return [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(start, start + n)]


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert err.startswith("grpo.train: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    return err.strip()


def _bpe_tokenizer():
    """A byte-level BPE tokenizer (merges across characters, byte tokens for accents) like most Hub models."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["What is 12 + 30? The answer is 42. #### 42"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>")


# ------------------------------------------------------------------------------------------------- encoding
def test_file_that_is_not_utf8_is_one_line_with_its_line_number(tmp_path, capsys):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": "4"}\n'
                     '{"prompt": "caf\u00e9 1+2=", "answer": "3"}\n'.encode("latin-1"))
    assert train.main(["--dataset", str(data), "--output-dir", str(tmp_path / "run")] + SMALL) == 2
    assert _one_error_line(capsys) == (f"grpo.train: error: {data}:3: not UTF-8 text (byte 0xe9 at column 16); "
                                       "save the file as UTF-8")
    eval_data = tmp_path / "eval.jsonl"
    eval_data.write_bytes(b'\xff\xfe{\x00')  # UTF-16 with its byte-order mark
    with pytest.raises(UsageError, match=r"eval.jsonl:1: not UTF-8 text \(byte 0xff at column 1\)"):
        load_jsonl(str(eval_data), flag="--eval-dataset")
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')  # UTF-8 with a byte-order mark is fine
    rows = load_jsonl(str(bom))
    assert rows == [{"prompt": "1+1=", "answer": "2"}] and rows[0].where == f"{bom}:1"


# ------------------------------------------------------------------------------------------------- held-out split
def test_held_out_split_is_over_distinct_prompts_even_with_duplicate_rows():
    rows = []
    for i, r in enumerate(_sums(300)):
        rows += [dict(r) for _ in range(1 + i % 4)]  # every prompt 1-4 times
    train_rows, held = split_eval(rows, None)
    held_prompts = {r["prompt"] for r in held}
    assert len(held) == len(held_prompts) == 30  # 10% of the 300 distinct prompts, one row each
    assert not held_prompts & {r["prompt"] for r in train_rows}
    assert len(train_rows) == len(rows) - sum(1 + int(r["prompt"].split("+")[0]) % 4 for r in held)
    with pytest.raises(UsageError, match=r"--eval-size 300 leaves no training prompts: the data has 300 distinct "
                                         r"prompts \(750 rows\)"):
        split_eval(rows, 300)
    chat = [{"prompt": [{"role": "user", "content": "hi"}], "answer": "1"}] * 3 + _sums(20)
    train_rows, held = split_eval(chat, 5)
    assert not {prompt_key(r["prompt"]) for r in held} & {prompt_key(r["prompt"]) for r in train_rows}


def test_split_of_distinct_rows_is_the_row_split_of_before():
    """Datasets without duplicates (the built-in task) keep the split they always had (the numbers in docs/training.md)."""
    rows = builtin_copy_task()
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED)).tolist()
    assert split_eval(rows, None)[1] == [rows[i] for i in sorted(order[:58])]


# ------------------------------------------------------------------------------------------------- lengths
def test_prompt_beyond_the_context_is_refused_with_row_and_lengths(tmp_path, capsys):
    rows = _sums(12)
    rows[6] = {"prompt": "9" * 10_000 + "+1=", "answer": "1"}
    data = _jsonl(tmp_path / "long.jsonl", rows)
    assert train.main(["--dataset", data, "--output-dir", str(tmp_path / "run"), "--eval-size", "0"] + SMALL) == 2
    # The built-in model's context: 128 positions (6 new tokens by default)
    assert _one_error_line(capsys) == (
        f"grpo.train: error: {data}:7: the prompt is 10003 tokens; with --max-new-tokens 6 that is 10009 > the "
        "model's context of 128 tokens; use --truncate-prompts left|right, --max-prompt-length or a smaller "
        "--max-new-tokens")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_truncate_prompts_left_runs_and_says_so(tmp_path, capsys):
    rows = _sums(12)
    rows[6] = {"prompt": "9" * 10_000 + "+1=", "answer": "1"}
    data = _jsonl(tmp_path / "long.jsonl", rows)
    assert train.main(["--dataset", data, "--output-dir", str(tmp_path / "run"), "--eval-size", "0",
                       "--truncate-prompts", "left"] + SMALL) == 0
    out = capsys.readouterr().out
    assert ("--truncate-prompts left: cut 1 training and 0 evaluation prompts to 122 tokens (the context of 128 "
            "minus --max-new-tokens 6)") in out
    capsys.readouterr()
    # --max-prompt-length makes the sampler keep only the prompt's end anyway: then the prompt fits
    assert train.main(["--dataset", data, "--output-dir", str(tmp_path / "run2"), "--eval-size", "0",
                       "--max-prompt-length", "100"] + SMALL) == 0


def test_fit_prompts_cuts_at_token_boundaries_on_either_side():
    char = build_char_tokenizer(PRINTABLE_ASCII)
    text = "".join(chr(ord("a") + i % 26) for i in range(300)) + "="
    rows = [{"prompt": text}, {"prompt": "short"}]
    common = dict(context=64, max_new_tokens=14, max_prompt_length=None, add_special_tokens=True)
    left, cut = fit_prompts([text, "short"], rows, char, truncate="left", **common)
    assert cut == 1 and left == [text[-50:], "short"]
    right, _ = fit_prompts([text, "short"], rows, char, truncate="right", **common)
    assert right == [text[:50], "short"]
    with pytest.raises(UsageError, match=r"--dataset row 1: the prompt is 301 tokens; with --max-new-tokens 14 "
                                         r"that is 315 > the model's context of 64 tokens \(1 more rows too long\)"):
        fit_prompts([text, text], rows, char, truncate=None, **common)
    with pytest.raises(UsageError, match="--max-new-tokens 64 leaves no room for a prompt"):
        fit_prompts(["x"], rows, char, truncate="left", context=64, max_new_tokens=64, max_prompt_length=None,
                    add_special_tokens=True)
    bpe = _bpe_tokenizer()
    long = "What is 12 + 30? The answer is 42. " * 40
    assert len(bpe(long)["input_ids"]) > 100
    for side in ("left", "right"):
        (cut_text,), n = fit_prompts([long], [{"prompt": long}], bpe, truncate=side, context=100, max_new_tokens=40,
                                     max_prompt_length=None, add_special_tokens=False)
        assert n == 1 and 50 <= len(bpe(cut_text)["input_ids"]) <= 60
        assert long.endswith(cut_text) if side == "left" else long.startswith(cut_text)


# ------------------------------------------------------------------------------------------------- completion chars
def test_completion_chars_the_tokenizer_lacks_are_refused(tmp_path, capsys):
    assert train.main(["--completion-chars", "ab\u00e9", "--output-dir", str(tmp_path / "run")] + SMALL) == 2
    assert _one_error_line(capsys) == (
        "grpo.train: error: --completion-chars uses characters '\u00e9' that the built-in character tokenizer "
        "(printable ASCII and newline) has no token for (completions could never contain them); pass --model PATH "
        "for other text")
    from grpo.rollout import suppressed_token_ids

    bpe = _bpe_tokenizer()  # byte-level: "é" is two byte tokens, neither of which decodes to "é"
    for chars, ok in (("0123456789", True), ("42\u00e9", False)):
        banned = suppressed_token_ids(bpe, len(bpe), [bpe.eos_token_id], chars)
        if ok:
            check_completion_chars(chars, bpe, len(bpe), banned, builtin=False)
        else:
            with pytest.raises(UsageError, match="--completion-chars uses characters '\u00e9' that the tokenizer "
                                                 "has no token for"):
                check_completion_chars(chars, bpe, len(bpe), banned, builtin=False)


def test_completion_chars_count_the_space_a_sentencepiece_token_brings():
    """"▁1" decodes to "1" alone (the decoder drops a text's leading space) but to " 1" after another token:
    completions of such tokens do contain spaces, so " " is a character the tokenizer has."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from grpo.rollout import suppressed_token_ids

    backend = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "▁1": 2, "▁2": 3, "1": 4, "2": 5},
                                         unk_token="<unk>"))
    backend.pre_tokenizer, backend.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    assert tok.decode([2]) == "1" and tok.decode([2, 3]) == "1 2"
    banned = suppressed_token_ids(tok, len(tok), [1], "12 ")
    check_completion_chars("12 ", tok, len(tok), banned, builtin=False)
    with pytest.raises(UsageError, match="'3'"):
        check_completion_chars("123", tok, len(tok), suppressed_token_ids(tok, len(tok), [1], "123"), builtin=False)


# ------------------------------------------------------------------------------------------------- eval labels
def test_eval_labels_say_held_out_only_for_a_disjoint_set():
    rows = _sums(10)
    ev = lambda eval_rows: Evaluator(None, eval_rows, [], overlap=training_overlap(rows, eval_rows))  # noqa: E731
    assert ev(_sums(5, start=100)).label == "held-out"
    assert ev(rows[:4]).label == "eval (training prompts)"
    assert ev(rows[:1] + _sums(3, start=100)).label == "eval (1 of 4 prompts also in training)"


def test_eval_dataset_equal_to_training_data_is_not_called_held_out(tmp_path, capsys, monkeypatch):
    import grpo.trainer

    labels = []
    real_plot = grpo.trainer.plot_curves
    monkeypatch.setattr(grpo.trainer, "plot_curves", lambda *a, **k: (labels.append(k.get("eval_label")),
                                                                      real_plot(*a, **k)))
    data = _jsonl(tmp_path / "sums.jsonl", _sums(8))
    out = tmp_path / "run"
    assert train.main(["--dataset", data, "--eval-dataset", data, "--output-dir", str(out)] + SMALL) == 0
    stdout = capsys.readouterr().out
    assert re.search(r"greedy accuracy on the 8 eval prompts \(training prompts\) \d\.\d{3} at step 0 -> ", stdout)
    assert "held-out" not in stdout and set(labels) == {"eval (training prompts)"}
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["eval_set"] == "eval (training prompts)" and summary["eval_held_out"] is False
    assert (out / "curves.png").stat().st_size > 1000
