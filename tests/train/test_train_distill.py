"""``grpo.train --teacher PATH`` (grpo/distillation.py): on-policy distillation with the fused two-head loss.

A tiny run distills from a ``grpo.train`` checkpoint folder (a wider teacher than the student), alone
(``--distill-only``: no reference model, no GRPO term) or added to the GRPO loss; the flags are validated with one
line and exit status 2 before anything is written, and so is a teacher with another vocabulary or a damaged one;
``--resume`` refuses another teacher, no teacher, a teacher added to a run saved without one and another
``--distill-beta`` (old -> new), accepts the same teacher moved, and then continues the uninterrupted run exactly;
the teacher gets no gradient, stays in eval mode, unchanged, and is in no optimizer, module state or checkpoint; the
distillation term is ``fused_linear_distill_loss`` on the very tensors (bitwise), and a whole optimizer step (loss,
metrics, gradient) matches a float64 step on full logits by the three-way rule, packed in rows, in one row, under a
token budget and in padded micro-batches; (slow) torchrun DDP and FSDP2 ranks stay in sync with a teacher.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
import shutil
import sys

import pytest
import torch

import grpo_kernels as gk
from grpo import TrainConfig, train
from grpo.data import PRINTABLE_ASCII, TASK_COMPLETION_CHARS
from grpo.distillation import teacher_hidden_states
from grpo.distributed import DistEnv
from grpo.modeling import build_char_tokenizer, build_tiny_model
from grpo.packing import Packing, packed_micro_batches
from grpo.policy import LossTerms
from grpo.rollout import SUPPRESSED_LOGIT
from grpo.trainer import Trainer
from grpo.update import StepOptions, optimizer_step, rollout_logprobs

from ..support.tolerances import assert_three_way, grad_scale
from ..support.train_runs import (SAME, TINY, one_error_line, read_metrics, read_summary, run_cmd, snapshot,
                                  train_tiny)

TEACHER_WIDTH = 24  # the teachers below are wider than the TINY student (16)


def save_teacher(path, seed: int, alphabet: str = PRINTABLE_ASCII, hidden: int = TEACHER_WIDTH):
    """A random-init built-in Llama (1 layer) with the character tokenizer over ``alphabet``, saved as a model
    folder (save_pretrained): what ``--teacher`` loads. Its weights are drawn 15x wider than the student's (std 0.3),
    so that its next-token distributions are far from the student's near-uniform ones."""
    torch.manual_seed(seed)
    tokenizer = build_char_tokenizer(alphabet)
    lm = build_tiny_model(tokenizer, hidden, 1, 2, initializer_range=0.3)
    lm.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    base = tmp_path_factory.mktemp("teachers")
    return {"a": save_teacher(base / "a", 1), "b": save_teacher(base / "b", 2),
            "small-vocab": save_teacher(base / "small-vocab", 1, alphabet="abcdefgh"),
            "permuted": save_teacher(base / "permuted", 1, alphabet=PRINTABLE_ASCII[::-1])}


