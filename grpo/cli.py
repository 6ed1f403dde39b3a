"""Command line of ``python -m grpo.train``: flags -> ``TrainConfig`` (grpo/config.py holds defaults and checks).

Every field of ``grpo_kernels.GRPOLossConfig`` gets a flag (``--loss-type``, ``--beta``, ``--epsilon-low``, ...),
generated from the dataclass so that new loss options appear here without edits. ``--temperature`` is shared by
sampling and the loss (the loss must score tokens with the distribution they were sampled from). argparse's own
errors (unknown flag, bad choice, missing value) raise ``UsageError`` like every other bad argument, so all of
them print one line ``grpo.train: error: ...`` and exit with status 2. Negative numbers are values (``--lr -1e-3``
reaches the range check of ``TrainConfig``). docs/training-cli.md is the flag reference; a test keeps it complete.
"""
from __future__ import annotations

import argparse
import dataclasses
import re
import typing

from grpo_kernels._checks import ROUND_LOGITS
from grpo_kernels.config import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES, GRPOLossConfig

from .config import CHOICES, DEFAULT_LOSS, SINGLE_PASS_MAX_NEW_TOKENS, TrainConfig, loss_option_error
from .errors import UsageError

SHARED_WITH_SAMPLING = {"temperature"}
# Loss options that are properties of the model, read from its config (softcap: final_logit_softcapping), not flags.
FROM_MODEL = {"softcap"}
# Loss options for callers that capture the loss in a CUDA graph (capturable: no host sync, the padded rows computed
# too); grpo.train captures none, so such a flag would only add work. TrainConfig refuses them from Python.
NOT_FOR_TRAINING = {"capturable"}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(TrainConfig) if f.init}

