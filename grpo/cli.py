"""Command line of ``python -m grpo.train``: every option, defaults tuned for the built-in CPU task, validation.

Every field of ``grpo_kernels.GRPOLossConfig`` gets a flag (``--loss-type``, ``--beta``, ``--epsilon-low``, ...),
generated from the dataclass so that new loss options appear here without edits. ``--temperature`` is shared by
sampling and the loss (the loss must score tokens with the distribution they were sampled from).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import typing

from grpo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GRPOLossConfig

from .data import BUILTIN_TASKS
from .errors import UsageError
from .rewards import parse_reward_spec

# Train-time defaults that differ from GRPOLossConfig's (TRL's) defaults: a small KL penalty so that the KL
# column of the progress bar and of the plot means something on the built-in task.
LOSS_DEFAULT_OVERRIDES = {"beta": 0.02}
SHARED_WITH_SAMPLING = {"temperature"}

_LOSS_HELP = {
    "loss_type": "loss aggregation / policy term (TRL names)",
    "beta": "KL coefficient; > 0 loads a frozen reference copy of the initial policy",
    "epsilon_low": "lower clip: ratio >= 1 - epsilon_low",
    "epsilon_high": "upper clip: ratio <= 1 + epsilon_high (cispo: raw upper bound)",
    "use_bias_correction_kl": "multiply the k3 KL by the importance ratio",
    "importance_sampling_level": "'token' ratios or 'sequence' (GSPO)",
    "delta": "upper clamp of the unclipped ratio (two-sided clipping)",
    "max_completion_length": "dr_grpo normalizer (None: --max-new-tokens)",
    "off_policy_mask_threshold": "drop negative-advantage rows whose mean log-ratio to the sampler exceeds this",
    "top_entropy_quantile": "train only on the top fraction of tokens by entropy (1.0 = all)",
    "entropy_coef": "entropy bonus coefficient",
    "deterministic": "fixed-order reductions in the fused-linear backward",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_loss_arguments(group) -> None:
    hints = typing.get_type_hints(GRPOLossConfig)
    for field in dataclasses.fields(GRPOLossConfig):
        if field.name in SHARED_WITH_SAMPLING:
            continue
        default = LOSS_DEFAULT_OVERRIDES.get(field.name, field.default)
        hint = hints[field.name]
        help_text = _LOSS_HELP.get(field.name, field.name.replace("_", " "))
        if field.name == "loss_type":
            group.add_argument(_flag(field.name), choices=LOSS_TYPES, default=default, help=help_text)
        elif field.name == "importance_sampling_level":
            group.add_argument(_flag(field.name), choices=IMPORTANCE_SAMPLING_LEVELS, default=default,
                               help=help_text)
        elif hint is bool:
            group.add_argument(_flag(field.name), action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
        else:
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kind = int if args[0] is int else float
            group.add_argument(_flag(field.name), type=kind, default=default, metavar=kind.__name__.upper(),
                               help=help_text)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' only for defaults that say something (not None / False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m grpo.train",
        description="GRPO training with the fused grpo_kernels loss. With no arguments: a tiny Llama learns the "
                    "built-in copy task on CPU in a couple of minutes.",
        formatter_class=_HelpFormatter)
    run = p.add_argument_group("run")
    run.add_argument("--output-dir", default="runs/default", help="metrics.jsonl, curves.png, checkpoints")
    run.add_argument("--seed", type=int, default=0, help="seed of model init, prompts and sampling")
    run.add_argument("--max-steps", type=int, default=400, help="optimizer steps")
    run.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                     help="resume from a checkpoint directory; without a value, the latest in --output-dir")
    run.add_argument("--save-steps", type=int, default=100, help="checkpoint every N steps (0: only at the end)")
    run.add_argument("--save-total-limit", type=int, default=2, help="keep the N newest checkpoints (0: all)")
    run.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: CUDA if available")
    run.add_argument("--no-progress", action="store_true", help="no tqdm bar (log lines instead)")

    model = p.add_argument_group("model")
    model.add_argument("--model", default=None, metavar="PATH",
                       help="local causal-LM checkpoint (model + tokenizer); default: built-in tiny Llama")
    model.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                       help="parameter dtype (auto: float32 master weights)")
    model.add_argument("--autocast", default="auto", choices=("auto", "bfloat16", "float16", "none"),
                       help="mixed precision of forward passes (auto: bfloat16 on CUDA, none on CPU)")
    model.add_argument("--attn-implementation", default="auto",
                       help="auto: flash_attention_2 when flash_attn is installed and on CUDA, else sdpa")
    model.add_argument("--liger-layers", action="store_true",
                       help="Liger-Kernel RMSNorm / SwiGLU / RoPE kernels (CUDA)")
    model.add_argument("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    model.add_argument("--trust-remote-code", action="store_true", help="allow custom modeling code in --model")
    model.add_argument("--impl", default="auto", choices=("auto", "triton", "torch"),
                       help="grpo_kernels implementation (auto: Triton on CUDA, chunked torch on CPU)")
    model.add_argument("--hidden-size", type=int, default=64, help="built-in model only")
    model.add_argument("--num-layers", type=int, default=2, help="built-in model only")
    model.add_argument("--num-heads", type=int, default=4, help="built-in model only")

    data = p.add_argument_group("data and rewards")
    data.add_argument("--dataset", default=None, metavar="FILE.jsonl",
                      help="one JSON object per line with 'prompt' and 'answer'; default: built-in --task")
    data.add_argument("--task", default="copy", choices=sorted(BUILTIN_TASKS), help="built-in task")
    data.add_argument("--reward", action="append", default=None, metavar="NAME[=WEIGHT]",
                      help="reward function, repeatable: a built-in (copy, math, boxed, hash, last_number, format) "
                           "or package.module:function; default: copy for the built-in task, math for --dataset")
    data.add_argument("--advantage-scale", default="group", choices=("group", "batch", "none"),
                      help="divide advantages by the group std, the batch std, or nothing")
    data.add_argument("--chat-template", default="auto", choices=("auto", "on", "off"),
                      help="wrap string prompts in the tokenizer's chat template (auto: if it has one)")
    data.add_argument("--system-prompt", default=None, help="system message (chat) or prefix line (plain)")
    data.add_argument("--max-prompt-length", type=int, default=None, help="keep the last N prompt tokens")

    gen = p.add_argument_group("generation")
    gen.add_argument("--num-generations", "-G", type=int, default=8, help="completions per prompt (group size)")
    gen.add_argument("--prompts-per-step", type=int, default=16, help="prompts per rollout, per process")
    gen.add_argument("--max-new-tokens", type=int, default=None,
                     help="completion length limit (default: 6 for the built-in model, 256 with --model)")
    gen.add_argument("--temperature", type=float, default=1.0, help="sampling and loss temperature")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (1.0: off)")
    gen.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    gen.add_argument("--mask-truncated-completions", action="store_true",
                     help="exclude completions without EOS from the loss")

    opt = p.add_argument_group("optimization")
    opt.add_argument("--lr", type=float, default=None,
                     help="peak AdamW learning rate (default: 1e-3 for the built-in model, 1e-6 with --model)")
    opt.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    opt.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1")
    opt.add_argument("--adam-beta2", type=float, default=0.99, help="AdamW beta2")
    opt.add_argument("--warmup-steps", type=int, default=10, help="linear LR warmup steps")
    opt.add_argument("--lr-scheduler", default="cosine", choices=("cosine", "linear", "constant"),
                     help="decay after warmup, down to --min-lr-ratio at --max-steps")
    opt.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr / peak lr for cosine and linear")
    opt.add_argument("--max-grad-norm", type=float, default=1.0, help="0 disables clipping")
    opt.add_argument("--num-iterations", type=int, default=1, help="passes over each rollout (PPO epochs)")
    opt.add_argument("--mini-batch-size", type=int, default=None,
                     help="completions per optimizer step, per process (default: the whole rollout)")
    opt.add_argument("--micro-batch-size", type=int, default=None,
                     help="completions per forward/backward; gradient accumulation over the mini-batch")

    loss = p.add_argument_group("loss (grpo_kernels.GRPOLossConfig)")
    _add_loss_arguments(loss)
    return p


def loss_config_from_args(args: argparse.Namespace) -> GRPOLossConfig:
    values = {}
    for field in dataclasses.fields(GRPOLossConfig):
        values[field.name] = getattr(args, field.name)
    if values["max_completion_length"] is None:
        values["max_completion_length"] = args.max_new_tokens
    try:
        return GRPOLossConfig(**values)
    except ValueError as exc:
        raise UsageError(f"invalid loss option: {exc}")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)


def validate_args(args: argparse.Namespace) -> None:
    """Every check that needs no model: fails fast, before anything heavy is loaded."""
    builtin = args.model is None  # defaults that depend on the model: a random-init toy vs a pretrained LM
    if args.lr is None:
        args.lr = 1e-3 if builtin else 1e-6
    if args.max_new_tokens is None:
        args.max_new_tokens = 6 if builtin else 256
    _check(args.num_generations >= 2,
           f"--num-generations must be >= 2 (GRPO compares completions within a group), got {args.num_generations}")
    _check(args.prompts_per_step >= 1, f"--prompts-per-step must be >= 1, got {args.prompts_per_step}")
    _check(args.max_steps >= 1, f"--max-steps must be >= 1, got {args.max_steps}")
    _check(args.max_new_tokens >= 1, f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    _check(args.save_steps >= 0, f"--save-steps must be >= 0, got {args.save_steps}")
    _check(math.isfinite(args.temperature) and args.temperature > 0,
           f"--temperature must be > 0, got {args.temperature}")
    _check(0.0 < args.top_p <= 1.0, f"--top-p must be in (0, 1], got {args.top_p}")
    _check(args.top_k >= 0, f"--top-k must be >= 0, got {args.top_k}")
    _check(math.isfinite(args.lr) and args.lr > 0, f"--lr must be > 0, got {args.lr}")
    _check(args.warmup_steps >= 0, f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    _check(0.0 <= args.min_lr_ratio <= 1.0, f"--min-lr-ratio must be in [0, 1], got {args.min_lr_ratio}")
    _check(args.max_grad_norm >= 0, f"--max-grad-norm must be >= 0, got {args.max_grad_norm}")
    _check(args.num_iterations >= 1, f"--num-iterations must be >= 1, got {args.num_iterations}")
    _check(args.max_prompt_length is None or args.max_prompt_length >= 1,
           f"--max-prompt-length must be >= 1, got {args.max_prompt_length}")
    rollout = args.prompts_per_step * args.num_generations
    mini = args.mini_batch_size or rollout
    micro = args.micro_batch_size or mini
    _check(1 <= mini <= rollout and rollout % mini == 0,
           f"--mini-batch-size {mini} must divide the rollout size --prompts-per-step x --num-generations = {rollout}")
    _check(1 <= micro <= mini and mini % micro == 0,
           f"--micro-batch-size {micro} must divide the mini-batch size {mini}")
    args.mini_batch_size, args.micro_batch_size = mini, micro
    if args.dataset is not None and not os.path.isfile(args.dataset):
        raise UsageError(f"--dataset {args.dataset!r}: file not found")
    if args.model is not None and not os.path.isdir(args.model):
        raise UsageError(f"--model {args.model!r}: not a directory (give a local checkpoint saved with "
                         "save_pretrained)")
    if os.path.exists(args.output_dir) and not os.path.isdir(args.output_dir):
        raise UsageError(f"--output-dir {args.output_dir!r} exists and is not a directory")
    if args.resume not in (None, "latest") and not os.path.isdir(args.resume):
        raise UsageError(f"--resume {args.resume!r}: no such checkpoint directory")
    if args.reward is None:
        args.reward = ["math"] if args.dataset is not None else ["copy"]
    args.reward_specs = [parse_reward_spec(spec) for spec in args.reward]
    args.loss_config = loss_config_from_args(args)


def parse_args(argv=None) -> argparse.Namespace:
    """Parse and validate; argparse errors exit(2) with usage, our checks raise UsageError."""
    args = build_parser().parse_args(argv)
    validate_args(args)
    return args
