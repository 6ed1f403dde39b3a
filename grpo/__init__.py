"""Standalone GRPO training on top of grpo_kernels: ``python -m grpo.train`` (see grpo/train.py).

Modules: cli (options), modeling (tiny model, tokenizer, checkpoint loading), data (tasks, JSONL, sampler),
rewards (rule-based and custom rewards), rollout (generation + scoring), policy (the DDP-wrapped loss module),
trainer (the loop), checkpoint, metrics (jsonl, plot, progress), distributed.
"""
