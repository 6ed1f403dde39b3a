"""``TrainConfig``: every option of a training run, in one frozen dataclass validated once.

The command line (``grpo/cli.py``) builds one from its flags; Python code builds one directly::

    from grpo import TrainConfig
    from grpo.train import train
    result = train(TrainConfig(max_steps=50, output_dir="runs/try", overwrite=True))

Defaults that depend on the model (learning rate, completion length) and on the rollout (mini/micro-batch sizes,
rewards, the held-out split) are resolved in ``__post_init__``, so a constructed config holds the values the run
uses. Any bad value raises ``UsageError`` naming the option, before anything heavy is loaded.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field

from grpo_kernels import GRPOLossConfig
from grpo_kernels.config import IMPLS

from .data import BUILTIN_TASKS, TASK_COMPLETION_CHARS
from .errors import UsageError
from .rewards import RewardSpec, parse_reward_spec

# --single-pass keeps the sampling forward's graph: its KV cache's saved tensors grow with the square of the length.
SINGLE_PASS_MAX_NEW_TOKENS = 64
# The train-time loss default that differs from GRPOLossConfig's (TRL's): a small KL penalty, so that the KL column
# of the progress bar and of the plot means something on the built-in task.
DEFAULT_LOSS = GRPOLossConfig(beta=0.02)
CHOICES = {
    "device": ("auto", "cpu", "cuda"),
    "dtype": ("auto", "float32", "bfloat16", "float16"),
    "autocast": ("auto", "bfloat16", "float16", "none"),
    "impl": IMPLS,
    "task": tuple(sorted(BUILTIN_TASKS)),
    "advantage_scale": ("group", "batch", "none"),
    "chat_template": ("auto", "on", "off"),
    "lr_scheduler": ("cosine", "linear", "constant"),
    "fsdp_grad_sync": ("micro_batch", "step"),
}


@dataclass(frozen=True)
class TrainConfig:
    """One training run. Field names are the command-line flags with ``_`` for ``-`` (``max_steps`` ->
    ``--max-steps``); ``loss`` holds every ``GRPOLossConfig`` option (its temperature is ``temperature``)."""

    # run
    output_dir: str | None = None      # None: a new runs/version_N per run (grpo.train.train; run_folder.py)
    seed: int = 0
    max_steps: int = 800
    resume: str | None = None          # a checkpoint directory, or "latest" (the newest one in output_dir)
    overwrite: bool = False            # start afresh in a non-empty output_dir (deletes its previous run)
    save_steps: int = 100
    save_total_limit: int = 2
    device: str = "auto"
    fsdp: bool = False                 # FSDP2 (fully_shard) instead of DDP; a single process is a 1-rank mesh
    fsdp_grad_sync: str = "micro_batch"  # FSDP2 gradient accumulation: reduce-scatter every micro-batch or per step
    progress: bool = True
    # model
    model: str | None = None
    dtype: str = "auto"
    autocast: str = "auto"
    attn_implementation: str = "auto"
    liger_layers: bool = False
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    impl: str = "auto"
    hidden_size: int = 64
    num_layers: int = 3
    num_heads: int = 4
    # data, rewards, evaluation
    dataset: str | None = None
    task: str = "copy"
    rewards: tuple[str, ...] = ()
    completion_chars: str | None = None  # sample only these characters (+ EOS); None: any text (the built-in
    #                                      task: its answer alphabet)
    eval_dataset: str | None = None
    eval_size: int | None = None       # rows held out of the training data (None: 10%, at most 128; 0: no eval)
    eval_every: int = 50
    advantage_scale: str = "group"
    chat_template: str = "auto"
    system_prompt: str | None = None
    max_prompt_length: int | None = None
    truncate_prompts: str | None = None  # None: a prompt that leaves no room for --max-new-tokens in the model's
    #                                      context is an error; "left" / "right": cut its beginning / its end
    # generation
    num_generations: int = 8
    prompts_per_step: int = 16
    max_new_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    mask_truncated_completions: bool = False
    # optimization
    lr: float | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.99
    warmup_steps: int = 10
    lr_scheduler: str = "cosine"
    min_lr_ratio: float = 0.1
    max_grad_norm: float = 1.0
    num_iterations: int = 1
    mini_batch_size: int | None = None
    micro_batch_size: int | None = None
    packing: bool = True               # padding-free micro-batches where the model's attention supports them
    single_pass: bool = False          # the loss backpropagates through the sampling forward (padded rows)
    max_tokens_per_micro_batch: int | None = None  # packed micro-batches: token budget (None: no budget)
    loss: GRPOLossConfig = DEFAULT_LOSS
    # on-policy distillation (grpo/distillation.py): every completion token scored against a frozen teacher
    teacher: str | None = None         # a model folder (save_pretrained) or a grpo.train checkpoint-N folder
    distill_beta: float = 1.0          # 0: KL(teacher || student), 1: KL(student || teacher), else the JSD
    distill_temperature: float = 1.0   # both models' logits divided by it in the divergence
    distill_coef: float = 1.0          # weight of the distillation loss added to the GRPO loss
    distill_only: bool = False         # the distillation loss alone: no GRPO term, no reference model
    reward_specs: tuple[RewardSpec, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        builtin = self.model is None  # defaults that depend on the model: a random-init toy vs a pretrained LM
        if self.lr is None:
            self._set(lr=1e-3 if builtin else 1e-6)
        if self.max_new_tokens is None:
            self._set(max_new_tokens=6 if builtin else 256)
        for name, choices in CHOICES.items():
            _check(getattr(self, name) in choices,
                   f"--{_flag(name)} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        _check(self.truncate_prompts in (None, "left", "right"),
               f"--truncate-prompts must be left or right, got {self.truncate_prompts!r}")
        self._check_numbers()
        _check(self.hidden_size % self.num_heads == 0,
               f"--hidden-size {self.hidden_size} must be a multiple of --num-heads {self.num_heads}")
        rollout = self.prompts_per_step * self.num_generations
        mini = self.mini_batch_size or rollout
        micro = self.micro_batch_size or mini
        _check(1 <= mini <= rollout and rollout % mini == 0,
               f"--mini-batch-size {mini} must divide the rollout size --prompts-per-step x --num-generations = "
               f"{rollout}")
        _check(1 <= micro <= mini and mini % micro == 0,
               f"--micro-batch-size {micro} must divide the mini-batch size {mini}")
        self._set(mini_batch_size=mini, micro_batch_size=micro)
        for name in ("dataset", "eval_dataset"):
            path = getattr(self, name)
            _check(path is None or os.path.isfile(path), f"--{_flag(name)} {path!r}: file not found")
        _check(self.model is None or os.path.isdir(self.model),
               f"--model {self.model!r}: not a directory (give a local checkpoint saved with save_pretrained)")
        _check(self.output_dir is None or not os.path.exists(self.output_dir) or os.path.isdir(self.output_dir),
               f"--output-dir {self.output_dir!r} exists and is not a directory")
        _check(not (self.overwrite and self.output_dir is None),
               "--overwrite replaces the run in --output-dir DIR: name that folder (without --output-dir every run "
               "gets a new, empty runs/version_N)")
        _check(self.resume in (None, "latest") or os.path.isdir(self.resume),
               f"--resume {self.resume!r}: no such checkpoint directory")
        _check(not (self.resume is not None and self.overwrite), "--resume and --overwrite exclude each other")
        _check(isinstance(self.fsdp, bool), f"--fsdp is a switch (True / False), got {self.fsdp!r}")
        _check(isinstance(self.packing, bool), f"--packing is a switch (True / False), got {self.packing!r}")
        _check(self.packing or self.max_tokens_per_micro_batch is None,
               "--max-tokens-per-micro-batch cuts packed micro-batches: drop --no-packing, or bound padded "
               "micro-batches with --micro-batch-size")
        _check(self.fsdp or self.fsdp_grad_sync == "micro_batch",
               f"--fsdp-grad-sync {self.fsdp_grad_sync} only applies to --fsdp runs: add --fsdp (or drop "
               "--fsdp-grad-sync; DDP reduces gradients once per optimizer step)")
        self._check_attention()
        self._check_single_pass(rollout)
        self._check_distillation()
        _check(self.completion_chars is None or len(self.completion_chars) > 0,
               "--completion-chars must name at least one character")
        if self.completion_chars is None and self.dataset is None:
            self._set(completion_chars=TASK_COMPLETION_CHARS.get(self.task))
        rewards = tuple(self.rewards) or (("math",) if self.dataset is not None else ("copy",))
        self._set(rewards=rewards, reward_specs=tuple(parse_reward_spec(spec) for spec in rewards))
        self._set(loss=self._loss_config())

    def _check_numbers(self) -> None:
        """Every numeric option: type, finiteness and range, each failure one line naming the flag. (The loss
        options are checked again by GRPOLossConfig; the ones whose wrong sign the loss would silently accept are
        checked here too, under their flag names.)"""
        ints = {"seed": 0, "max_steps": 1, "save_steps": 0, "save_total_limit": 0, "hidden_size": 1, "num_layers": 1,
                "num_heads": 1, "eval_every": 1, "num_generations": 2, "prompts_per_step": 1, "max_new_tokens": 1,
                "top_k": 0, "warmup_steps": 0, "num_iterations": 1}
        optional_ints = {"eval_size": 0, "max_prompt_length": 1, "mini_batch_size": 1, "micro_batch_size": 1,
                         "max_tokens_per_micro_batch": 1}
        why = {"num_generations": " (GRPO compares completions within a group)",
               "save_total_limit": " (0 keeps every checkpoint)", "seed": ""}
        for name, low in list(ints.items()) + list(optional_ints.items()):
            value = getattr(self, name)
            if value is None and name in optional_ints:
                continue
            _check(isinstance(value, int) and not isinstance(value, bool),
                   f"--{_flag(name)} must be an integer, got {value!r}")
            _check(value >= low, f"--{_flag(name)} must be >= {low}{why.get(name, '')}, got {value}")
        _check(self.seed < 2**32, f"--seed must be < 2**32, got {self.seed}")
        floats = {"temperature": (lambda v: v > 0, "> 0"), "top_p": (lambda v: 0 < v <= 1, "in (0, 1]"),
                  "lr": (lambda v: v > 0, "> 0"), "weight_decay": (lambda v: v >= 0, ">= 0"),
                  "adam_beta1": (lambda v: 0 <= v < 1, "in [0, 1)"), "adam_beta2": (lambda v: 0 <= v < 1, "in [0, 1)"),
                  "min_lr_ratio": (lambda v: 0 <= v <= 1, "in [0, 1]"), "max_grad_norm": (lambda v: v >= 0, ">= 0")}
        for name, (ok, allowed) in floats.items():
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool),
                   f"--{_flag(name)} must be a number, got {value!r}")
            _check(math.isfinite(value) and ok(value), f"--{_flag(name)} must be {allowed}, got {value}")
        # The KL coefficient is a penalty: a negative one rewards drifting away from the reference model.
        beta = getattr(self.loss, "beta", 0.0)
        _check(isinstance(beta, (int, float)) and math.isfinite(beta) and beta >= 0,
               f"--beta must be >= 0 (the KL penalty's coefficient; 0 turns it off), got {beta}")

    def _check_single_pass(self, rollout: int) -> None:
        """--single-pass: the rollout feeds one on-policy optimizer step in one micro-batch, completions are short,
        and nothing must re-run the forward (gradient checkpointing) or hook it (FSDP; DDP: ``Trainer``)."""
        _check(isinstance(self.single_pass, bool),
               f"--single-pass is a switch (True / False), got {self.single_pass!r}")
        if not self.single_pass:
            return
        needs = [
            (self.num_iterations == 1, f"--num-iterations 1 (got {self.num_iterations})"),
            (self.micro_batch_size == rollout, f"the whole rollout ({rollout}) as one mini-batch and one micro-batch "
                                               f"(got --mini-batch-size {self.mini_batch_size}, --micro-batch-size "
                                               f"{self.micro_batch_size})"),
            (self.max_new_tokens <= SINGLE_PASS_MAX_NEW_TOKENS,
             f"--max-new-tokens <= {SINGLE_PASS_MAX_NEW_TOKENS} (got {self.max_new_tokens}; the sampling forward's "
             "saved tensors grow with the square of the length)"),
            (not self.fsdp, "no --fsdp (its hooks need the forward to go through the root)"),
            (not self.gradient_checkpointing, "no --gradient-checkpointing (the sampling forward is not re-run)"),
        ]
        for ok, what in needs:
            _check(ok, f"--single-pass backpropagates through the sampling forward of one on-policy step: it needs "
                       f"{what}")

    def _check_distillation(self) -> None:
        """--teacher and the --distill-* options: ranges, and no distillation option without a teacher. With
        --distill-only the GRPO loss is not computed, so its KL penalty (the default --beta 0.02) is turned off and
        another --beta refused."""
        _check(self.teacher is None or os.path.isdir(self.teacher),
               f"--teacher {self.teacher!r}: not a directory (give a model folder saved with save_pretrained, or a "
               "grpo.train checkpoint-N folder)")
        for name, ok, allowed in (("distill_beta", lambda v: 0 <= v <= 1, "in [0, 1] (0: forward KL(teacher || "
                                   "student), 1: reverse KL(student || teacher), between: the generalized JSD)"),
                                  ("distill_temperature", lambda v: v > 0, "> 0"),
                                  ("distill_coef", lambda v: v > 0, "> 0 (the weight of the distillation loss)")):
            value = getattr(self, name)
            _check(isinstance(value, (int, float)) and not isinstance(value, bool),
                   f"--{_flag(name)} must be a number, got {value!r}")
            _check(math.isfinite(value) and ok(value), f"--{_flag(name)} must be {allowed}, got {value}")
        _check(isinstance(self.distill_only, bool),
               f"--distill-only is a switch (True / False), got {self.distill_only!r}")
        if self.teacher is None:
            given = [f"--{_flag(f.name)}" for f in dataclasses.fields(self)
                     if f.name.startswith("distill_") and getattr(self, f.name) != f.default]
            _check(not given, f"{', '.join(given)} only apply to distillation: add --teacher PATH (or drop them)")
            return
        if self.distill_only and isinstance(self.loss, GRPOLossConfig):
            beta = self.loss.beta
            _check(beta in (0.0, DEFAULT_LOSS.beta),
                   f"--distill-only trains on the distillation loss alone, without the GRPO loss and its KL penalty: "
                   f"drop --beta {beta} (or drop --distill-only)")
            self._set(loss=dataclasses.replace(self.loss, beta=0.0))

    def _check_attention(self) -> None:
        """A flash-attn implementation named for a run whose forwards are float32 (flash-attn has no float32
        kernels): refused here, not deep inside the first forward. ``--device auto`` resolves as the run will."""
        from .modeling import HALF_ONLY_ATTENTION, run_dtypes

        if self.attn_implementation not in HALF_ONLY_ATTENTION:
            return
        import torch

        cuda = self.device == "cuda" or (self.device == "auto" and torch.cuda.is_available())
        param, autocast = run_dtypes(self.dtype, self.autocast, "cuda" if cuda else "cpu")
        _check((autocast or param) != torch.float32,
               f"--attn-implementation {self.attn_implementation} runs only in bfloat16 or float16 (flash-attn has "
               f"no float32 kernels), but this run's forwards are float32 (--dtype {self.dtype}, --autocast "
               f"{self.autocast}{'' if cuda else ', no CUDA device'}): pass --dtype bfloat16 or, on CUDA, "
               "--autocast bfloat16, or another --attn-implementation")

    def _loss_config(self) -> GRPOLossConfig:
        loss = self.loss
        _check(isinstance(loss, GRPOLossConfig), f"loss must be a GRPOLossConfig, got {type(loss).__name__}")
        _check(not loss.capturable,
               "loss.capturable=True prepares the loss for CUDA-graph capture, which grpo.train does not do: it would "
               "only compute the padded rows too; leave it False")
        _check(loss.temperature in (1.0, self.temperature),
               f"loss.temperature={loss.temperature} differs from --temperature {self.temperature}: the loss must "
               "score tokens at the temperature they were sampled with; set TrainConfig.temperature only")
        overrides = {"temperature": self.temperature}
        if loss.max_completion_length is None:
            overrides["max_completion_length"] = self.max_new_tokens
        try:
            return dataclasses.replace(loss, **overrides)
        except ValueError as exc:
            raise loss_option_error(exc) from None

    def _set(self, **values) -> None:
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def to_dict(self) -> dict:
        """Plain values (args.json, checkpoints): the loss options flattened under their own names."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init and f.name != "loss"}
        out["rewards"] = list(self.rewards)
        out.update(dataclasses.asdict(self.loss))
        return out


def loss_option_error(exc: ValueError) -> UsageError:
    """GRPOLossConfig's ValueError (it starts with the field's name) as a UsageError naming the flag too."""
    name = str(exc).split(" ", 1)[0]
    if name in {f.name for f in dataclasses.fields(GRPOLossConfig)}:
        return UsageError(f"--{_flag(name)}: {exc}")
    return UsageError(f"invalid loss option: {exc}")


def quiet_unused_deepspeed() -> None:
    """Keep DeepSpeed's import-time "[WARNING] ... Setting accelerator to CPU" out of runs that do not use it.

    grpo.train never uses DeepSpeed, but when it is installed, saving a checkpoint imports it (transformers'
    ``save_pretrained`` -> accelerate's ``extract_model_from_parallel``), and DeepSpeed then guesses its accelerator
    and warns on stdout, into the progress bar, when it finds no GPU. Naming the CPU accelerator up front (only where
    there is no CUDA device, where DeepSpeed would pick the CPU anyway, and only when nobody chose one or imported
    DeepSpeed already) silences the guess and changes nothing else."""
    import sys

    if "deepspeed" in sys.modules or "DS_ACCELERATOR" in os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def _flag(name: str) -> str:
    return name.replace("_", "-")


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise UsageError(message)
