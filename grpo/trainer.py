"""The GRPO loop, in plain PyTorch.

One *rollout* per process: sample ``prompts_per_step`` prompts, generate G completions each, score them, turn
rewards into group advantages; compute reference log-probs (beta != 0) and old-policy log-probs (when the rollout
is used for more than one optimizer step) with the no-grad fused path; then ``num_iterations`` passes over the
rollout in mini-batches, one optimizer step each (grpo/update.py). One line of metrics.jsonl per optimizer step;
every ``eval_every`` steps (and at the start and the end) a greedy evaluation on held-out prompts joins that line.
"""
from __future__ import annotations

import copy
import os
import time

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import grpo_kernels as gk

from . import checkpoint as ckpt
from . import run_settings, sharding
from .config import TrainConfig
from .data import (BUILTIN_TASKS, PRINTABLE_ASCII, TRAIN_ROW_WEIGHTING, PromptSampler, check_completion_chars,
                   fit_to_context, format_prompt, load_jsonl, split_eval, training_overlap)
from .distillation import DistillTerm, distill_config, load_teacher, teacher_hidden_states
from .distributed import DistEnv, barrier, read_scalars
from .errors import UsageError
from .evaluation import Evaluator, describe_evals, step_span, summary_fields
from .metrics import MetricsLog, Progress, plot_curves, plot_curves_best_effort, read_metrics
from .modeling import (apply_liger_layers, build_char_tokenizer, build_tiny_model,
                       choose_attn_implementation, disable_dropout, eos_token_ids, load_pretrained, run_dtypes)
from .packing import choose_packing
from .policy import GRPOPolicy
from .run_folder import write_json
from .rollout import GenerationSettings, Rollout, Sampler, suppressed_token_ids
from .update import StepOptions, optimizer_step_unread, rollout_logprobs

NEEDS_ANSWER = {"copy", "math", "boxed", "hash", "last_number"}
SCHEDULERS = {"cosine": "cosine_with_min_lr", "linear": "linear", "constant": "constant_with_warmup"}


