"""Command line of ``python -m grpo.train``: flags -> ``TrainConfig`` (grpo/config.py holds defaults and checks).

Every field of ``grpo_kernels.GRPOLossConfig`` gets a flag (``--loss-type``, ``--beta``, ``--epsilon-low``, ...),
generated from the dataclass so that new loss options appear here without edits. ``--temperature`` is shared by
sampling and the loss (the loss must score tokens with the distribution they were sampled from). argparse's own
errors (unknown flag, bad choice, missing value) raise ``UsageError`` like every other bad argument, so all of
them print one line ``grpo.train: error: ...`` and exit with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing

from grpo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GRPOLossConfig

from .config import CHOICES, DEFAULT_LOSS, TrainConfig
from .errors import UsageError

SHARED_WITH_SAMPLING = {"temperature"}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.init}

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


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse would print the whole usage and exit; we want our one-line style
        raise UsageError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows '(default: X)' only for defaults that say something (not None / False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add(group, name: str, help_text: str, **kwargs) -> None:
    """A flag for TrainConfig field ``name`` with its default and, where it has a fixed set, its choices."""
    kwargs.setdefault("default", DEFAULTS[name])
    if name in CHOICES:
        kwargs.setdefault("choices", CHOICES[name])
    group.add_argument(_flag(name), dest=name, help=help_text, **kwargs)


def _add_loss_arguments(group) -> None:
    hints = typing.get_type_hints(GRPOLossConfig)
    for field in dataclasses.fields(GRPOLossConfig):
        if field.name in SHARED_WITH_SAMPLING:
            continue
        default = getattr(DEFAULT_LOSS, field.name)
        hint = hints[field.name]
        dest = "loss." + field.name
        help_text = _LOSS_HELP.get(field.name, field.name.replace("_", " "))
        if field.name == "loss_type":
            group.add_argument(_flag(field.name), dest=dest, choices=LOSS_TYPES, default=default, help=help_text)
        elif field.name == "importance_sampling_level":
            group.add_argument(_flag(field.name), dest=dest, choices=IMPORTANCE_SAMPLING_LEVELS, default=default,
                               help=help_text)
        elif hint is bool:
            group.add_argument(_flag(field.name), dest=dest, action=argparse.BooleanOptionalAction,
                               default=default, help=help_text)
        else:
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kind = int if args[0] is int else float
            group.add_argument(_flag(field.name), dest=dest, type=kind, default=default,
                               metavar=kind.__name__.upper(), help=help_text)


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m grpo.train",
        description="GRPO training with the fused grpo_kernels loss. With no arguments: a tiny Llama learns the "
                    "built-in copy task on a 2-core CPU in one to three minutes (held-out greedy accuracy in "
                    "metrics.jsonl).",
        formatter_class=_HelpFormatter)
    run = p.add_argument_group("run")
    _add(run, "output_dir", "metrics.jsonl, curves.png, checkpoints; must be empty unless --resume / --overwrite")
    _add(run, "seed", "seed of model init, prompts and sampling", type=int)
    _add(run, "max_steps", "optimizer steps (in total, counting the steps of a resumed run)", type=int)
    _add(run, "resume", "resume from a checkpoint directory; without a value, the latest in --output-dir",
         nargs="?", const="latest", metavar="CHECKPOINT")
    _add(run, "overwrite", "start afresh in a non-empty --output-dir, deleting its previous run",
         action="store_true")
    _add(run, "save_steps", "checkpoint every N steps (0: only at the end)", type=int)
    _add(run, "save_total_limit", "keep the N newest checkpoints (0: all)", type=int)
    _add(run, "device", "auto: CUDA if available")
    _add(run, "fsdp", "shard parameters, gradients and optimizer state over the ranks with FSDP2 (fully_shard per "
         "decoder layer; checkpoints saved sharded); default: DDP under torchrun", action="store_true")
    _add(run, "fsdp_grad_sync", "--fsdp gradient accumulation: micro_batch reduce-scatters every micro-batch "
         "(gradients stay sharded); step only the last one (fewer collectives, but a full unsharded fp32 gradient "
         "per rank in between)")
    run.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar (log lines instead)")

    model = p.add_argument_group("model")
    _add(model, "model", "local causal-LM checkpoint (model + tokenizer); default: built-in tiny Llama",
         metavar="PATH")
    _add(model, "dtype", "parameter dtype (auto: float32 master weights)")
    _add(model, "autocast", "mixed precision of forward passes (auto: bfloat16 on CUDA, none on CPU)")
    _add(model, "attn_implementation", "auto: flash_attention_2 when flash_attn is installed and on CUDA, else sdpa")
    _add(model, "liger_layers", "Liger-Kernel RMSNorm / SwiGLU / RoPE kernels (CUDA)", action="store_true")
    _add(model, "gradient_checkpointing", "recompute activations in backward", action="store_true")
    _add(model, "trust_remote_code", "allow custom modeling code in --model", action="store_true")
    _add(model, "impl", "grpo_kernels implementation (auto: Triton on CUDA, chunked torch on CPU)")
    _add(model, "hidden_size", "built-in model only", type=int)
    _add(model, "num_layers", "built-in model only", type=int)
    _add(model, "num_heads", "built-in model only", type=int)

    data = p.add_argument_group("data, rewards and evaluation")
    _add(data, "dataset", "one JSON object per line with 'prompt' and 'answer'; default: built-in --task",
         metavar="FILE.jsonl")
    _add(data, "task", "built-in task")
    data.add_argument("--reward", dest="rewards", action="append", default=None, metavar="NAME[=WEIGHT]",
                      help="reward function, repeatable: a built-in (copy, math, boxed, hash, last_number, format) "
                           "or package.module:function; default: copy for the built-in task, math for --dataset")
    _add(data, "eval_dataset", "held-out JSONL for the greedy evaluation (default: rows held out of the training "
         "data, see --eval-size)", metavar="FILE.jsonl")
    _add(data, "eval_size", "rows held out of the training data for evaluation (default: 10%%, at most 128; "
         "0: no evaluation)", type=int)
    _add(data, "eval_every", "greedy evaluation every N steps (and at the start and the end)", type=int)
    _add(data, "advantage_scale", "divide advantages by the group std, the batch std, or nothing")
    _add(data, "chat_template", "wrap string prompts in the tokenizer's chat template (auto: if it has one)")
    _add(data, "system_prompt", "system message (chat) or prefix line (plain)")
    _add(data, "max_prompt_length", "keep the last N prompt tokens", type=int)

    gen = p.add_argument_group("generation")
    gen.add_argument("--num-generations", "-G", dest="num_generations", type=int,
                     default=DEFAULTS["num_generations"], help="completions per prompt (group size)")
    _add(gen, "prompts_per_step", "prompts per rollout, per process", type=int)
    _add(gen, "max_new_tokens", "completion length limit (default: 6 for the built-in model, 256 with --model)",
         type=int)
    _add(gen, "temperature", "sampling and loss temperature", type=float)
    _add(gen, "top_p", "nucleus sampling (1.0: off)", type=float)
    _add(gen, "top_k", "0 disables top-k", type=int)
    _add(gen, "completion_chars", "sample only tokens made of these characters, and EOS (action masking, applied "
         "alike in sampling and in the loss); default: any text, the answer alphabet for a built-in --task",
         metavar="CHARS")
    _add(gen, "mask_truncated_completions", "exclude completions without EOS from the loss", action="store_true")

    opt = p.add_argument_group("optimization")
    _add(opt, "lr", "peak AdamW learning rate (default: 1e-3 for the built-in model, 1e-6 with --model)",
         type=float)
    _add(opt, "weight_decay", "AdamW weight decay", type=float)
    _add(opt, "adam_beta1", "AdamW beta1", type=float)
    _add(opt, "adam_beta2", "AdamW beta2", type=float)
    _add(opt, "warmup_steps", "linear LR warmup steps", type=int)
    _add(opt, "lr_scheduler", "decay after warmup, down to --min-lr-ratio at --max-steps")
    _add(opt, "min_lr_ratio", "final lr / peak lr for cosine and linear", type=float)
    _add(opt, "max_grad_norm", "0 disables clipping", type=float)
    _add(opt, "num_iterations", "passes over each rollout (PPO epochs)", type=int)
    _add(opt, "mini_batch_size", "completions per optimizer step, per process (default: the whole rollout)",
         type=int)
    _add(opt, "micro_batch_size", "completions per forward/backward; gradient accumulation over the mini-batch",
         type=int)

    loss = p.add_argument_group("loss (grpo_kernels.GRPOLossConfig)")
    _add_loss_arguments(loss)
    return p


def config_from_argv(argv=None) -> TrainConfig:
    """Parse and validate; every bad argument raises UsageError (one line, see grpo/train.py)."""
    values = vars(build_parser().parse_args(argv))
    loss_values = {k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("loss.")}
    try:
        loss = GRPOLossConfig(**loss_values)
    except ValueError as exc:
        raise UsageError(f"invalid loss option: {exc}")
    values["rewards"] = tuple(values["rewards"] or ())
    return TrainConfig(loss=loss, **values)
