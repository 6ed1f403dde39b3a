"""examples/: every script runs offline as documented, shrunk to a few steps (EXAMPLE_STEPS), and prints what it
promises; plus the public offline tokenizer the TRL example uses (``grpo.char_tokenizer``)."""
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

from ..support.tolerances import same_maths_slack

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _run(name: str, steps: int, timeout: int = 240) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT), EXAMPLE_STEPS=str(steps), HF_HUB_OFFLINE="1")
    env.pop("TRITON_INTERPRET", None)  # as a user runs it
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / name)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_examples_are_short_and_documented():
    assert [p.name for p in EXAMPLES] == ["fused_loss_loop.py", "liger_switch.py", "train_custom_reward.py",
                                          "trl_grpo.py"]
    for path in EXAMPLES:
        text = path.read_text()
        assert len(text.splitlines()) <= 50, path.name
        assert text.startswith('"""') and f"python examples/{path.name}" in text, path.name


def test_trl_example_prints_the_patch_report():
    pytest.importorskip("trl")
    out = _run("trl_grpo.py", steps=2)
    assert re.search(r"grpo_kernels\.patch_trl: TRL 1\.16\.\S+ patched \(strict=False\)", out), out
    assert re.search(r"GRPO/RLOO policy log-probs \+ entropy +grpo_kernels", out)
    first, last = map(float, re.search(r"mean reward: first step ([\d.]+), last step ([\d.]+)", out).groups())
    assert 0 <= first <= 1 and 0 <= last <= 1


def test_train_example_uses_the_custom_reward():
    out = _run("train_custom_reward.py", steps=2)
    first, last = map(float, re.search(r"mean reward: first steps ([\d.]+), last steps ([\d.]+)", out).groups())
    assert 0 <= first <= 1 and 0 <= last <= 1
    assert "held-out accuracy by step: 0: " in out


def test_fused_loss_loop_learns():
    """30 steps of the hand-written loop: the reward must rise from chance (1/16) to most tokens right."""
    out = _run("fused_loss_loop.py", steps=30)
    rewards = [float(r) for r in re.findall(r"reward ([\d.]+)", out)]
    # bound: not a tolerance: chance is 1/16; "learns" is from below 0.2 to above 0.8
    assert len(rewards) == 4 and rewards[0] < 0.2 and rewards[-1] > 0.8, out


def test_liger_switch_runs_liger_code_on_grpo_kernels():
    """Liger's API after one changed import; with liger-kernel installed, Liger's own loss on the same batch."""
    out = _run("liger_switch.py", steps=2)
    assert re.search(r"step  1  loss [+-][\d.]+  kl [\d.]+  clip_ratio [\d.]+", out), out
    if "not installed" not in out:
        theirs, ours = map(float, re.search(r"own module: loss ([+-][\d.]+), grpo_kernels.liger: loss ([+-][\d.]+)",
                                            out).groups())
        # bound: both printed to 6 decimals (each within 5e-7 of its value), and the two fp32 values the same maths
        #   computed two ways (tests/support/tolerances.py's same_maths_slack, relative to max(1, |loss|))
        slack = 1e-6 + same_maths_slack(torch.float32) * max(1.0, abs(theirs))
        assert abs(ours - theirs) <= slack, (ours, theirs)


def test_char_tokenizer_is_public(tmp_path):
    pytest.importorskip("transformers")
    import grpo
    from grpo.data import PRINTABLE_ASCII
    from grpo.modeling import build_char_tokenizer  # the old name keeps working
    from transformers import AutoTokenizer

    tok = grpo.char_tokenizer()
    assert len(tok) == 4 + len(PRINTABLE_ASCII) == len(build_char_tokenizer(PRINTABLE_ASCII))
    assert grpo.PRINTABLE_ASCII == PRINTABLE_ASCII and callable(grpo.build_tiny_model)
    small = grpo.char_tokenizer("ab ")
    ids = small("ab ba")["input_ids"]
    assert len(ids) == 5 and small.decode(ids) == "ab ba" and small.padding_side == "left"
    small.save_pretrained(tmp_path)
    assert AutoTokenizer.from_pretrained(tmp_path)("ba")["input_ids"] == small("ba")["input_ids"]
    for bad in ("", 3):
        with pytest.raises(ValueError, match="alphabet must be a non-empty string"):
            grpo.char_tokenizer(bad)