# ------------------------------------------------------------------------------------------------- runs
def test_a_tiny_run_distills_from_a_checkpoint_teacher(tmp_path, capsys):
    """The teacher is a grpo.train checkpoint-N folder (its model/ is loaded), the student narrower (width 8 against
    16): every step logs the divergence to the teacher, the loss adds the GRPO term (which --distill-only drops,
    with its reference model); so do runs with two iterations over shuffled mini-batches and with --single-pass."""
    assert train_tiny(tmp_path / "teacher", 1) == 0
    ckpt = tmp_path / "teacher" / "checkpoint-1"
    assert train_tiny(tmp_path / "added", 2, "--teacher", str(ckpt), "--hidden-size", "8") == 0
    assert train_tiny(tmp_path / "alone", 2, "--teacher", str(ckpt), "--hidden-size", "8", "--distill-only",
                      "--distill-beta", "0.5", "--distill-temperature", "0.8") == 0
    # shuffled mini-batches over two iterations (one teacher pass per rollout), and --single-pass's padded rows
    assert train_tiny(tmp_path / "iterations", 2, "--teacher", str(ckpt), "--hidden-size", "8", "--num-iterations",
                      "2", "--mini-batch-size", "2") == 0
    assert train_tiny(tmp_path / "single-pass", 1, "--teacher", str(ckpt), "--hidden-size", "8", "--single-pass") == 0
    out = capsys.readouterr().out
    assert "div=" in out  # the progress line
    added, alone = read_metrics(tmp_path / "added"), read_metrics(tmp_path / "alone")
    others = read_metrics(tmp_path / "iterations") + read_metrics(tmp_path / "single-pass")
    assert [r["rollout"] for r in read_metrics(tmp_path / "iterations")] == [0, 0]
    for r in added + alone + others:
        assert math.isfinite(r["distill/divergence"]) and r["distill/divergence"] > 0, r
        # the student's entropy over what the sampler can draw (the task's letters and EOS): at most log(9)
        assert 0 < r["distill/entropy"] <= math.log(len(TASK_COMPLETION_CHARS["copy"]) + 1), r
    assert all("kl" in r and "clip_ratio/low_mean" in r for r in added)
    for r in alone:  # the distillation loss alone, one micro-batch: the token mean of the divergence
        assert "clip_ratio/low_mean" not in r and "entropy" not in r and r["kl"] == 0.0
        # bound: the same token mean, one fp32 sum (the loss) against fp64 sums rounded to fp32 (the metric):
        #   gamma(tokens ~ 20) relative, far below 1e-5
        assert r["loss"] == pytest.approx(r["distill/divergence"], rel=1e-5)
    args = json.loads((tmp_path / "alone" / "args.json").read_text())
    assert args["beta"] == 0.0 and args["distill_only"] and args["teacher"] == str(ckpt)
    assert (tmp_path / "alone" / "checkpoint-2" / "COMPLETE").is_file()


# ------------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("argv, message", [
    (["--distill-beta", "1.5"], "--distill-beta must be in [0, 1]"),
    (["--distill-beta", "-0.1"], "--distill-beta must be in [0, 1]"),
    (["--distill-beta", "nan"], "--distill-beta must be in [0, 1]"),
    (["--distill-temperature", "0"], "--distill-temperature must be > 0, got 0.0"),
    (["--distill-temperature", "-inf"], "--distill-temperature must be > 0"),
    (["--distill-coef", "0"], "--distill-coef must be > 0"),
    (["--distill-coef", "-1"], "--distill-coef must be > 0"),
    (["--distill-coef", "inf"], "--distill-coef must be > 0"),
    (["--distill-only", "--beta", "0.1"], "--distill-only trains on the distillation loss alone"),
    (["--distill-beta", "x"], "argument --distill-beta: invalid float value: 'x'"),
])
def test_bad_distillation_flags_exit_with_one_line(argv, message, teachers, tmp_path, capsys):
    assert train_tiny(tmp_path / "run", 1, "--teacher", str(teachers["a"]), *argv) == 2
    line = one_error_line(capsys.readouterr().err)
    assert message in line, line
    assert not (tmp_path / "run").exists()  # refused before anything is written


