"""Options of the GRPO loss, in one frozen dataclass validated once (docs/DESIGN.md section 4).

Defaults follow TRL's ``GRPOConfig`` (TRL 1.16) so that a config built from a trainer's arguments reproduces
the trainer's numbers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import _checks
from .loss_types import CLIPPED_LOSS_TYPES, LOSS_TYPES  # noqa: F401  (the table's names, re-exported)
from .peer_warnings import warn_like_peers

IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
IMPLS = ("auto", "triton", "torch")


@dataclass(frozen=True)
class LogitTransform:
    """What the kernels do to a raw logit x before the softmax: ``z = softcap * tanh(r(x) / softcap) / temperature``
    (no cap when ``softcap`` is None), ``r`` the rounding of x to ``round_logits`` ("bf16" / "fp16", to nearest
    even, then read as fp32: the sampler's recipe, docs/numerics.md "Rounding the logits"), or the identity when
    None. Built once per call from the caller's options and carried by the validated inputs
    (``inputs.LogitsInputs`` / ``HeadInputs``): the one carrier of these values below the entry points."""

    temperature: float = 1.0
    softcap: float | None = None
    round_logits: str | None = None
    invariant_block_rows: int | None = None

    def __post_init__(self) -> None:
        _checks.temperature(self.temperature)
        _checks.softcap(self.softcap)
        _checks.round_logits(self.round_logits)

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


# The per-token statistics a log-prob sweep can add beyond logp / lse / entropy (TRL's ``ChunkedLogProbFunction``
# outputs of the same names; ``reference.token_extras`` defines them): log sum_v p_v^2, the mean over V of the
# transformed logits z, and whether the target is the argmax of z (the first maximum winning ties).
EXTRA_OUTPUTS = ("log_sum_sq_probs", "mean_logits", "is_top1")


@dataclass(frozen=True)
class TokenExtras:
    """Which of ``EXTRA_OUTPUTS`` a sweep computes (all off: the sweep is exactly the log-prob one). They are
    statistics of the same sweep over V, never differentiable."""

    log_sum_sq_probs: bool = False
    mean_logits: bool = False
    is_top1: bool = False

    @classmethod
    def of(cls, names, arg: str = "extra_outputs") -> "TokenExtras":
        """From a tuple / list of names among ``EXTRA_OUTPUTS`` (each at most once); a ValueError naming ``arg``
        otherwise."""
        if isinstance(names, str) or not isinstance(names, (tuple, list)):
            raise ValueError(f"{arg} must be a tuple of names among {EXTRA_OUTPUTS}, got {names!r}")
        unknown = [n for n in names if n not in EXTRA_OUTPUTS]
        if unknown:
            raise ValueError(f"{arg}: unknown output {unknown[0]!r}; expected names among {EXTRA_OUTPUTS}")
        if len(set(names)) != len(names):
            raise ValueError(f"{arg} names an output more than once: {tuple(names)!r}")
        return cls(**{n: True for n in names})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in EXTRA_OUTPUTS if getattr(self, n))

    def __bool__(self) -> bool:
        return bool(self.names)


@dataclass(frozen=True)
class GRPOLossConfig:
    """Every non-tensor option of the GRPO loss (docs/DESIGN.md section 2).

    loss_type: one of ``LOSS_TYPES``; the reduction and the policy term follow TRL's ``_compute_loss``.
    beta: KL coefficient, >= 0; ``ref_logps`` is required when it is not 0.
    epsilon_low / epsilon_high: PPO clip range ``[1 - eps_low, 1 + eps_high]``; for cispo epsilon_high is the raw
        upper bound of the ratio.
    temperature: logits are divided by it before the softmax.
    use_bias_correction_kl: multiply the k3 KL by the importance ratio (TRL default True).
    importance_sampling_level: "token" or "sequence" (GSPO).
    delta: optional upper clamp of the unclipped ratio (INTELLECT-2 two-sided clipping).
    max_completion_length: normalizer of dr_grpo (defaults to T of the batch when None).
    sapo_temperature_pos / _neg: SAPO gate temperatures for positive / non-positive advantages.
    vespo_*: VESPO gamma-weight shape and rate for non-negative / negative advantages.
    off_policy_mask_threshold: drop rows with A < 0 whose mean ``sampling_logp - logp`` exceeds it (DeepSeek-V3.2).
    top_entropy_quantile: keep only tokens whose entropy is in the top fraction (1.0 keeps all).
    entropy_coef: entropy bonus; the loss becomes ``loss - entropy_coef * masked_mean(entropy)``.
    deterministic: fused-linear Triton backward without float atomics (bitwise reproducible; the default). False
        selects the CCE-style backward that accumulates d hidden / d weight with fp32 atomics: no d-logits chunk
        buffer, but run-to-run differences in the last bits (and fp32 accumulators for bf16/fp16 weights).
    grad_in_forward: on the Triton path, compute the gradient of the loss in the forward pass when every token's
        gradient is known as soon as its log-prob is (``loss_types.per_token_gradient_known``); the backward then
        only scales it by the incoming gradient. False forces the separate forward / backward sweeps.
    memory_budget: bytes of transient memory a call may allocate beyond its inputs and returned gradients, on every
        path (docs/memory.md); None: 1 GiB of working memory, plus the fused head fast path's fp32 weight-gradient
        accumulator. The planner picks the fastest path that fits (``grpo_kernels.explain`` shows it) and raises a
        ValueError naming memory_budget when none does.
    softcap: soft-cap the logits, ``cap * tanh(logits / cap)``, before the temperature (Gemma 2's
        ``final_logit_softcapping``); None: no cap. Every path applies it inside its kernels (docs/numerics.md).
    capturable: make no host sync at all, so that the call can be captured in a CUDA graph (docs/api.md, "Host
        syncs"): the fused head then computes the padded rows too (they must hold finite values, as a model's hidden
        states do; their loss and gradient contributions are exactly 0) instead of compacting the valid ones.
    batch_invariant: a sequence's numbers never depend on the batch around it (docs/numerics.md, "Batch
        invariance"): every row's log-prob, entropy, per-token loss terms and gradient are bitwise the same
        whatever else is in the call (batch size, position, padded or packed, memory budget, chunking); the
        loss and metrics are sums in a fixed per-sequence order (the same bits padded or packed). Fixed row
        blocks (the last one padded), fixed vocabulary chunks, no split depending on the batch; implies
        ``deterministic``.
    invariant_block_rows: None (the device's block: 256 rows on CPU, 512 on CUDA, ``invariance.BLOCK_ROWS``) or
        the rows per block of ``batch_invariant=True`` (an int >= 1; refused without batch_invariant). Every call
        computes whole blocks, so a block far above the batch's rows costs a block's work (docs/numerics.md
        "Batch invariance": the floor and the cost at small N). Another block is another bit pattern: results are
        bitwise equal only between calls with the same block (pass the same value to the no-gradient log-prob
        functions that make old / reference log-probs).
    round_logits: None, or "bf16" / "fp16": round the raw logits (``hidden @ weight.T + bias`` accumulated in fp32,
        or the given logits) to that dtype, to nearest even, before the soft cap, the temperature and the softmax,
        as a sampler (vLLM) or TRL's head under autocast does (docs/numerics.md "Rounding the logits"); the
        backward takes the rounding as the identity. None (default): fp32 logits, closer to float64.
    """

    loss_type: str = "dapo"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    temperature: float = 1.0
    use_bias_correction_kl: bool = True
    importance_sampling_level: str = "token"
    delta: float | None = None
    max_completion_length: int | None = None
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    entropy_coef: float = 0.0
    deterministic: bool = True
    grad_in_forward: bool = True
    memory_budget: int | None = None
    # Why last: a new field in the middle would shift every positional argument after it
    softcap: float | None = None
    capturable: bool = False
    batch_invariant: bool = False
    round_logits: str | None = None
    invariant_block_rows: int | None = None

    def __post_init__(self) -> None:
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, "
                f"got {self.importance_sampling_level!r}"
            )
        _checks.round_logits(self.round_logits)
        _checks.finite("beta", self.beta, nonneg=True)
        _checks.finite("temperature", self.temperature, positive=True)
        if self.softcap is not None:
            _checks.finite("softcap", self.softcap, positive=True)
        _checks.finite("epsilon_high", self.epsilon_high, positive=True)
        _checks.finite("epsilon_low", self.epsilon_low, nonneg=True)
        if self.loss_type != "cispo" and self.epsilon_low >= 1.0:
            raise ValueError(f"epsilon_low must be in [0, 1) so that 1 - epsilon_low > 0, got "
                             f"{_checks.shown(self.epsilon_low)}")
        if self.delta is not None:
            _checks.finite("delta", self.delta, positive=True)
        if self.max_completion_length is not None:
            if isinstance(self.max_completion_length, bool) or not isinstance(self.max_completion_length, int) \
                    or self.max_completion_length < 1:
                raise ValueError(f"max_completion_length must be a positive int, got {self.max_completion_length!r}")
        _checks.finite("sapo_temperature_pos", self.sapo_temperature_pos, positive=True)
        _checks.finite("sapo_temperature_neg", self.sapo_temperature_neg, positive=True)
        for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"):
            _checks.finite(name, getattr(self, name))
        if self.off_policy_mask_threshold is not None:
            _checks.finite("off_policy_mask_threshold", self.off_policy_mask_threshold)
        _checks.finite("top_entropy_quantile", self.top_entropy_quantile)
        if not 0.0 < self.top_entropy_quantile <= 1.0:
            raise ValueError(f"top_entropy_quantile must be in (0, 1], got {_checks.shown(self.top_entropy_quantile)}")
        _checks.finite("entropy_coef", self.entropy_coef)
        for name in ("use_bias_correction_kl", "deterministic", "grad_in_forward", "capturable", "batch_invariant"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.batch_invariant and not self.deterministic:
            raise ValueError("batch_invariant=True needs deterministic=True (float atomics add in an order that "
                             "changes from run to run)")
        _checks.invariant_block_rows(self.invariant_block_rows, self.batch_invariant)
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                               or not isinstance(self.memory_budget, int) or self.memory_budget < 0):
            raise ValueError(f"memory_budget must be None or an int number of bytes >= 0, got {self.memory_budget!r}")
        warn_like_peers(self.loss_type, self.importance_sampling_level)  # TRL's warnings (peer_warnings.py)

    @property
    def needs_entropy(self) -> bool:
        """Whether the loss itself (not only the metric) uses the per-token entropy."""
        return self.top_entropy_quantile < 1.0 or self.entropy_coef != 0.0

    @property
    def transform(self) -> LogitTransform:
        """The logits transform these options ask for (temperature, soft cap, rounding)."""
        return LogitTransform(self.temperature, self.softcap, self.round_logits)

    def replace(self, **overrides) -> "GRPOLossConfig":
        return dataclasses.replace(self, **overrides)


# Computed once: torch.compile cannot trace dataclasses.fields of a class (keyword overrides inside a compiled step)
_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(GRPOLossConfig))


def resolve_config(config: GRPOLossConfig | None, overrides: dict) -> GRPOLossConfig:
    """``config`` with keyword overrides applied; unknown names raise a ValueError naming them."""
    if config is None:
        config = GRPOLossConfig()
    elif not isinstance(config, GRPOLossConfig):
        raise ValueError(f"config must be a GRPOLossConfig, got {type(config).__name__}")
    if not overrides:
        return config
    known = _OPTION_NAMES
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown GRPO loss option(s) {unknown}; known options: {sorted(known)}")
    return dataclasses.replace(config, **overrides)