class Trainer:
    def __init__(self, cfg: TrainConfig, env: DistEnv):
        from transformers import get_scheduler, set_seed

        self.cfg, self.env, self.device = cfg, env, env.device
        if cfg.single_pass and env.enabled:  # the one condition TrainConfig cannot check: known under torchrun only
            raise UsageError("--single-pass backpropagates through the sampling forward, which DDP's hooks do not see: "
                             "run it in one process, or drop --single-pass")
        if self.device.type == "cpu" and cfg.model is None and "OMP_NUM_THREADS" not in os.environ:
            # The built-in model's matmuls are too small to gain from more threads, and on a busy machine extra
            # OpenMP threads spin against other processes (steps 5-10x slower); OMP_NUM_THREADS overrides.
            torch.set_num_threads(1)
        ckpt.prepare_output_dir(cfg.output_dir, resume=cfg.resume is not None, overwrite=cfg.overwrite,
                                is_main=env.is_main)
        train_rows, eval_rows = self._load_rows()
        set_seed(cfg.seed)  # identical initial weights on every rank
        self.lm, self.tokenizer = self._build_model(train_rows + eval_rows)
        self.eos_ids = eos_token_ids(self.lm, self.tokenizer)
        banned = suppressed_token_ids(self.tokenizer, self.lm.get_output_embeddings().weight.shape[0], self.eos_ids,
                                      cfg.completion_chars)
        # --teacher: loaded, checked and frozen before anything trains (grpo/distillation.py)
        self.teacher = None if cfg.teacher is None else load_teacher(cfg, self.lm, self.tokenizer, self.device,
                                                                     banned)
        self.run_settings = run_settings.describe(cfg.to_dict(), weights=self._initial_weights,
                                                  tokenizer=self.tokenizer, train_rows=train_rows,
                                                  eval_rows=eval_rows, world_size=env.world_size,
                                                  teacher=self.teacher and self.teacher.fingerprint)
        check_completion_chars(cfg.completion_chars, self.tokenizer, self.lm.get_output_embeddings().weight.shape[0],
                               banned, builtin=cfg.model is None)
        use_chat = self._use_chat_template()

        param_dtype, autocast = run_dtypes(cfg.dtype, cfg.autocast, self.device.type)
        compute_dtype = autocast or param_dtype
        self.policy = GRPOPolicy(self.lm, cfg.loss, cfg.impl, compute_dtype, autocast, banned)
        if self.teacher is not None:  # a plain attribute: the teacher is no part of the policy module
            self.policy.distill = DistillTerm(self.teacher, distill_config(cfg, self.lm, self.teacher.lm),
                                              cfg.distill_coef, cfg.distill_only)
        self.ref = None
        if cfg.loss.beta != 0.0:  # frozen copy of the *initial* policy (before any resume)
            ref_lm = copy.deepcopy(self.lm).requires_grad_(False).eval()
            if autocast is not None:  # the frozen copy needs no fp32 master weights: half the memory
                ref_lm.to(autocast)
            if cfg.gradient_checkpointing:
                ref_lm.gradient_checkpointing_disable()
            self.ref = GRPOPolicy(ref_lm, cfg.loss, cfg.impl, compute_dtype, autocast, banned)
        self.model = self.policy
        if cfg.fsdp:  # FSDP2: the policy (the optimizer's parameters are its shards) and the reference alike;
            # both come here on the CPU and each unit goes to the device as its shards (never a full copy there)
            sharding.shard(self.policy, env, autocast)
            if self.ref is not None:
                sharding.shard(self.ref, env, autocast)
        elif env.enabled:
            self.model = DDP(self.policy, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        params = [p for p in self.policy.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2),
                                           weight_decay=cfg.weight_decay,
                                           foreach=self.device.type == "cuda" or None)
        self.scheduler = get_scheduler(
            SCHEDULERS[cfg.lr_scheduler], self.optimizer, num_warmup_steps=cfg.warmup_steps,
            num_training_steps=cfg.max_steps,
            scheduler_specific_kwargs={"min_lr_rate": cfg.min_lr_ratio} if cfg.lr_scheduler == "cosine" else None)
        settings = GenerationSettings(cfg.num_generations, cfg.max_new_tokens, cfg.temperature, cfg.top_p,
                                      cfg.top_k, cfg.max_prompt_length)
        self.sampler = Sampler(self.lm, self.tokenizer, settings, self.eos_ids, banned, list(cfg.reward_specs),
                               self.device, add_special_tokens=not use_chat, autocast_dtype=autocast)
        self.rows = train_rows
        self.texts = [format_prompt(r["prompt"], self.tokenizer, use_chat, cfg.system_prompt) for r in train_rows]
        eval_texts = [format_prompt(r["prompt"], self.tokenizer, use_chat, cfg.system_prompt) for r in eval_rows]
        self.texts, eval_texts = fit_to_context(cfg, self.lm, self.tokenizer, not use_chat, self.texts, train_rows,
                                                eval_texts, eval_rows, verbose=env.is_main)
        self.evaluator = None
        if eval_rows:
            self.evaluator = Evaluator(self.sampler, eval_rows, eval_texts,
                                       overlap=training_overlap(train_rows, eval_rows))
        self.prompts = PromptSampler(len(train_rows), cfg.seed, env.rank, env.world_size)
        self._plan_steps()
        # Sampling streams differ per rank (each rank generates its own groups); restored on resume.
        torch.manual_seed(cfg.seed * 7919 + 104729 * (env.rank + 1))
        self.step, self.rollout_index, self.resumed_from, self.changed_on_resume = 0, 0, None, {}
        if cfg.resume is not None:
            # verified (or a fallback to the newest intact one) and the same run setup, before loading anything
            self.resumed_from = ckpt.select_resume_checkpoint(cfg.resume, cfg.output_dir, env)
            self.changed_on_resume = run_settings.compare(ckpt.read_run_settings(self.resumed_from),
                                                          self.run_settings, self.resumed_from)
            counters = ckpt.load_checkpoint(self.resumed_from, model=self.lm, optimizer=self.optimizer,
                                            scheduler=self.scheduler, sampler=self.prompts, env=env,
                                            fsdp_root=self.policy if cfg.fsdp else None)
            self.step, self.rollout_index = counters["step"], counters["rollout"]

    def _plan_steps(self) -> None:
        """How optimizer steps run: single pass or not, packed or padded (sets single_pass, packing, step_options).

        By default every forward that trains or scores runs on packed micro-batches (grpo/packing.py) where the
        model's attention supports it: the loss's forward and backward, the reference and the old-policy passes;
        sampling decodes on padded rows. ``--single-pass`` (one on-policy step in one micro-batch, short
        completions: checked by TrainConfig) instead backpropagates the loss through the sampling forward itself
        (its hidden states kept with their graph): no second forward of the backbone, but the loss's forward and
        backward then run on the sampling forward's padded rows; its reference pass is still packed. Not under DDP,
        whose hooks need the forward to go through the wrapper (refused in ``__init__``)."""
        cfg, env = self.cfg, self.env
        self.single_pass = cfg.single_pass
        self.packing, note = choose_packing(cfg.packing, cfg.max_tokens_per_micro_batch, self.lm, env,
                                            self.single_pass)
        if note is not None and env.is_main:
            print(f"[grpo.train] {note}", flush=True)
        self.step_options = StepOptions(micro_batch_size=cfg.micro_batch_size, max_grad_norm=cfg.max_grad_norm,
                                        env=env, fsdp_grad_sync=cfg.fsdp_grad_sync,
                                        packing=None if self.single_pass else self.packing)

    # ------------------------------------------------------------------------------------------- setup
    def _load_rows(self) -> tuple[list[dict], list[dict]]:
        cfg = self.cfg
        needs = any(s.name in NEEDS_ANSWER for s in cfg.reward_specs)
        rows = BUILTIN_TASKS[cfg.task]() if cfg.dataset is None else load_jsonl(cfg.dataset, require_answer=needs)
        if cfg.eval_dataset is not None:
            train_rows, eval_rows = rows, load_jsonl(cfg.eval_dataset, require_answer=needs, flag="--eval-dataset")
        else:
            train_rows, eval_rows = split_eval(rows, cfg.eval_size)
        if cfg.dataset is None:
            train_rows = TRAIN_ROW_WEIGHTING.get(cfg.task, list)(train_rows)
        return train_rows, eval_rows

    def _build_model(self, rows: list[dict]):
        cfg = self.cfg
        dtype, autocast = run_dtypes(cfg.dtype, cfg.autocast, self.device.type)
        if cfg.model is None:
            # A prompt with characters outside the built-in tokenizer would be fed <unk>: refuse it up front.
            unknown = sorted({c for r in rows for c in _prompt_text(r["prompt"]) if c not in PRINTABLE_ASCII})
            if unknown:
                raise UsageError(f"the prompts use characters {''.join(unknown[:20])!r} that the built-in character "
                                 "tokenizer (printable ASCII and newline) does not know; pass --model PATH for "
                                 "other text")
            tokenizer = build_char_tokenizer(PRINTABLE_ASCII)
            lm = build_tiny_model(tokenizer, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                                  max_positions=max(128, 8 + cfg.max_new_tokens + (cfg.max_prompt_length or 64)))
            attn = choose_attn_implementation(cfg.attn_implementation, self.device, autocast or dtype)
            lm.config._attn_implementation = "sdpa" if attn in (None, "flash_attention_2") else attn
            lm = lm.to(dtype)
        else:
            attn = choose_attn_implementation(cfg.attn_implementation, self.device, autocast or dtype)
            lm, tokenizer = load_pretrained(cfg.model, dtype, attn, cfg.trust_remote_code)
        self._initial_weights = run_settings.weights_fingerprint(lm)  # the run's identity, see run_settings.py
        disable_dropout(lm)
        if not cfg.fsdp:  # --fsdp: the model (and the reference copy) stay on the CPU until sharding.shard
            lm.to(self.device)
        if cfg.liger_layers:
            apply_liger_layers(lm, self.device)
        if cfg.gradient_checkpointing:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lm.train()
        return lm, tokenizer

    def _use_chat_template(self) -> bool:
        mode = self.cfg.chat_template
        has = getattr(self.tokenizer, "chat_template", None) is not None
        if mode == "on" and not has:
            raise UsageError("--chat-template on: the tokenizer has no chat template")
        return mode == "on" or (mode == "auto" and has)

    # ------------------------------------------------------------------------------------------- rollout
    def make_rollout(self) -> tuple[Rollout, torch.Tensor]:
        idx = self.prompts.next(self.cfg.prompts_per_step)
        with sharding.gathered(self.policy):  # FSDP2: the sampler calls the model outside the root's forward
            rollout = self.sampler.rollout([self.texts[i] for i in idx], [self.rows[i] for i in idx],
                                           keep_graph=self.single_pass)
        if self.cfg.mask_truncated_completions:
            rollout.completion_mask &= ~rollout.truncated.to(self.device)[:, None]
        advantages = gk.group_advantages(rollout.rewards, self.cfg.num_generations, scale=self.cfg.advantage_scale,
                                         weights=[s.weight for s in self.cfg.reward_specs])
        return rollout, advantages.to(self.device)

    def minibatches(self) -> list[torch.Tensor]:
        """The row sets of this rollout's optimizer steps: ``num_iterations`` shuffled passes (in order when the
        whole rollout is one mini-batch)."""
        cfg = self.cfg
        size = cfg.prompts_per_step * cfg.num_generations
        passes = []
        for _ in range(cfg.num_iterations):
            order = torch.randperm(size, device=self.device) if cfg.mini_batch_size < size else \
                torch.arange(size, device=self.device)
            passes += list(order.split(cfg.mini_batch_size))
        return passes

    def host_rows(self, passes: list[torch.Tensor]) -> list[list[int] | None]:
        """``passes`` (from ``minibatches``) as host ints, which packed micro-batches are planned from: known
        without a read when the whole rollout is one mini-batch in order, else read in one go per rollout (padded
        micro-batches need none: None)."""
        size = self.cfg.prompts_per_step * self.cfg.num_generations
        if self.step_options.packing is None or not passes:
            return [None] * len(passes)
        if self.cfg.mini_batch_size == size:
            return [list(range(size))] * len(passes)
        flat = torch.cat(passes).tolist()
        return [flat[i:i + self.cfg.mini_batch_size] for i in range(0, len(flat), self.cfg.mini_batch_size)]

    # ------------------------------------------------------------------------------------------- loop
    def train(self) -> dict:
        cfg, env = self.cfg, self.env
        if self.resumed_from is not None and self.step >= cfg.max_steps:
            return self._nothing_to_do()
        barrier(env)  # every rank has checked the output folder before rank 0 writes into it
        log = None
        if env.is_main:
            ckpt.remove_partial_checkpoints(cfg.output_dir)  # left by a save that was interrupted
            args = cfg.to_dict()
            if self.resumed_from is not None:
                args["resumed"] = {"from": self.resumed_from, "step": self.step,
                                   "changed": {k: list(v) for k, v in self.changed_on_resume.items()}}
                for key, (old, new) in self.changed_on_resume.items():
                    print(f"[grpo.train] resume: {key} changed from {old!r} to {new!r}", flush=True)
            write_json(os.path.join(cfg.output_dir, "args.json"), args)
            log = MetricsLog(cfg.output_dir, resume_step=self.step if self.resumed_from else None)
        try:
            return self._train_loop(log)
        finally:
            if log is not None:
                log.close()

    def _train_loop(self, log: MetricsLog | None) -> dict:
        cfg, env = self.cfg, self.env
        progress = Progress(cfg.max_steps, self.step, enabled=env.is_main and cfg.progress)
        if self.resumed_from and env.is_main:
            progress.write(f"resumed from {self.resumed_from} at step {self.step} (rollout {self.rollout_index})")
        off_policy = cfg.num_iterations > 1 or cfg.mini_batch_size < cfg.prompts_per_step * cfg.num_generations
        start_step, last_saved, start_time = self.step, self.step, time.time()
        history, evals = [], []
        if self.step == 0 and self.evaluator is not None:
            evals.append(self._evaluate(log, {"step": 0}))
        while self.step < cfg.max_steps:
            t0 = time.time()
            rollout, advantages = self.make_rollout()
            old_logps = ref_logps = None
            if self.teacher is not None:  # once per rollout, as the reference pass
                rollout.teacher_hidden = teacher_hidden_states(self.teacher, rollout, cfg.micro_batch_size)
            if off_policy and not cfg.distill_only:  # --distill-only: no GRPO ratio to take
                with sharding.gathered(self.policy):
                    old_logps = rollout_logprobs(self.policy, rollout, cfg.micro_batch_size, self.packing)
            if self.ref is not None:
                with sharding.gathered(self.ref):
                    ref_logps = rollout_logprobs(self.ref, rollout, cfg.micro_batch_size, self.packing)
            rollout_stats = self._rollout_stats(rollout, time.time() - t0)
            passes = self.minibatches()[:cfg.max_steps - self.step]
            for rows, order in zip(passes, self.host_rows(passes)):
                stats = optimizer_step_unread(self.model, self.policy, self.optimizer, self.scheduler, rollout, rows,
                                              advantages, old_logps, ref_logps, self.step_options, order)
                self.step += 1
                record = self._record(stats, rollout_stats, t0, start_time)
                if self.evaluator is not None and (self.step % cfg.eval_every == 0 or self.step == cfg.max_steps):
                    evals.append(self._evaluate(None, record))
                history.append(record)
                if env.is_main:
                    log.write(record)
                    progress.update(self.step, record)
            self.rollout_index += 1
            if cfg.save_steps and self.step // cfg.save_steps > last_saved // cfg.save_steps \
                    and self.step < cfg.max_steps:
                self.save(progress)
                last_saved = self.step
        progress.close()
        if self.step > last_saved or (self.step > start_step and self.resumed_from is None):
            self.save(None)
        checksums = self.param_checksums()
        shards = self.shard_checksums() if cfg.fsdp else None
        summary = self._summary(history, evals, time.time() - start_time, checksums, shards)
        if env.is_main:
            self._plot()
        return {"history": history, "evals": evals, "summary": summary, "param_checksums": checksums}

    def _evaluate(self, log: MetricsLog | None, record: dict) -> dict:
        """Greedy held-out evaluation; its keys join ``record`` (written to ``log`` when given: the step-0 line)."""
        t0 = time.time()
        with sharding.gathered(self.policy):
            result = self.evaluator.evaluate()
        result = read_scalars(result, self.env)
        result["eval/seconds"] = time.time() - t0
        record.update(result)
        if log is not None:
            log.write(record)
        return dict(record)

    def param_checksums(self) -> list[float]:
        """One float64 checksum of all parameters per rank (rank order): equal values = ranks in sync. Under FSDP
        the ranks hold different shards, so there is nothing to compare between them: each entry is the checksum
        of the full parameters (the sum of ``shard_checksums``), comparable with a DDP or single-process run and
        with the saved ``model/``."""
        per_rank = self.shard_checksums()  # each rank's own parameters: a replica (DDP) or its shards (FSDP)
        return [sum(per_rank)] * self.env.world_size if self.cfg.fsdp else per_rank

    def shard_checksums(self) -> list[float]:
        """The checksum of each rank's local parameters, rank order (under FSDP its shards; see
        sharding.shard_checksums)."""
        return sharding.shard_checksums(self.policy, self.env)

    def _rollout_stats(self, rollout: Rollout, gen_time: float) -> dict:
        """The rollout's statistics as 0-d tensors (rewards on the host, lengths on the device), not read: each
        step of the rollout reads them with its own metrics (``_record``)."""
        r = rollout.reward_total
        stats = {"reward_mean": torch.nanmean(r),
                 "reward_std": torch.nan_to_num(r, nan=0.0).std() if r.numel() > 1 else 0.0,
                 "completion_length": rollout.completion_mask.sum(1).float().mean(),
                 "truncated_ratio": rollout.truncated.float().mean(),
                 "generation_s": gen_time,
                 "_gen_tokens": rollout.completion_mask.sum()}
        for j, spec in enumerate(self.cfg.reward_specs):
            stats[f"reward/{spec.name}"] = torch.nanmean(rollout.rewards[:, j])
        return stats

    def _record(self, stats: dict, rollout_stats: dict, t0: float, start: float) -> dict:
        merged = dict(rollout_stats)
        merged.update(stats)
        merged = read_scalars(merged, self.env)  # the step's one device-to-host read (and, torchrun, one all-reduce)
        tokens = merged.pop("_gen_tokens") * self.env.world_size  # mean over ranks x ranks = global count
        positions = merged.pop("positions") * self.env.world_size  # what the loss's forwards ran on, all ranks
        padded = merged.pop("padded_positions") * self.env.world_size  # the same sequences as padded rows
        now = time.time()
        record = {"step": self.step, "rollout": self.rollout_index, "reward_mean": merged.pop("reward_mean"),
                  "kl": merged.pop("kl", 0.0), "loss": merged.pop("loss"),
                  "clip_ratio": merged.pop("clip_ratio/region_mean", 0.0)}
        record.update(merged)
        record.update(lr=self.scheduler.get_last_lr()[0], tokens_per_s=tokens / max(now - t0, 1e-9),
                      tokens_per_step=positions, padding_saved=1.0 - positions / padded if padded else 0.0,
                      elapsed_s=now - start)
        return record

    def save(self, progress: Progress | None) -> None:
        cfg = self.cfg
        path = ckpt.save_checkpoint(cfg.output_dir, self.step, counters={"step": self.step,
                                                                         "rollout": self.rollout_index},
                                    model=self.lm, tokenizer=self.tokenizer, optimizer=self.optimizer,
                                    scheduler=self.scheduler, sampler=self.prompts, config=cfg.to_dict(),
                                    run_settings=self.run_settings, env=self.env,
                                    fsdp_root=self.policy if cfg.fsdp else None)
        if self.env.is_main:
            ckpt.prune_checkpoints(cfg.output_dir, cfg.save_total_limit, self.step)
            self._plot()
            if progress is not None:
                progress.write(f"step {self.step}: saved {path}")

    def _plot(self) -> None:
        # plot_curves as this module's name: the one place to replace it (tests do) for the trainer's plots
        plot_curves_best_effort(os.path.join(self.cfg.output_dir, "metrics.jsonl"),
                                os.path.join(self.cfg.output_dir, "curves.png"), plot=plot_curves,
                                eval_label=getattr(self.evaluator, "label", None))

    def _nothing_to_do(self) -> dict:
        """A resume of a finished run: no file changes, except that a run killed after its last checkpoint (before
        its run_summary.json) gets the summary now, from its metrics.jsonl."""
        cfg, env = self.cfg, self.env
        checksums = self.param_checksums()
        shards = self.shard_checksums() if cfg.fsdp else None
        summary = {}
        path = os.path.join(cfg.output_dir, "run_summary.json")
        if env.is_main and not os.path.isfile(path):
            metrics = os.path.join(cfg.output_dir, "metrics.jsonl")
            records = read_metrics(metrics) if os.path.isfile(metrics) else []
            records = [r for r in records if isinstance(r.get("step"), int) and r["step"] <= self.step]
            history = [dict(r, reward_mean=_number(r["reward_mean"]), kl=_number(r.get("kl")))
                       for r in records if "reward_mean" in r]
            evals = [r for r in records if "eval/accuracy" in r]
            if history:
                summary = self._summary_dict(history, evals, None, checksums, shards)
                summary["written_on_resume"] = True  # "seconds" unknown: the run that trained was killed
                write_json(path, summary)
        if env.is_main:
            print(f"[grpo.train] nothing to do: {self.resumed_from} is at step {self.step} and --max-steps is "
                  f"{cfg.max_steps}; raise --max-steps to train further"
                  + (f"; wrote the missing {path}" if summary else ""), flush=True)
        return {"history": [], "evals": [], "summary": summary, "param_checksums": checksums}

    def _summary_dict(self, history: list[dict], evals: list[dict], seconds: float | None, checksums: list[float],
                      shard_checksums: list[float] | None) -> dict:
        k = max(1, min(10, len(history) // 4))
        first = sum(r["reward_mean"] for r in history[:k]) / k
        last = sum(r["reward_mean"] for r in history[-k:]) / k
        summary = {"steps": self.step, "steps_this_run": len(history) if seconds is not None else None,
                   "seconds": seconds,
                   "world_size": self.env.world_size, "reward_first_steps": first, "reward_last_steps": last,
                   "reward_window": k, "final_kl": history[-1]["kl"], "param_checksums": checksums}
        if shard_checksums is not None:  # FSDP: per rank, over its own shards (they differ; see shard_checksums)
            summary["shard_checksums"] = shard_checksums
        if evals:
            summary.update({f"first_{key[5:]}": evals[0][key] for key in ("eval/accuracy", "eval/reward")})
            summary.update({f"final_{key[5:]}": evals[-1][key] for key in ("eval/accuracy", "eval/reward")})
            summary["eval_size"] = len(self.evaluator)
            summary.update(summary_fields(evals, self.evaluator))
        return summary

    def _summary(self, history: list[dict], evals: list[dict], seconds: float, checksums: list[float],
                 shard_checksums: list[float] | None = None) -> dict:
        """run_summary.json and the closing lines on stdout (main rank)."""
        cfg, say = self.cfg, self.env.is_main
        if len(set(checksums)) > 1 and say:  # DDP: replicas that drifted apart (under FSDP the entries are equal)
            print(f"[grpo.train] WARNING: ranks' parameters differ: {checksums}", flush=True)
        summary = self._summary_dict(history, evals, seconds, checksums, shard_checksums)
        if not say:
            return summary
        write_json(os.path.join(cfg.output_dir, "run_summary.json"), summary)
        k, first, last = summary["reward_window"], summary["reward_first_steps"], summary["reward_last_steps"]
        print(f"[grpo.train] {len(history)} steps in {seconds:.1f}s; reward {first:.3f} (mean of "
              f"{step_span(history[:k])}) -> {last:.3f} (mean of {step_span(history[-k:])}); kl "
              f"{history[-1]['kl']:.4f}; outputs in {cfg.output_dir}", flush=True)
        if evals:
            resumed_at = history[0]["step"] - 1 if self.resumed_from else None
            line = describe_evals(evals, self.evaluator, resumed_at, os.path.join(cfg.output_dir, "metrics.jsonl"))
            print(f"[grpo.train] {line}", flush=True)
            for prompt, completion, reward in self.evaluator.samples[:4]:
                print(f"[grpo.train] greedy: {prompt!r} -> {completion!r} (reward {reward:.2f})", flush=True)
        return summary


def _number(value) -> float:
    """A metrics.jsonl value back to a float (the file stores a non-finite one as null)."""
    return float("nan") if value is None else float(value)


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "".join(m["content"] for m in prompt)