@pytest.mark.parametrize("argv, message", [
    (["--distill-beta", "0.5"], "--distill-beta only apply to distillation: add --teacher PATH"),
    (["--distill-only", "--distill-coef", "2"], "--distill-coef, --distill-only only apply to distillation"),
    (["--teacher", "/nonexistent/teacher"], "--teacher '/nonexistent/teacher': not a directory"),
])
def test_distillation_flags_without_a_teacher_or_a_folder(argv, message, tmp_path, capsys):
    assert train_tiny(tmp_path / "run", 1, *argv) == 2
    assert message in one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def _truncate(path):
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("case, message", [
    ("small-vocab", f"its vocabulary has 12 ids, the student's {4 + len(PRINTABLE_ASCII)}; distillation compares"),
    ("permuted", f"its tokenizer differs from the student's at {len(PRINTABLE_ASCII)} ids (id 4: "
                 f"{PRINTABLE_ASCII[-1]!r} for the teacher, {PRINTABLE_ASCII[0]!r} for the student)"),
    ("truncated-weights", "cannot load the model"),
    ("no-config", "no config.json in that directory"),
    ("no-tokenizer", "cannot load the tokenizer"),
])
def test_a_teacher_that_cannot_serve_is_refused_with_one_line(case, message, teachers, tmp_path, capsys):
    """Another vocabulary (fewer ids, or the same count mapped to other tokens), a damaged weights file, a folder
    without config.json or without a tokenizer: one line naming --teacher and the folder, exit 2, nothing written."""
    teacher = teachers.get(case)
    if teacher is None:
        teacher = shutil.copytree(teachers["a"], tmp_path / case)
        damage = {"truncated-weights": lambda: _truncate(teacher / "model.safetensors"),
                  "no-config": lambda: os.remove(teacher / "config.json"),
                  "no-tokenizer": lambda: [os.remove(teacher / n) for n in os.listdir(teacher) if "token" in n]}
        damage[case]()
    assert train_tiny(tmp_path / "run", 1, "--teacher", str(teacher)) == 2
    line = one_error_line(capsys.readouterr().err, f"grpo.train: error: --teacher {str(teacher)!r}: ")
    assert message in line, line
    assert os.listdir(tmp_path / "run") == ["run.lock"]  # refused before anything else is written


# ------------------------------------------------------------------------------------------------- resume
def test_resume_checks_the_teacher(teachers, fault_runs, tmp_path, capsys):
    """--resume refuses another teacher (its fingerprint old -> new), no teacher, another --distill-beta, and a
    teacher for a run saved without one, each in one line before loading anything; the same teacher in another
    folder resumes (the change printed) and ends exactly where the uninterrupted 3-step run ends."""
    a = ["--teacher", str(teachers["a"])]
    assert train_tiny(tmp_path / "full", 3, *a) == 0
    out = tmp_path / "run"
    assert train_tiny(out, 2, *a) == 0
    capsys.readouterr()
    before = snapshot(out)
    with open(out / "checkpoint-2" / "run_settings.json") as f:
        saved = json.load(f)["identity"]["teacher_weights"][:12]
    refused = [(["--teacher", str(teachers["b"])], f"teacher_weights sha256 {saved} -> "),
               ([], f"teacher_weights sha256 {saved} -> none"),
               (a + ["--distill-beta", "0.5"], "distill_beta 1.0 -> 0.5")]
    for argv, message in refused:
        assert train_tiny(out, 3, "--resume", *argv) == 2
        line = one_error_line(capsys.readouterr().err)
        assert "was saved by another run setup" in line and message in line, (argv, line)
        assert f"{saved} -> {saved}" not in line
        assert snapshot(out) == before
    moved = shutil.copytree(teachers["a"], tmp_path / "moved-teacher")
    assert train_tiny(out, 3, "--resume", "--teacher", str(moved)) == 0
    assert f"resume: teacher changed from {str(teachers['a'])!r} to {str(moved)!r}" in capsys.readouterr().out
    for x, y in zip(read_metrics(tmp_path / "full"), read_metrics(out)):
        assert [x[k] for k in SAME + ("distill/divergence",)] == [y[k] for k in SAME + ("distill/divergence",)]
    assert read_summary(out)["param_checksums"] == read_summary(tmp_path / "full")["param_checksums"]
    plain = shutil.copytree(fault_runs / "two", tmp_path / "plain")  # saved without a teacher
    assert train_tiny(plain, 3, "--resume", *a) == 2
    assert "teacher_weights sha256 none -> " in one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------------- the teacher
