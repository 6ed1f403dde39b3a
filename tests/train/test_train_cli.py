"""The command line of ``python -m grpo.train`` (grpo/cli.py, grpo/config.py): a real help text for every flag,
switches shown as on / off, negative numbers taken as values and every numeric flag range-checked with one line
naming it, no flash-attn for a float32 run (chosen or named), no ``--capturable`` (and a run saved with it resumes),
DeepSpeed's import noise kept out of runs, and summary lines that say what they compare.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

import torch

import grpo.modeling
from grpo import TrainConfig, train
from grpo.checkpoint import MANIFEST, SETTINGS
from grpo.cli import build_parser, config_from_argv
from grpo.config import quiet_unused_deepspeed
from grpo.errors import UsageError
from grpo.evaluation import describe_evals
from grpo.modeling import choose_attn_implementation, run_dtypes
from grpo_kernels import GRPOLossConfig

from ..support.train_runs import REPO, SMALL, read_metrics, train_tiny


def _option_actions(parser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def help_problems(parser) -> list[str]:
    """Options whose help is missing, too short to explain anything, or only their own name restated."""
    problems = []
    for action in _option_actions(parser):
        flag = max(action.option_strings, key=len)
        text = action.help or ""
        name = _words(flag)
        words = [w for w in _words(text) if w not in name]
        if len(_words(text)) < 4 or len(words) < 3:
            problems.append(f"{flag}: {text!r}")
    return problems


# ------------------------------------------------------------------------------------------------- help
def test_every_flag_has_a_help_text_that_explains_it():
    parser = build_parser()
    assert len(_option_actions(parser)) > 60
    assert help_problems(parser) == []
    # The check can fail: a flag whose help restates its name (as --grad-in-forward's once did) is reported.
    bad = argparse.ArgumentParser()
    bad.add_argument("--grad-in-forward", help="grad in forward")
    bad.add_argument("--memory-budget", help="memory budget")
    bad.add_argument("--fine", help="seconds between two checkpoints")
    assert [p.split(":")[0] for p in help_problems(bad)] == ["--grad-in-forward", "--memory-budget"]


def test_help_shows_switch_defaults_as_on_or_off_and_units():
    text = build_parser().format_help()
    entries = dict(re.findall(r"\n  (--[a-z-]+)[^\n]*?(?:\n|  )(.*?)(?=\n  -|\n\n|\Z)", text, re.S))
    flat = {k: " ".join(v.split()) for k, v in entries.items()}
    progress = re.search(r"--progress, --no-progress\s+(.*?)(?=\n  -|\n\n)", text, re.S).group(1)
    assert " ".join(progress.split()).endswith("(default: on)"), progress
    assert "(default: True)" not in text and "(default: False)" not in text
    assert flat["--overwrite"].endswith("(default: off)")
    assert "bytes" in flat["--memory-budget"] and "tokens" in flat["--max-new-tokens"]
    assert "optimizer steps" in flat["--save-steps"]
    assert config_from_argv([]).progress is True
    assert config_from_argv(["--no-progress"]).progress is False
    assert config_from_argv(["--no-progress", "--progress"]).progress is True


def test_docs_reference_every_flag():
    with open(os.path.join(REPO, "docs", "training-cli.md"), encoding="utf-8") as f:
        doc = f.read()
    missing = [s for a in _option_actions(build_parser()) for s in a.option_strings
               if s.startswith("--") and f"`{s}" not in doc]
    assert missing == []


# ------------------------------------------------------------------------------------------------- numbers
@pytest.mark.parametrize("argv, message", [
    (["--beta", "-1"], "--beta: beta must be >= 0"),
    (["--save-total-limit", "-3"], "--save-total-limit must be >= 0"),
    (["--lr", "-1e-3"], "--lr must be > 0, got -0.001"),
    (["--lr=-1e-3"], "--lr must be > 0, got -0.001"),
    (["--lr", "nan"], "--lr must be > 0, got nan"),
    (["--lr", "-inf"], "--lr must be > 0, got -inf"),
    (["--temperature", "-.5"], "--temperature must be > 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-k", "-5"], "--top-k must be >= 0"),
    (["-G", "-1"], "--num-generations must be >= 2"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--seed", str(2**32)], "--seed must be < 2**32"),
    (["--weight-decay", "-0.1"], "--weight-decay must be >= 0"),
    (["--adam-beta1", "1"], "--adam-beta1 must be in [0, 1)"),
    (["--adam-beta2", "-0.5"], "--adam-beta2 must be in [0, 1)"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0"),
    (["--max-grad-norm", "inf"], "--max-grad-norm must be >= 0, got inf"),
    (["--min-lr-ratio", "2"], "--min-lr-ratio must be in [0, 1]"),
    (["--mini-batch-size", "0"], "--mini-batch-size must be >= 1"),
    (["--micro-batch-size", "-2"], "--micro-batch-size must be >= 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--hidden-size", "0"], "--hidden-size must be >= 1"),
    (["--num-layers", "-1"], "--num-layers must be >= 1"),
    (["--num-heads", "0"], "--num-heads must be >= 1"),
    (["--eval-size", "-1"], "--eval-size must be >= 0"),
    (["--save-steps", "-1"], "--save-steps must be >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps must be >= 0"),
    (["--num-iterations", "0"], "--num-iterations must be >= 1"),
    (["--prompts-per-step", "0"], "--prompts-per-step must be >= 1"),
    (["--max-steps", "0"], "--max-steps must be >= 1"),
    (["--max-prompt-length", "0"], "--max-prompt-length must be >= 1"),
    (["--eval-every", "-2"], "--eval-every must be >= 1"),
    (["--epsilon-low", "-0.1"], "--epsilon-low: epsilon_low"),
    (["--epsilon-high", "-1"], "--epsilon-high: epsilon_high"),
    (["--delta", "-1"], "--delta: delta"),
    (["--memory-budget", "-1"], "--memory-budget: memory_budget"),
    (["--max-completion-length", "0"], "--max-completion-length: max_completion_length"),
    (["--top-entropy-quantile", "0"], "--top-entropy-quantile: top_entropy_quantile"),
    (["--sapo-temperature-pos", "-1"], "--sapo-temperature-pos: sapo_temperature_pos"),
    (["--reward", "math=-inf"], "weight must be finite"),
])
def test_bad_numbers_exit_with_one_line_naming_the_flag(argv, message, tmp_path, capsys):
    assert train.main(SMALL + ["--output-dir", str(tmp_path / "run"), "--max-steps", "1"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo.train: error: ") and message in err and "Traceback" not in err, err
    assert err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_negative_numbers_are_values():
    """Without the wider number pattern argparse reads "-1e-3" as an unknown flag: "expected one argument"."""
    cfg = config_from_argv(["--entropy-coef", "-1e-3", "--off-policy-mask-threshold", "-0.5", "--vespo-k-neg",
                            "-2", "--reward", "copy=-1"])
    assert cfg.loss.entropy_coef == -1e-3 and cfg.loss.off_policy_mask_threshold == -0.5
    assert cfg.loss.vespo_k_neg == -2.0 and cfg.reward_specs[0].weight == -1.0
    with pytest.raises(Exception, match="unrecognized arguments: --no-such-flag"):
        config_from_argv(["--no-such-flag"])  # flags are still flags


# ------------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("device, dtype, autocast, expected", [
    ("cuda", "auto", "auto", "flash_attention_2"),      # float32 weights, bfloat16 autocast on CUDA
    ("cuda", "auto", "float16", "flash_attention_2"),
    ("cuda", "bfloat16", "none", "flash_attention_2"),
    ("cuda", "float16", "auto", "flash_attention_2"),
    ("cuda", "auto", "none", None),                     # float32 forwards: flash-attn cannot run them
    ("cuda", "float32", "none", None),
    ("cpu", "bfloat16", "auto", None),                  # flash-attn is CUDA only
])
def test_auto_attention_picks_flash_attention_only_for_half_precision_forwards(device, dtype, autocast, expected,
                                                                               monkeypatch):
    """'auto' with flash_attn installed (faked: no CUDA needed to choose) as the Trainer asks it: the run's
    forward dtype is the autocast dtype, else the parameter dtype."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(grpo.modeling.importlib.util, "find_spec",
                        lambda name, *a: object() if name == "flash_attn" else find_spec(name, *a))
    param, cast = run_dtypes(dtype, autocast, device)
    assert choose_attn_implementation("auto", torch.device(device), cast or param) == expected
    assert choose_attn_implementation("eager", torch.device(device), cast or param) == "eager"
    monkeypatch.setattr(grpo.modeling.importlib.util, "find_spec", lambda name, *a: None)  # not installed
    assert choose_attn_implementation("auto", torch.device(device), cast or param) is None


