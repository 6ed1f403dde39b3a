"""The GRPO loop, in plain PyTorch.

One *rollout* per process: sample ``--prompts-per-step`` prompts, generate G completions each, score them, turn
rewards into group advantages; compute reference log-probs (beta != 0) and old-policy log-probs (when the rollout
is used for more than one optimizer step) with the no-grad fused path; then ``--num-iterations`` passes over the
rollout in mini-batches, one optimizer step each, gradient-accumulated over micro-batches, clipped, AdamW, LR
schedule. One line of metrics.jsonl per optimizer step.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import grpo_kernels as gk
from grpo_kernels.loss_types import LOSS_TABLE

from . import checkpoint as ckpt
from .data import BUILTIN_TASKS, TASK_ALPHABET, PromptSampler, format_prompt, load_jsonl, seed_everything
from .distributed import DistEnv, all_reduce_sum, barrier, reduce_mean_dict
from .errors import UsageError
from .metrics import MetricsLog, Progress, plot_curves
from .modeling import (DTYPES, apply_liger_layers, build_char_tokenizer, build_tiny_model,
                       choose_attn_implementation, disable_dropout, eos_token_ids, load_pretrained)
from .policy import GRPOPolicy
from .rollout import GenerationSettings, Rollout, generate_rollout

NEEDS_ANSWER = {"copy", "math", "boxed", "hash", "last_number"}


def lr_lambda(args):
    def fn(step: int) -> float:
        if step < args.warmup_steps:
            return (step + 1) / (args.warmup_steps + 1)
        if args.lr_scheduler == "constant":
            return 1.0
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if args.lr_scheduler == "cosine" else 1 - progress
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * shape
    return fn


class Trainer:
    def __init__(self, args, env: DistEnv):
        self.args, self.env, self.device = args, env, env.device
        self.cfg: gk.GRPOLossConfig = args.loss_config
        self.rewards = args.reward_specs
        self.rows = self._load_rows()
        seed_everything(args.seed)  # identical initial weights on every rank
        self.lm, self.tokenizer = self._build_model()
        self.eos_ids = eos_token_ids(self.lm, self.tokenizer)
        self.use_chat = self._use_chat_template()

        param_dtype = next(self.lm.parameters()).dtype
        autocast = None if args.autocast == "none" else DTYPES.get(args.autocast)
        if args.autocast == "auto":
            autocast = torch.bfloat16 if self.device.type == "cuda" and param_dtype == torch.float32 else None
        self.autocast = autocast
        compute_dtype = autocast or param_dtype
        self.policy = GRPOPolicy(self.lm, self.cfg, args.impl, compute_dtype, autocast)
        self.ref = None
        if self.cfg.beta != 0.0:  # frozen copy of the *initial* policy (before any resume)
            ref_lm = copy.deepcopy(self.lm).requires_grad_(False).eval()
            if autocast is not None:  # the frozen copy needs no fp32 master weights: half the memory
                ref_lm.to(autocast)
            if args.gradient_checkpointing:
                ref_lm.gradient_checkpointing_disable()
            self.ref = GRPOPolicy(ref_lm, self.cfg, args.impl, compute_dtype, autocast)
        self.model = self.policy
        if env.enabled:
            self.model = DDP(self.policy, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=args.lr, betas=(args.adam_beta1, args.adam_beta2),
                                           weight_decay=args.weight_decay,
                                           foreach=self.device.type == "cuda" or None)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(args))
        self.sampler = PromptSampler(len(self.rows), args.seed, env.rank, env.world_size)
        self.gen = GenerationSettings(args.num_generations, args.max_new_tokens, args.temperature, args.top_p,
                                      args.top_k, args.max_prompt_length)
        # Sampling streams differ per rank (each rank generates its own groups); restored on resume.
        torch.manual_seed(args.seed * 7919 + 104729 * (env.rank + 1))
        self.step = 0
        self.resumed_from = None
        if args.resume is not None:
            self.resumed_from = ckpt.resolve_resume_path(args.resume, args.output_dir)
            self.step = ckpt.load_checkpoint(self.resumed_from, model=self.lm, optimizer=self.optimizer,
                                             scheduler=self.scheduler, sampler=self.sampler, env=env)
        self.last_rollout: Rollout | None = None

    # ------------------------------------------------------------------------------------------- setup
    def _load_rows(self) -> list[dict]:
        a = self.args
        if a.dataset is None:
            return BUILTIN_TASKS[a.task]()
        needs = any(s.name in NEEDS_ANSWER for s in self.rewards)
        return load_jsonl(a.dataset, require_answer=needs)

    def _build_model(self):
        a = self.args
        dtype = torch.float32 if a.dtype == "auto" else DTYPES[a.dtype]
        if a.model is None:
            tokenizer = build_char_tokenizer(TASK_ALPHABET)
            lm = build_tiny_model(tokenizer, a.hidden_size, a.num_layers, a.num_heads,
                                  max_positions=max(128, 8 + a.max_new_tokens + (a.max_prompt_length or 64)))
            if a.dataset is not None:  # a dataset with characters outside the tiny alphabet would be all <unk>
                unknown = sorted({c for r in self.rows for c in str(r["prompt"]) if c not in TASK_ALPHABET})
                if unknown:
                    raise UsageError(f"--dataset uses characters {''.join(unknown[:20])!r} that the built-in "
                                     "character tokenizer does not know; pass --model PATH for real text")
            attn = choose_attn_implementation(a.attn_implementation, self.device)
            lm.config._attn_implementation = "sdpa" if attn == "flash_attention_2" else attn
            lm = lm.to(dtype)
        else:
            lm, tokenizer = load_pretrained(a.model, dtype, choose_attn_implementation(a.attn_implementation,
                                                                                        self.device),
                                            a.trust_remote_code)
        disable_dropout(lm)
        lm.to(self.device)
        if a.liger_layers:
            apply_liger_layers(lm, self.device)
        if a.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
        return lm, tokenizer

    def _use_chat_template(self) -> bool:
        mode = self.args.chat_template
        has = getattr(self.tokenizer, "chat_template", None) is not None
        if mode == "on" and not has:
            raise UsageError("--chat-template on: the tokenizer has no chat template")
        return mode == "on" or (mode == "auto" and has)

    # ------------------------------------------------------------------------------------------- rollout
    def make_rollout(self) -> tuple[Rollout, torch.Tensor]:
        rows = [self.rows[i] for i in self.sampler.next(self.args.prompts_per_step)]
        texts = [format_prompt(r["prompt"], self.tokenizer, self.use_chat, self.args.system_prompt) for r in rows]
        rollout = generate_rollout(self.lm, self.tokenizer, texts, rows, self.gen, self.eos_ids, self.rewards,
                                   self.device, add_special_tokens=not self.use_chat, autocast_dtype=self.autocast)
        if self.args.mask_truncated_completions:
            rollout.completion_mask &= ~rollout.truncated.to(self.device)[:, None]
        advantages = gk.group_advantages(rollout.rewards, self.args.num_generations, scale=self.args.advantage_scale,
                                         weights=[s.weight for s in self.rewards])
        return rollout, advantages.to(self.device)

    @torch.no_grad()
    def _logprobs(self, policy: GRPOPolicy, rollout: Rollout) -> torch.Tensor:
        out = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=self.device)
        for rows in torch.arange(rollout.batch_size, device=self.device).split(self.args.micro_batch_size):
            batch = trim(rollout.batch(rows))
            out[rows, :batch["completion_ids"].shape[1]] = policy.token_logprobs(batch)
        return out

    # ------------------------------------------------------------------------------------------- update
    def optimizer_step(self, rollout, rows, advantages, old_logps, ref_logps) -> dict:
        a = self.args
        self.optimizer.zero_grad(set_to_none=True)
        micro_rows = rows.split(a.micro_batch_size)
        n_tokens = rollout.completion_mask[rows].sum().to(torch.float64)
        all_reduce_sum(n_tokens, self.env)
        # Loss types normalized by num_items_in_batch divide by the token count of the whole optimizer step; the
        # others normalize inside each micro-batch, so their micro-batch losses are averaged.
        global_norm = LOSS_TABLE[self.cfg.loss_type].uses_num_items_in_batch
        num_items = (n_tokens / self.env.world_size).to(torch.float32) if global_norm else None
        sums: dict[str, float] = {}
        loss_total = 0.0
        for i, mrows in enumerate(micro_rows):
            batch = trim(rollout.batch(mrows, advantages=advantages, old_logps=old_logps, ref_logps=ref_logps))
            last = i == len(micro_rows) - 1
            sync = self.model.no_sync() if self.env.enabled and not last else contextlib.nullcontext()
            with sync:
                loss, metrics = self.model(batch, num_items_in_batch=num_items)
                scaled = loss if global_norm else loss / len(micro_rows)
                scaled.backward()
            loss_total += float(scaled.detach())
            weight = float(batch["completion_mask"].sum())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * weight
            sums["_tokens"] = sums.get("_tokens", 0.0) + weight
        params = [p for p in self.policy.parameters() if p.requires_grad]
        max_norm = a.max_grad_norm if a.max_grad_norm > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.optimizer.step()
        self.scheduler.step()
        tokens = max(sums.pop("_tokens"), 1.0)
        out = {k: v / tokens for k, v in sums.items()}
        out.update(loss=loss_total, grad_norm=grad_norm)
        return out

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        a, env = self.args, self.env
        if env.is_main:
            os.makedirs(a.output_dir, exist_ok=True)
            with open(os.path.join(a.output_dir, "args.json"), "w") as f:
                json.dump(_plain_args(a), f, indent=2, default=str)
        barrier(env)
        log = MetricsLog(a.output_dir, resume_step=self.step if self.resumed_from else None) \
            if env.is_main else None
        progress = Progress(a.max_steps, self.step, enabled=env.is_main and not a.no_progress)
        if self.resumed_from and env.is_main:
            progress.write(f"resumed from {self.resumed_from} at step {self.step}")
        rollout_size = a.prompts_per_step * a.num_generations
        minibatches = rollout_size // a.mini_batch_size
        off_policy = a.num_iterations > 1 or minibatches > 1
        start_time, last_saved, rollout_index = time.time(), self.step, 0
        start_step = self.step
        history = []
        while self.step < a.max_steps:
            t0 = time.time()
            rollout, advantages = self.make_rollout()
            self.last_rollout = rollout
            old_logps = self._logprobs(self.policy, rollout) if off_policy else None
            ref_logps = self._logprobs(self.ref, rollout) if self.ref is not None else None
            rollout_stats = self._rollout_stats(rollout, time.time() - t0)
            for _ in range(a.num_iterations):
                order = torch.randperm(rollout_size, device=self.device) if minibatches > 1 else \
                    torch.arange(rollout_size, device=self.device)
                for rows in order.split(a.mini_batch_size):
                    stats = self.optimizer_step(rollout, rows, advantages, old_logps, ref_logps)
                    self.step += 1
                    record = self._record(stats, rollout_stats, rollout_index, t0, start_time)
                    history.append(record)
                    if env.is_main:
                        log.write(record)
                        progress.update(self.step, record)
                    if self.step >= a.max_steps:
                        break
                if self.step >= a.max_steps:
                    break
            rollout_index += 1
            if a.save_steps and self.step // a.save_steps > last_saved // a.save_steps and self.step < a.max_steps:
                self.save(progress)
                last_saved = self.step
        progress.close()
        if self.step != last_saved or (self.step > start_step and self.resumed_from is None):
            self.save(None)
        checksums = self.param_checksums()
        if env.is_main:
            log.close()
            plot_curves(log.path, os.path.join(a.output_dir, "curves.png"))
            self._summary(history, time.time() - start_time, checksums)
        return {"history": history, "param_checksums": checksums}

    def param_checksums(self) -> list[float]:
        """One float64 checksum of all parameters per rank (rank order): equal values = ranks in sync."""
        with torch.no_grad():
            total = sum(float(p.double().sum()) + 1e-3 * float(p.double().abs().sum())
                        for p in self.policy.parameters())
        t = torch.zeros(self.env.world_size, dtype=torch.float64, device=self.device)
        t[self.env.rank] = total
        all_reduce_sum(t, self.env)
        return t.tolist()

    def _rollout_stats(self, rollout: Rollout, gen_time: float) -> dict:
        r = rollout.reward_total
        stats = {"reward_mean": float(torch.nanmean(r)),
                 "reward_std": float(torch.nan_to_num(r, nan=0.0).std()) if r.numel() > 1 else 0.0,
                 "completion_length": float(rollout.completion_mask.sum(1).float().mean()),
                 "truncated_ratio": float(rollout.truncated.float().mean()),
                 "generation_s": gen_time,
                 "_gen_tokens": float(rollout.completion_mask.sum())}
        for j, spec in enumerate(self.rewards):
            stats[f"reward/{spec.name}"] = float(torch.nanmean(rollout.rewards[:, j]))
        return stats

    def _record(self, stats: dict, rollout_stats: dict, rollout_index: int, t0: float, start: float) -> dict:
        merged = {k: v for k, v in rollout_stats.items()}
        merged.update(stats)
        merged = reduce_mean_dict(merged, self.env)
        tokens = merged.pop("_gen_tokens") * self.env.world_size  # mean over ranks x ranks = global count
        now = time.time()
        record = {"step": self.step, "rollout": rollout_index, "reward_mean": merged.pop("reward_mean"),
                  "kl": merged.pop("kl", 0.0), "loss": merged.pop("loss"),
                  "clip_ratio": merged.pop("clip_ratio/region_mean", 0.0)}
        record.update(merged)
        record.update(lr=self.scheduler.get_last_lr()[0], tokens_per_s=tokens / max(now - t0, 1e-9),
                      elapsed_s=now - start)
        return record

    def save(self, progress: Progress | None) -> None:
        path = ckpt.checkpoint_dir(self.args.output_dir, self.step)
        ckpt.save_checkpoint(path, step=self.step, model=self.lm, tokenizer=self.tokenizer,
                             optimizer=self.optimizer, scheduler=self.scheduler, sampler=self.sampler,
                             args=_plain_args(self.args), env=self.env)
        if self.env.is_main:
            ckpt.prune_checkpoints(self.args.output_dir, self.args.save_total_limit)
            plot_curves(os.path.join(self.args.output_dir, "metrics.jsonl"),
                        os.path.join(self.args.output_dir, "curves.png"))
            if progress is not None:
                progress.write(f"step {self.step}: saved {path}")

    def _summary(self, history: list[dict], seconds: float, checksums: list[float]) -> None:
        if len(set(checksums)) > 1:
            print(f"[grpo.train] WARNING: ranks' parameters differ: {checksums}", flush=True)
        if not history:
            return
        k = max(1, min(10, len(history) // 4))
        first = sum(r["reward_mean"] for r in history[:k]) / k
        last = sum(r["reward_mean"] for r in history[-k:]) / k
        with open(os.path.join(self.args.output_dir, "run_summary.json"), "w") as f:
            json.dump({"steps": self.step, "steps_this_run": len(history), "seconds": seconds,
                       "world_size": self.env.world_size, f"reward_first_{k}": first, f"reward_last_{k}": last,
                       "final_kl": history[-1]["kl"], "param_checksums": checksums}, f, indent=2)
        print(f"[grpo.train] {len(history)} steps in {seconds:.1f}s; reward (mean of {k} steps) "
              f"{first:.3f} -> {last:.3f}; kl {history[-1]['kl']:.4f}; outputs in {self.args.output_dir}",
              flush=True)
        if self.last_rollout is not None:
            ro = self.last_rollout
            for i in range(min(3, len(ro.completions))):
                j = i * self.args.num_generations
                print(f"[grpo.train] sample: {ro.prompts[j]!r} -> {ro.completions[j]!r} "
                      f"(reward {float(ro.reward_total[j]):.2f})", flush=True)


def _plain_args(args) -> dict:
    """The command-line values only (no derived objects), for args.json and checkpoints."""
    return {k: v for k, v in vars(args).items() if k not in ("loss_config", "reward_specs")}


def trim(batch: dict) -> dict:
    """Drop the columns no row of this (micro-)batch needs: shared left padding of the prompts and the
    completion tail after every row's last loss token. Exact: causal attention never looks right."""
    mask = batch["completion_mask"]
    P = batch["prompt_length"]
    used = mask.any(dim=0).nonzero()
    T = int(used[-1]) + 1 if used.numel() else 1
    lead = int((batch["attention_mask"][:, :P].sum(dim=0) > 0).nonzero()[0])
    out = dict(batch)
    out["input_ids"] = batch["input_ids"][:, lead:P + T]
    out["attention_mask"] = batch["attention_mask"][:, lead:P + T]
    out["prompt_length"] = P - lead
    for key in ("completion_ids", "completion_mask", "old_logps", "ref_logps"):
        if key in batch:
            out[key] = batch[key][:, :T]
    return out