def _trainer(tmp_path, teacher, **options) -> Trainer:
    """A Trainer of the TINY student (width 16, 1 layer) with ``teacher``, 4 prompts x 4 unless ``options`` say."""
    (tmp_path / "run").mkdir()
    settings = dict(prompts_per_step=4, num_generations=4, hidden_size=16, num_layers=1, num_heads=2, eval_size=0,
                    progress=False)
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), teacher=str(teacher), **{**settings, **options})
    return Trainer(cfg, DistEnv())


def test_the_teacher_gets_no_gradient_and_is_not_saved(teachers, tmp_path):
    """After a 2-step run: every teacher parameter is frozen, without a gradient and bitwise the tensor in its
    folder; the teacher is in eval mode, in no optimizer group and no part of the policy's parameters or state; the
    checkpoint holds the student's tensors only (their names and shapes), and the optimizer state covers exactly
    the student's parameters, which did train."""
    from safetensors.torch import load_file

    trainer = _trainer(tmp_path, teachers["a"], max_steps=2, save_steps=1)
    initial = {k: v.clone() for k, v in trainer.lm.state_dict().items()}
    trainer.train()
    teacher = trainer.teacher.lm
    saved = load_file(os.path.join(teachers["a"], "model.safetensors"))
    assert not teacher.training and not trainer.teacher.policy.training
    for name, p in teacher.named_parameters():
        assert not p.requires_grad and p.grad is None, name
        assert torch.equal(p, saved[name]), name
    teacher_ids = {id(p) for p in teacher.parameters()}
    assert not teacher_ids & {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert not teacher_ids & {id(p) for p in trainer.model.parameters()}
    student = trainer.lm.state_dict()
    assert sorted(trainer.policy.state_dict()) == sorted(f"lm.{k}" for k in student)
    checkpoint = tmp_path / "run" / "checkpoint-2"
    weights = load_file(str(checkpoint / "model" / "model.safetensors"))
    assert {k: tuple(v.shape) for k, v in weights.items()} == \
        {k: tuple(v.shape) for k, v in student.items() if k in weights}
    assert all(TEACHER_WIDTH not in v.shape for v in weights.values())
    state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)["optimizer"]
    assert len(state["state"]) == sum(1 for p in trainer.lm.parameters() if p.requires_grad)
    assert any(not torch.equal(initial[k], v) for k, v in student.items())  # the student trained


def test_the_distillation_term_is_the_library_function_on_the_same_tensors(teachers, tmp_path):
    """One packed micro-batch of a rollout: the teacher's hidden states the step gathers are bitwise those of the
    teacher's own packed pass on it, and the policy's distillation term (--distill-beta 0.5, --distill-temperature
    0.7, --distill-coef 0.25) is ``0.25 * fused_linear_distill_loss`` called on the student's and the teacher's
    hidden states and heads (the suppressed ids' bias in both), bitwise, loss, metrics and gradient."""
    trainer = _trainer(tmp_path, teachers["a"], distill_beta=0.5, distill_temperature=0.7, distill_coef=0.25)
    policy, teacher = trainer.policy, trainer.teacher.policy
    assert policy.distill.config == gk.DistillLossConfig(beta=0.5, temperature=0.7)
    rollout, advantages = trainer.make_rollout()
    rollout.teacher_hidden = teacher_hidden_states(trainer.teacher, rollout, 16)
    (packed,) = packed_micro_batches(rollout, list(range(rollout.batch_size)), trainer.packing, 16)
    n = rollout.completion_mask.sum().float()
    ref = rollout_logprobs(trainer.ref, rollout, 16, trainer.packing)
    batch = {"packed": packed, "advantages": advantages[packed.rows], "ref_logps": packed.gather(ref),
             "teacher_hidden": packed.gather(rollout.teacher_hidden)}
    terms, metrics = policy(batch, distill_num_items=n)
    assert isinstance(terms, LossTerms) and terms.grpo is not None
    got_grad = torch.autograd.grad(terms.distill, policy.lm.lm_head.weight)[0]

    hidden, (weight, bias) = policy.packed_hidden(packed), policy.head()
    t_hidden, (t_weight, t_bias) = teacher.packed_hidden(packed), teacher.head()
    assert torch.equal(t_hidden, batch["teacher_hidden"])
    banned = bias == SUPPRESSED_LOGIT
    assert banned.any() and torch.equal(t_bias == SUPPRESSED_LOGIT, banned)
    loss, want = gk.fused_linear_distill_loss(hidden, weight, t_hidden, t_weight, packed.completion_mask,
                                              student_bias=bias, teacher_bias=t_bias, num_items_in_batch=n,
                                              cu_seqlens=packed.cu_seqlens, beta=0.5, temperature=0.7)
    want_grad = torch.autograd.grad(0.25 * loss, policy.lm.lm_head.weight)[0]
    assert torch.equal(terms.distill, 0.25 * loss)
    assert torch.equal(metrics["distill/divergence"], want["divergence"])
    assert torch.equal(metrics["distill/entropy"], want["entropy"])
    assert torch.equal(got_grad, want_grad)