_LOSS_HELP = {
    "invariant_block_rows": "with --batch-invariant: the rows per fixed block (default: the device's, 256 on CPU, "
                            "512 on CUDA); another block is another bit pattern, for the loss and the old / reference "
                            "log-probs alike (docs/numerics.md, 'Batch invariance')",
    "loss_type": "policy term and how token losses are averaged into one number (TRL's names; see docs/DESIGN.md)",
    "beta": "coefficient of the KL penalty to the initial policy (>= 0; > 0 keeps a frozen reference copy of the "
            "model in memory)",
    "epsilon_low": "lower clip range: the ratio new/old policy probability is kept >= 1 - EPSILON_LOW (in [0, 1))",
    "epsilon_high": "upper clip range: the ratio is kept <= 1 + EPSILON_HIGH (cispo: the raw upper bound of the "
                    "ratio; > 0)",
    "use_bias_correction_kl": "multiply the k3 KL estimate by the importance ratio, as TRL does",
    "importance_sampling_level": "importance ratio per token, or one per completion ('sequence', GSPO)",
    "delta": "upper clamp of the unclipped ratio (two-sided clipping, > 0; default: none)",
    "max_completion_length": "dr_grpo's normalizer in tokens (default: --max-new-tokens)",
    "sapo_temperature_pos": "sapo: gate temperature for positive advantages (> 0)",
    "sapo_temperature_neg": "sapo: gate temperature for negative and zero advantages (> 0)",
    "vespo_k_pos": "vespo: shape k of the gamma weight for non-negative advantages",
    "vespo_lambda_pos": "vespo: rate lambda of the gamma weight for non-negative advantages",
    "vespo_k_neg": "vespo: shape k of the gamma weight for negative advantages",
    "vespo_lambda_neg": "vespo: rate lambda of the gamma weight for negative advantages",
    "off_policy_mask_threshold": "drop negative-advantage completions whose mean log-ratio sampler/policy exceeds "
                                 "this (nats per token; default: no masking)",
    "top_entropy_quantile": "train only on the tokens in this top fraction by entropy (in (0, 1]; 1.0: all tokens)",
    "entropy_coef": "weight of an entropy bonus subtracted from the loss (0: none)",
    "deterministic": "fused-linear Triton backward in a fixed order (bitwise reproducible) instead of fp32 atomics",
    "batch_invariant": "a sequence's log-probs, loss terms and gradients bitwise independent of the batch around it "
                       "(size, position, padding, packing, chunking; implies --deterministic): the old and reference "
                       "log-probs then equal the loss's, ratio exactly 1 at the first iteration",
    "grad_in_forward": "Triton path: compute the loss gradient during the forward pass when the loss type allows it "
                       "(saves a second sweep over the vocabulary); --no-grad-in-forward forces separate sweeps",
    "round_logits": "round the raw logits to this dtype (to nearest even) before the soft cap, temperature and "
                    "softmax, as a sampler (vLLM) does, in the loss and the old / reference log-probs; straight-"
                    "through in the backward (default: fp32 logits, closer to float64)",
    "memory_budget": "bytes of transient memory the loss may allocate beyond its inputs and returned gradients "
                     "(default: 1 GiB of working memory plus the fast head path's fp32 d-weight accumulator); the "
                     "fastest path that fits runs (docs/memory.md)",
}
# Negative numbers as flag values (``--lr -1e-3``): argparse takes any value that starts with "-" for a flag unless
# it matches its own pattern, which knows neither exponents nor inf / nan; the value then reaches our range checks.
_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|infinity|nan)$", re.IGNORECASE)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NUMBER  # no flag of ours looks like a number, so these are values

    def error(self, message):  # argparse would print the whole usage and exit; we want our one-line style
        raise UsageError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """'(default: X)' only for defaults that say something (not None); switches say 'on' or 'off'."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.nargs == 0 and action.option_strings and not isinstance(action, argparse._HelpAction):
            text = text.replace(" (default: %(default)s)", "")  # BooleanOptionalAction's own True / False
            return f"{text} (default: {'on' if action.default else 'off'})"
        if action.default is None:
            return text
        return super()._get_help_string(action)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add(group, name: str, help_text: str, **kwargs) -> None:
    """A flag for TrainConfig field ``name`` with its default and, where it has a fixed set, its choices."""
    kwargs.setdefault("default", DEFAULTS[name])
    if name in CHOICES:
        kwargs.setdefault("choices", CHOICES[name])
    if kwargs.get("type") in (int, float):
        kwargs.setdefault("metavar", "N" if kwargs["type"] is int else "X")
    group.add_argument(_flag(name), dest=name, help=help_text, **kwargs)


def _add_loss_arguments(group) -> None:
    hints = typing.get_type_hints(GRPOLossConfig)
    for field in dataclasses.fields(GRPOLossConfig):
        if field.name in SHARED_WITH_SAMPLING | FROM_MODEL | NOT_FOR_TRAINING:
            continue
        default = getattr(DEFAULT_LOSS, field.name)
        hint = hints[field.name]
        dest = "loss." + field.name
        help_text = _LOSS_HELP[field.name]  # KeyError: a new GRPOLossConfig field needs its help text here
        if field.name == "loss_type":
            group.add_argument(_flag(field.name), dest=dest, choices=LOSS_TYPES, default=default, help=help_text)
        elif field.name == "round_logits":
            group.add_argument(_flag(field.name), dest=dest, choices=ROUND_LOGITS, default=default, help=help_text)
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
                               metavar="N" if kind is int else "X", help=help_text)


def _add_generation_arguments(gen) -> None:
    gen.add_argument("--num-generations", "-G", dest="num_generations", type=int, metavar="N",
                     default=DEFAULTS["num_generations"], help="completions sampled per prompt: the group size (>= 2)")
    _add(gen, "prompts_per_step", "prompts per rollout, per process (a rollout is N x -G completions)", type=int)
    _add(gen, "max_new_tokens", "completion length limit in tokens (default: 6 for the built-in model, 256 with "
         "--model)", type=int)
    _add(gen, "temperature", "softmax temperature of sampling, and of the loss, which must score tokens as they "
         "were sampled (> 0)", type=float)
    _add(gen, "top_p", "nucleus sampling: draw from the smallest set of tokens holding this probability (in (0, 1]; "
         "1.0: off)", type=float)
    _add(gen, "top_k", "draw only from the N most likely tokens (0: off)", type=int)
    _add(gen, "completion_chars", "sample only tokens made of these characters, and EOS (action masking, applied "
         "alike in sampling and in the loss); default: any text, the answer alphabet for a built-in --task",
         metavar="CHARS")
    _add(gen, "mask_truncated_completions", "leave completions that hit --max-new-tokens without EOS out of the "
         "loss", action="store_true")


def _add_optimization_arguments(opt) -> None:
    _add(opt, "lr", "peak AdamW learning rate (> 0; default: 1e-3 for the built-in model, 1e-6 with --model)",
         type=float)
    _add(opt, "weight_decay", "AdamW decoupled weight decay: each step multiplies the weights by 1 - lr x X (>= 0)",
         type=float)
    _add(opt, "adam_beta1", "AdamW decay rate of the gradient's running mean (in [0, 1))", type=float)
    _add(opt, "adam_beta2", "AdamW decay rate of the squared gradient's running mean (in [0, 1))", type=float)
    _add(opt, "warmup_steps", "optimizer steps of linear learning-rate warmup from 0", type=int)
    _add(opt, "lr_scheduler", "learning-rate decay after warmup, down to --min-lr-ratio at --max-steps")
    _add(opt, "min_lr_ratio", "final learning rate / peak learning rate, for cosine and linear (in [0, 1])",
         type=float)
    _add(opt, "max_grad_norm", "clip the global gradient L2 norm to this (0: no clipping)", type=float)
    _add(opt, "num_iterations", "optimizer passes over each rollout (PPO epochs)", type=int)
    _add(opt, "mini_batch_size", "completions per optimizer step, per process; must divide the rollout (default: "
         "the whole rollout)", type=int)
    _add(opt, "micro_batch_size", "completions per forward/backward pass; gradients accumulate over the "
         "mini-batch (default: the whole mini-batch; with packing, the most completions in one packed "
         "micro-batch)", type=int)
    _add(opt, "packing", "padding-free training: each completion with its prompt laid end to end in packed rows, "
         "position ids restarting per sequence, no pad tokens (flash-attn varlen on CUDA, else transformers' "
         "packed-sequence masks); on where the model's attention supports it; --no-packing: padded rows",
         action=argparse.BooleanOptionalAction)
    _add(opt, "single_pass", "backpropagate the loss through the sampling forward instead of running the model "
         "again: one forward fewer, but the loss's forward and backward on the sampling forward's padded rows; needs "
         f"--num-iterations 1, the whole rollout in one micro-batch, --max-new-tokens <= {SINGLE_PASS_MAX_NEW_TOKENS}, "
         "one process, no --fsdp or --gradient-checkpointing", action="store_true")
    _add(opt, "max_tokens_per_micro_batch", "packed micro-batches hold whole sequences up to this many tokens "
         "(a sequence's prompt and completion less its last token, whose prediction is never scored); a longer "
         "sequence gets a micro-batch of its own (default: no token limit)",
         type=int)


def _add_distillation_arguments(dist) -> None:
    _add(dist, "teacher", "on-policy distillation: score every sampled completion token against this frozen "
         "teacher with the fused two-head divergence: a model folder (save_pretrained, e.g. a checkpoint's model/) or "
         "a grpo.train checkpoint-N folder; its vocabulary must be the student's, its width may differ "
         "(docs/training.md, 'Distillation')", metavar="PATH")
    _add(dist, "distill_beta", "which divergence to the teacher, per token (in [0, 1]): 0 the forward KL(teacher || "
         "student), 1 the reverse KL(student || teacher), in between the generalized JSD with mixture "
         "(1 - X) p_student + X p_teacher", type=float)
    _add(dist, "distill_temperature", "both models' logits are divided by it in the divergence (> 0; sampling "
         "keeps --temperature)", type=float)
    _add(dist, "distill_coef", "weight of the distillation loss (a token mean over the step) added to the GRPO "
         "loss (> 0)", type=float)
    _add(dist, "distill_only", "train on the distillation loss alone: no GRPO term, no reference model (the "
         "default --beta is turned off, another --beta refused; rewards are still computed for the log and the "
         "evaluation)",
         action="store_true")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m grpo.train",
        description="GRPO training with the fused grpo_kernels loss. With no arguments: a tiny Llama learns the "
                    "built-in copy task on a 2-core CPU in one to three minutes (held-out greedy accuracy in "
                    "metrics.jsonl). Steps are optimizer steps; lengths are in tokens. Flag reference: "
                    "docs/training-cli.md.",
        formatter_class=_HelpFormatter)
    run = p.add_argument_group("run")
    _add(run, "output_dir", "folder of the run's outputs (metrics.jsonl, curves.png, args.json, run_summary.json, "
         "checkpoint-N/); must be empty unless --resume or --overwrite; default: a new runs/version_N", metavar="DIR")
    _add(run, "seed", "seed of model init, prompt order and sampling (0 <= N < 2**32)", type=int)
    _add(run, "max_steps", "optimizer steps in total, counting those before a --resume (>= 1)", type=int)
    _add(run, "resume", "continue from a checkpoint folder; without a value, the newest one in --output-dir "
         "(no --output-dir: in the newest runs/version_N with one)",
         nargs="?", const="latest", metavar="CHECKPOINT")
    _add(run, "overwrite", "start afresh in a non-empty --output-dir, deleting its previous run", action="store_true")
    _add(run, "save_steps", "write a checkpoint every N optimizer steps (0: only at the end)", type=int)
    _add(run, "save_total_limit", "keep only the N newest checkpoints (0: keep all)", type=int)
    _add(run, "device", "where to train (auto: CUDA if available, else CPU)")
    _add(run, "fsdp", "shard parameters, gradients and optimizer state over the ranks with FSDP2 (fully_shard per "
         "decoder layer; checkpoints saved sharded); off: DDP under torchrun", action="store_true")
    _add(run, "fsdp_grad_sync", "--fsdp gradient accumulation: micro_batch reduce-scatters every micro-batch "
         "(gradients stay sharded); step only the last one (fewer collectives, but a full unsharded fp32 gradient "
         "per rank in between)")
    _add(run, "progress", "draw a tqdm progress bar on stderr; --no-progress prints a log line every 10 steps "
         "instead", action=argparse.BooleanOptionalAction)

    model = p.add_argument_group("model")
    _add(model, "model", "local causal-LM checkpoint folder (model + tokenizer, as written by save_pretrained); "
         "default: the built-in tiny Llama with a character tokenizer", metavar="PATH")
    _add(model, "dtype", "parameter dtype (auto: float32 master weights)")
    _add(model, "autocast", "mixed precision of forward passes (auto: bfloat16 on CUDA, none on CPU)")
    _add(model, "attn_implementation", "attention kernel passed to transformers (auto: flash_attention_2 when "
         "flash_attn is installed, on CUDA, for bfloat16 / float16 forwards, else transformers' default for the "
         "model: sdpa, or eager where the model has no sdpa kernel, e.g. Gemma 2); flash_attention_2 / 3 for a "
         "float32 run is refused (flash-attn has no float32 kernels)", metavar="NAME")
    _add(model, "liger_layers", "replace RMSNorm / SwiGLU / RoPE with Liger-Kernel's Triton kernels (CUDA)",
         action="store_true")
    _add(model, "gradient_checkpointing", "recompute activations in the backward pass (less activation memory, "
         "one more forward per micro-batch)", action="store_true")
    _add(model, "trust_remote_code", "allow the custom modeling code shipped in --model to run",
         action="store_true")
    _add(model, "impl", "grpo_kernels loss implementation (auto: Triton on CUDA, chunked torch on CPU)")
    _add(model, "hidden_size", "built-in model: width of the hidden states (a multiple of --num-heads)", type=int)
    _add(model, "num_layers", "built-in model: number of decoder layers", type=int)
    _add(model, "num_heads", "built-in model: number of attention heads", type=int)

    data = p.add_argument_group("data, rewards and evaluation")
    _add(data, "dataset", "UTF-8 JSONL training data, one object per line with 'prompt' (text or chat messages) "
         "and 'answer'; default: the built-in --task", metavar="FILE.jsonl")
    _add(data, "task", "built-in task used without --dataset (copy: repeat a string of letters)")
    data.add_argument("--reward", dest="rewards", action="append", default=None, metavar="NAME[=WEIGHT]",
                      help="reward function, repeatable, weights summed: a built-in (copy, math, boxed, hash, "
                           "last_number, format) or package.module:function; default: copy for the built-in task, "
                           "math for --dataset")
    _add(data, "eval_dataset", "JSONL of evaluation prompts for the greedy evaluation (default: prompts held out "
         "of the training data, see --eval-size); called held-out only when no prompt is also in the training data",
         metavar="FILE.jsonl")
    _add(data, "eval_size", "distinct prompts held out of the training data for evaluation; every row with such a "
         "prompt leaves training (default: 10%% of the distinct prompts, at most 128; 0: no evaluation)", type=int)
    _add(data, "eval_every", "greedy evaluation every N optimizer steps (and at the start and the end)", type=int)
    _add(data, "advantage_scale", "divide advantages (reward minus group mean) by the group's std, the batch's "
         "std, or nothing")
    _add(data, "chat_template", "wrap text prompts in the tokenizer's chat template (auto: if it has one)")
    _add(data, "system_prompt", "system message (chat) or first line (plain text) added to every prompt",
         metavar="TEXT")
    _add(data, "max_prompt_length", "keep only the last N tokens of each prompt (default: whole prompts)", type=int)
    _add(data, "truncate_prompts", "cut prompts that leave no room for --max-new-tokens in the model's context "
         "(left: drop their beginning, right: their end); default: refuse such a prompt, naming its row",
         choices=("left", "right"))

    _add_generation_arguments(p.add_argument_group("generation"))
    _add_optimization_arguments(p.add_argument_group("optimization"))
    loss = p.add_argument_group("loss (grpo_kernels.GRPOLossConfig)")
    _add_loss_arguments(loss)
    _add_distillation_arguments(p.add_argument_group("distillation (--teacher)"))
    return p


def config_from_argv(argv=None) -> TrainConfig:
    """Parse and validate; every bad argument raises UsageError (one line, see grpo/train.py)."""
    values = vars(build_parser().parse_args(argv))
    loss_values = {k.split(".", 1)[1]: values.pop(k) for k in list(values) if k.startswith("loss.")}
    try:
        loss = GRPOLossConfig(**loss_values)
    except ValueError as exc:
        raise loss_option_error(exc) from None
    values["rewards"] = tuple(values["rewards"] or ())
    return TrainConfig(loss=loss, **values)