@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3"])
def test_flash_attention_named_for_a_float32_run_is_one_line(name, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.main(SMALL + ["--output-dir", str(tmp_path / "run"), "--attn-implementation", name]) == 2
    err = capsys.readouterr().err
    assert err == (f"grpo.train: error: --attn-implementation {name} runs only in bfloat16 or float16 (flash-attn "
                   "has no float32 kernels), but this run's forwards are float32 (--dtype auto, --autocast auto, no "
                   "CUDA device): pass --dtype bfloat16 or, on CUDA, --autocast bfloat16, or another "
                   "--attn-implementation\n")
    assert not (tmp_path / "run").exists()
    for argv in (["--device", "cuda", "--autocast", "none"], ["--dtype", "float32", "--autocast", "none"]):
        with pytest.raises(UsageError, match=f"--attn-implementation {name} runs only in bfloat16 or float16"):
            config_from_argv(["--attn-implementation", name] + argv)
    # half-precision forwards are accepted: bf16 / fp16 weights anywhere, bf16 autocast on CUDA (auto or named)
    for argv in (["--dtype", "bfloat16"], ["--dtype", "float16"], ["--device", "cuda"],
                 ["--device", "cuda", "--autocast", "float16"]):
        assert config_from_argv(["--attn-implementation", name] + argv).attn_implementation == name
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --device auto resolves as the run will
    assert config_from_argv(["--attn-implementation", name]).attn_implementation == name


# ------------------------------------------------------------------------------------------------- capturable
def test_capturable_is_no_flag_and_refused_from_python(tmp_path, capsys):
    """grpo.train captures no CUDA graph, so ``capturable`` would only compute the padded rows too."""
    assert train.main(SMALL + ["--output-dir", str(tmp_path / "run"), "--capturable"]) == 2
    assert capsys.readouterr().err == "grpo.train: error: unrecognized arguments: --capturable\n"
    with pytest.raises(UsageError, match="loss.capturable=True prepares the loss for CUDA-graph capture, which "
                                         "grpo.train does not do"):
        TrainConfig(output_dir=str(tmp_path / "run"), loss=GRPOLossConfig(capturable=True))
    assert TrainConfig(output_dir=str(tmp_path / "run")).to_dict()["capturable"] is False


def test_a_run_saved_with_capturable_resumes_without_it(tmp_path, capsys):
    """A checkpoint whose run settings record ``capturable: true`` (as runs of the versions with --capturable did;
    its manifest rewritten to match) resumes: the resume line names the change and args.json records it."""
    out = tmp_path / "run"
    assert train_tiny(out, 1) == 0
    folder = out / "checkpoint-1"
    settings = json.loads((folder / SETTINGS).read_text())
    assert settings["config"]["capturable"] is False
    settings["config"]["capturable"] = True
    (folder / SETTINGS).write_text(json.dumps(settings, indent=2))
    manifest = json.loads((folder / MANIFEST).read_text())
    data = (folder / SETTINGS).read_bytes()
    manifest["files"][SETTINGS] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))
    capsys.readouterr()
    assert train_tiny(out, 2, "--resume") == 0
    assert "[grpo.train] resume: capturable changed from True to False" in capsys.readouterr().out
    changed = json.loads((out / "args.json").read_text())["resumed"]["changed"]
    assert changed == {"capturable": [True, False], "max_steps": [1, 2]}
    assert [r["step"] for r in read_metrics(out)] == [1, 2]


