"""Time per optimizer step of ``grpo.train`` against TRL's ``GRPOTrainer``, side by side on the same task (CPU).

Both trainers start from the same saved tiny Llama (the built-in model of ``grpo.train``: hidden 64, 2 layers,
printable-ASCII character tokenizer) and train the built-in copy task with the same batch (16 prompts x G = 8),
completion limit (6 tokens), temperature, loss (dapo, beta 0.02: a reference model in both), AdamW, warmup and
cosine schedule. A step is everything a training step costs: generation, rewards, reference log-probs, the
loss forward/backward and the optimizer. Runs alternate (ours, TRL, ours, TRL) so that a busy machine slows
both alike; the median step after the first two of each run is reported in ``extra_info``
(``ours_step_s``, ``trl_step_s``, ``ratio`` = ours / TRL). Takes about 30 s on one CPU thread.
"""
from __future__ import annotations

import statistics
import time
import warnings

import pytest
import torch

pytest.importorskip("trl")

STEPS = 14           # optimizer steps per run; the first 2 (warm-up, allocator) are not counted
REPEATS = 2          # runs per trainer, alternating
BATCH = dict(prompts=16, G=8, max_new_tokens=6, lr=1e-3, beta=0.02, warmup=2)


def _save_tiny_model(path: str) -> None:
    from grpo.data import PRINTABLE_ASCII
    from grpo.modeling import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer(PRINTABLE_ASCII)
    torch.manual_seed(0)
    build_tiny_model(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)


def _ours(model_dir: str, out_dir: str) -> list[float]:
    """Seconds per optimizer step of grpo.train (from the elapsed time in its metrics records)."""
    from grpo import TrainConfig
    from grpo.train import train
    from grpo_kernels import GRPOLossConfig

    cfg = TrainConfig(model=model_dir, output_dir=out_dir, overwrite=True, max_steps=STEPS, progress=False,
                      save_steps=0, eval_size=0, device="cpu", prompts_per_step=BATCH["prompts"],
                      num_generations=BATCH["G"], max_new_tokens=BATCH["max_new_tokens"], lr=BATCH["lr"],
                      warmup_steps=BATCH["warmup"], chat_template="off", rewards=("copy",),
                      loss=GRPOLossConfig(beta=BATCH["beta"]))
    elapsed = [r["elapsed_s"] for r in train(cfg)["history"]]
    return [b - a for a, b in zip(elapsed, elapsed[1:])][1:]


def _trl(model_dir: str, out_dir: str) -> list[float]:
    """Seconds per optimizer step of TRL's GRPOTrainer (between on_step_end callbacks)."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo.data import builtin_copy_task
    from grpo.rewards import copy_reward

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter())

    rows = builtin_copy_task()
    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows], "answer": [r["answer"] for r in rows]})
    clock = StepClock()
    args = GRPOConfig(output_dir=out_dir, per_device_train_batch_size=BATCH["prompts"] * BATCH["G"],
                      num_generations=BATCH["G"], max_completion_length=BATCH["max_new_tokens"],
                      max_steps=STEPS, learning_rate=BATCH["lr"], beta=BATCH["beta"], loss_type="dapo",
                      warmup_steps=BATCH["warmup"], lr_scheduler_type="cosine", adam_beta2=0.99,
                      max_grad_norm=1.0, logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0,
                      save_strategy="no", disable_tqdm=True, model_init_kwargs={"dtype": torch.float32})
    trainer = GRPOTrainer(model=model_dir, reward_funcs=[copy_reward], args=args, train_dataset=dataset,
                          processing_class=AutoTokenizer.from_pretrained(model_dir), callbacks=[clock])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [b - a for a, b in zip(clock.times, clock.times[1:])][1:]


def test_trainer_step_vs_trl(benchmark, tmp_path):
    model_dir = str(tmp_path / "tiny")
    _save_tiny_model(model_dir)
    ours, trl = [], []

    def both():
        for i in range(REPEATS):
            ours.extend(_ours(model_dir, str(tmp_path / f"ours{i}")))
            trl.extend(_trl(model_dir, str(tmp_path / f"trl{i}")))

    benchmark.pedantic(both, rounds=1, iterations=1)
    ours_s, trl_s = statistics.median(ours), statistics.median(trl)
    benchmark.extra_info.update(path="trainer", provider="grpo.train vs trl.GRPOTrainer", mode="train_step",
                                ours_step_s=ours_s, trl_step_s=trl_s, ratio=ours_s / trl_s,
                                threads=torch.get_num_threads(), steps_timed=len(ours))
    print(f"\nper optimizer step: grpo.train {ours_s * 1e3:.1f} ms, TRL GRPOTrainer {trl_s * 1e3:.1f} ms, "
          f"ratio {ours_s / trl_s:.2f}")
    # Not a timing assertion (shared CI machines): only that both ran and were measured.
    assert len(ours) == len(trl) == REPEATS * (STEPS - 2)