def _step(policy, rollout, advantages, ref_logps, packing, micro: int):
    """(stats, flat gradient) of one optimizer step that does not move the weights."""
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    options = StepOptions(micro_batch_size=micro, max_grad_norm=0.0, env=DistEnv(), packing=packing)
    stats = optimizer_step(policy, policy, optimizer, scheduler, rollout, torch.arange(rollout.batch_size),
                           advantages, None, ref_logps, options)
    grad = torch.cat([p.grad.reshape(-1) for p in policy.parameters() if p.grad is not None])
    return stats, grad


def _float64(trainer: Trainer):
    """(policy, teacher) float64 copies of the trainer's (the policy's distillation term on the teacher copy)."""
    policy = copy.deepcopy(trainer.policy).double()
    policy.compute_dtype = torch.float64
    teacher = policy.distill.teacher  # deep-copied with the policy's plain attribute
    teacher.policy.double()
    teacher.policy.compute_dtype = torch.float64
    teacher.packing = None
    return policy, teacher


@pytest.mark.parametrize("only", [False, True], ids=["added", "alone"])
def test_a_distillation_step_matches_float64_by_the_three_way_rule(only, teachers, tmp_path):
    """One optimizer step on a rollout (8 prompts x 4, --distill-coef 0.5 added to dapo with beta 0.02, or
    --distill-only): packed in rows, in one row, under a 24-token budget, and in padded micro-batches of 5 rows
    against the float64 step (padded, one micro-batch; both models in float64), with the fp32 padded one-micro-batch
    step (the teacher's pass padded too) as the naive term: the loss, the divergence and entropy metrics, the
    student's gradient; ours take the teacher's hidden states from its packed pass, as the trainer does."""
    trainer = _trainer(tmp_path, teachers["a"], distill_coef=0.5, distill_only=only, prompts_per_step=8)
    rollout, advantages = trainer.make_rollout()
    B = rollout.batch_size
    ref = None if trainer.ref is None else rollout_logprobs(trainer.ref, rollout, B)
    truth_policy, truth_teacher = _float64(trainer)
    rollout.teacher_hidden = teacher_hidden_states(truth_teacher, rollout, B)
    truth, truth_grad = _step(truth_policy, rollout, advantages.double(), None if ref is None else ref.double(),
                              None, B)
    padded_teacher = dataclasses.replace(trainer.teacher, packing=None)
    rollout.teacher_hidden = teacher_hidden_states(padded_teacher, rollout, B)
    naive, naive_grad = _step(trainer.policy, rollout, advantages, ref, None, B)
    rollout.teacher_hidden = teacher_hidden_states(trainer.teacher, rollout, B)  # packed, as the trainer runs it
    # bound: not a tolerance: an informative gradient and divergence, far above fp32 rounding
    assert naive_grad.abs().max() > 1e-3 and naive["distill/divergence"] > 1e-2
    keys = ("loss", "distill/divergence", "distill/entropy") + (() if only else ("kl", "entropy"))
    for layout, micro in ((Packing(), B), (Packing(one_row=True), B), (Packing(max_tokens=24), B), (None, 5)):
        ours, grad = _step(trainer.policy, rollout, advantages, ref, layout, micro)
        what = f"{'alone' if only else 'added'} {layout} micro={micro}"
        for key in keys:
            assert_three_way(ours[key], naive[key], truth[key], torch.float32, f"{what}: {key}")
        assert_three_way(grad, naive_grad, truth_grad, torch.float32, f"{what}: gradient",
                         scale=grad_scale(truth_grad))


