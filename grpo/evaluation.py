"""Evaluation: greedy completions of the evaluation prompts, scored by the rewards.

The evaluation set is "held-out" only when none of its prompts is a training prompt (the split of the training data,
or an ``--eval-dataset`` disjoint from ``--dataset``); otherwise the plot and the summary call it
"eval (training prompts)", since accuracy on prompts the policy trains on measures memorization, not generalization.

``eval/accuracy`` is the fraction of held-out prompts whose greedy completion gets full credit (>= 1) from the first
reward function (for ``copy``: the exact string followed by EOS; for ``math``: the right number); ``eval/reward`` is
the mean weighted reward, as in training. Greedy decoding consumes no random numbers, so evaluating does not change
the training run (a resumed run stays identical to an uninterrupted one).
"""
from __future__ import annotations

import json

import torch

from .data import prompt_key
from .rollout import Sampler

FULL_CREDIT = 1.0 - 1e-6


class Evaluator:
    """``overlap``: how many distinct evaluation prompts are also training prompts (``data.training_overlap``)."""

    def __init__(self, sampler: Sampler, rows: list[dict], texts: list[str], batch_size: int = 256,
                 overlap: int = 0):
        self.sampler, self.rows, self.texts, self.batch_size = sampler, rows, texts, batch_size
        self.overlap = overlap
        self.samples: list[tuple[str, str, float]] = []  # (prompt, greedy completion, reward) of the last call

    @property
    def held_out(self) -> bool:
        return self.overlap == 0

    @property
    def label(self) -> str:
        """What the evaluation set is, for the plot and the summary: "held-out" or "eval (training prompts)"."""
        return "held-out" if self.held_out else f"eval ({self.overlap_text})"

    @property
    def overlap_text(self) -> str:
        distinct = len({prompt_key(r["prompt"]) for r in self.rows})
        if self.overlap >= distinct:
            return "training prompts"
        return f"{self.overlap} of {distinct} prompts also in training"

    def __len__(self) -> int:
        return len(self.rows)

    def evaluate(self) -> dict:
        first, total, truncated, samples = [], [], [], []
        for start in range(0, len(self.rows), self.batch_size):
            end = start + self.batch_size
            ro = self.sampler.rollout(self.texts[start:end], self.rows[start:end], greedy=True)
            first.append(ro.rewards[:, 0])
            total.append(ro.reward_total)
            truncated.append(ro.truncated)
            samples += [(p, c, float(r)) for p, c, r in zip(ro.prompts, ro.completions, ro.reward_total)]
        first, total = torch.cat(first), torch.cat(total)
        self.samples = samples
        return {"eval/accuracy": float((torch.nan_to_num(first, nan=0.0) >= FULL_CREDIT).float().mean()),
                "eval/reward": float(torch.nanmean(total)),
                "eval/truncated_ratio": float(torch.cat(truncated).float().mean())}


def last_eval_before(metrics_path: str, step: int) -> dict | None:
    """The last metrics.jsonl record at or before ``step`` that holds an evaluation (None if there is none); lines
    that do not parse (a torn last line) are skipped."""
    found = None
    try:
        with open(metrics_path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue
                if isinstance(record, dict) and "eval/accuracy" in record and record.get("step", step + 1) <= step:
                    found = record
    except OSError:
        return None
    return found


def describe_evals(evals: list[dict], evaluator: Evaluator, resumed_step: int | None = None,
                   metrics_path: str | None = None) -> str:
    """The summary line of the greedy accuracy, saying which two evaluations it compares: the first and the last of
    this run, or, for a run resumed at ``resumed_step``, the last evaluation before resuming (from ``metrics_path``)
    and the last of this run."""
    earlier = None if resumed_step is None or metrics_path is None else last_eval_before(metrics_path, resumed_step)
    what = f"greedy accuracy on the {len(evaluator)} held-out prompts" if evaluator.held_out else \
        f"greedy accuracy on the {len(evaluator)} eval prompts ({evaluator.overlap_text})"
    last = evals[-1]
    end = f"{last['eval/accuracy']:.3f} at step {last['step']}"
    if resumed_step is None:
        return f"{what} {evals[0]['eval/accuracy']:.3f} at step {evals[0]['step']} -> {end}"
    if earlier is not None:
        return f"{what} {earlier['eval/accuracy']:.3f} at step {earlier['step']} (before resuming) -> {end}"
    if len(evals) > 1:
        return (f"{what} {evals[0]['eval/accuracy']:.3f} at step {evals[0]['step']} (first evaluation after resuming "
                f"at step {resumed_step}) -> {end}")
    return f"{what}: {end} (resumed at step {resumed_step}; no evaluation before it to compare with)"


def summary_fields(evals: list[dict], evaluator: Evaluator) -> dict:
    """run_summary.json keys that say what the first_* / final_* evaluation values are."""
    return {"eval_set": evaluator.label, "eval_held_out": evaluator.held_out,
            "first_eval_step": evals[0]["step"], "final_eval_step": evals[-1]["step"]}


def step_span(records: list[dict]) -> str:
    """'step 7' or 'steps 801-810': which optimizer steps a summary value averages."""
    if len(records) == 1:
        return f"step {records[0]['step']}"
    return f"steps {records[0]['step']}-{records[-1]['step']}"
