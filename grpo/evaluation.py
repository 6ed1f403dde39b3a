"""Held-out evaluation: greedy completions of prompts the policy never trains on, scored by the rewards.

``eval/accuracy`` is the fraction of held-out prompts whose greedy completion gets full credit (>= 1) from the first
reward function (for ``copy``: the exact string followed by EOS; for ``math``: the right number); ``eval/reward`` is
the mean weighted reward, as in training. Greedy decoding consumes no random numbers, so evaluating does not change
the training run (a resumed run stays identical to an uninterrupted one).
"""
from __future__ import annotations

import torch

from .rollout import Sampler

FULL_CREDIT = 1.0 - 1e-6


class Evaluator:
    def __init__(self, sampler: Sampler, rows: list[dict], texts: list[str], batch_size: int = 256):
        self.sampler, self.rows, self.texts, self.batch_size = sampler, rows, texts, batch_size
        self.samples: list[tuple[str, str, float]] = []  # (prompt, greedy completion, reward) of the last call

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