def test_the_distillation_loss_is_the_token_mean_of_full_logits_in_float64(teachers, tmp_path):
    """Independent of the package's divergence: the reverse KL of the two models' full softmaxes (their logits from
    the models' own forwards on the padded rows, the suppressed ids left out of both), masked token mean, in
    float64, against the trainer's fp32 --distill-only step loss, and the same formula in fp32 as the naive term:
    the trainer aligns the teacher's positions with the student's and scores what the sampler can draw."""
    trainer = _trainer(tmp_path, teachers["a"], distill_only=True)
    rollout, advantages = trainer.make_rollout()
    rollout.teacher_hidden = teacher_hidden_states(trainer.teacher, rollout, 16)
    ours, _ = _step(trainer.policy, rollout, advantages, None, trainer.packing, 16)
    allowed = trainer.policy.suppress_bias == 0

    def reverse_kl(dtype):
        P, mask = rollout.prompt_length, rollout.completion_mask
        ids, attn = rollout.input_ids, rollout.attention_mask
        positions = (attn.long().cumsum(-1) - 1).clamp(min=0)
        logp = []
        for lm in (trainer.lm, trainer.teacher.lm):
            lm = copy.deepcopy(lm).to(dtype)
            with torch.no_grad():
                logits = lm(input_ids=ids, attention_mask=attn, position_ids=positions).logits[:, P - 1:-1]
            logp.append(torch.log_softmax(logits[..., allowed], dim=-1))
        student, teacher = logp
        kl = (student.exp() * (student - teacher)).sum(-1)
        return (kl * mask).sum() / mask.sum()

    truth, naive = reverse_kl(torch.float64), reverse_kl(torch.float32)
    assert_three_way(ours["loss"], naive.item(), truth.item(), torch.float32, "distillation loss")
    # bound: not a tolerance: the random teacher is far from the student (a divergence of order 1)
    assert truth.item() > 0.1


# ------------------------------------------------------------------------------------------------- torchrun
@pytest.mark.slow  # torchrun jobs of two processes (~10 s each on the 2-core machine), as the other torchrun tests
@pytest.mark.parametrize("sharding", [[], ["--fsdp"]], ids=["ddp", "fsdp"])
def test_torchrun_ranks_stay_in_sync_with_a_teacher(sharding, teachers, tmp_path):
    """torchrun + gloo, 2 ranks, each with its own full copy of the teacher: DDP replicas (FSDP2 shards: the full
    parameters' checksum) agree after 3 steps, every step logs the divergence, and the checkpoint is the student's."""
    out = tmp_path / "run"
    proc = run_cmd([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                    "-m", "grpo.train", *TINY, "--output-dir", str(out), "--max-steps", "3", "--teacher",
                    str(teachers["a"]), *sharding], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    summary = read_summary(out)
    assert summary["world_size"] == 2 and summary["param_checksums"][0] == summary["param_checksums"][1]
    assert all(r["distill/divergence"] > 0 for r in read_metrics(out))
    assert "WARNING" not in proc.stdout
    from safetensors.torch import load_file

    weights = load_file(str(out / "checkpoint-3" / "model" / "model.safetensors"))
    assert all(TEACHER_WIDTH not in v.shape for v in weights.values())
