"""Standalone GRPO training on top of grpo_kernels: ``python -m grpo.train`` (see grpo/train.py), or from Python
``grpo.train.train(grpo.TrainConfig(...))``.

Modules: config (TrainConfig), cli (flags -> TrainConfig), modeling (tiny model, tokenizer, checkpoint loading),
data (tasks, JSONL, held-out split, sampler), rewards (rule-based and custom rewards), rollout (sampling +
scoring), policy (the DDP-wrapped loss module), update (one optimizer step), evaluation (greedy held-out accuracy),
trainer (the loop), checkpoint (and run folders), run_folder (lock, atomic writes), run_settings (what a resume must
match), metrics (jsonl, plot, progress), distributed.
"""
from .config import TrainConfig

__all__ = ["TrainConfig"]