# ------------------------------------------------------------------------------------------------- DeepSpeed
def test_quiet_unused_deepspeed_names_cpu_only_when_nobody_chose(monkeypatch):
    import torch

    monkeypatch.delitem(sys.modules, "deepspeed", raising=False)
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    quiet_unused_deepspeed()
    assert "DS_ACCELERATOR" not in os.environ  # a CUDA machine: DeepSpeed finds it without a word
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("DS_ACCELERATOR", "xpu")
    quiet_unused_deepspeed()
    assert os.environ["DS_ACCELERATOR"] == "xpu"  # the user's choice stays
    monkeypatch.delenv("DS_ACCELERATOR")
    quiet_unused_deepspeed()
    assert os.environ["DS_ACCELERATOR"] == "cpu"


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                    reason="DeepSpeed is not installed (test extra): then there is no import noise to keep out")
def test_run_output_has_no_deepspeed_warning(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("DS_ACCELERATOR", None)
    env.pop("TRITON_INTERPRET", None)
    # Control: in this environment importing DeepSpeed does print the warning (else this test could not fail).
    control = subprocess.run([sys.executable, "-c", "import deepspeed"], env=env, capture_output=True, text=True,
                             timeout=120)
    if "Setting accelerator to CPU" not in control.stdout + control.stderr:
        pytest.skip("DeepSpeed found an accelerator here and prints nothing; runs on machines without a GPU")
    proc = subprocess.run([sys.executable, "-m", "grpo.train", "--max-steps", "2", "--save-steps", "1",
                           "--eval-size", "0", "--output-dir", str(tmp_path / "run")] + SMALL,
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "checkpoint-1" / "COMPLETE").exists()  # a checkpoint was saved (that imports it)
    assert "Setting accelerator" not in proc.stdout + proc.stderr and "[WARNING]" not in proc.stdout + proc.stderr


# ------------------------------------------------------------------------------------------------- summaries
class _FakeEvaluator:
    def __init__(self, n, overlap=0):
        self.n, self.overlap = n, overlap
        self.held_out = overlap == 0
        self.overlap_text = "training prompts"
        self.label = "held-out" if self.held_out else "eval (training prompts)"

    def __len__(self):
        return self.n


def test_describe_evals_says_what_it_compares(tmp_path):
    ev = [{"step": 850, "eval/accuracy": 1.0}]
    line = describe_evals(ev, _FakeEvaluator(58), resumed_step=800)
    assert line == ("greedy accuracy on the 58 held-out prompts: 1.000 at step 850 (resumed at step 800; no "
                    "evaluation before it to compare with)")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(json.dumps({"step": 750, "eval/accuracy": 0.5}) + "\n"
                       + json.dumps({"step": 800, "reward_mean": 1.0, "eval/accuracy": 0.9}) + "\n"
                       + json.dumps({"step": 850, "eval/accuracy": 1.0}) + "\n" + '{"step": 8')  # torn last line
    assert describe_evals(ev, _FakeEvaluator(58), 800, str(metrics)) == \
        "greedy accuracy on the 58 held-out prompts 0.900 at step 800 (before resuming) -> 1.000 at step 850"
    fresh = [{"step": 0, "eval/accuracy": 0.0}, {"step": 300, "eval/accuracy": 0.75}]
    assert describe_evals(fresh, _FakeEvaluator(4, overlap=4)) == \
        "greedy accuracy on the 4 eval prompts (training prompts) 0.000 at step 0 -> 0.750 at step 300"


def test_resumed_run_summary_compares_with_the_evaluation_before_resuming(tmp_path, capsys):
    out = tmp_path / "run"
    opts = SMALL + ["--save-steps", "2", "--eval-size", "8", "--eval-every", "50", "--output-dir", str(out)]
    assert train.main(opts + ["--max-steps", "2"]) == 0
    first = capsys.readouterr().out
    assert re.search(r"greedy accuracy on the 8 held-out prompts \d\.\d{3} at step 0 -> \d\.\d{3} at step 2\n", first)
    assert re.search(r"; reward \d\.\d{3} \(mean of step 1\) -> \d\.\d{3} \(mean of step 2\); kl", first)
    assert train.main(opts + ["--max-steps", "3", "--resume"]) == 0
    out_text = capsys.readouterr().out
    assert re.search(r"held-out prompts \d\.\d{3} at step 2 \(before resuming\) -> \d\.\d{3} at step 3\n", out_text)
    summary = json.loads((out / "run_summary.json").read_text())
    assert summary["first_eval_step"] == 3 and summary["final_eval_step"] == 3 and summary["eval_set"] == "held-out"
