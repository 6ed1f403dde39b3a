"""Options of the two-head distillation divergence, in one frozen dataclass validated once (docs/DESIGN.md,
"Distillation"; docs/api.md, "Distillation").

Defaults follow TRL 1.16's ``DistillationConfig`` / ``_chunked_divergence_loss`` (beta 1.0: the reverse KL), so that
a config built from a trainer's arguments reproduces the trainer's numbers.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import _checks

# What beta selects (TRL's convention; exactly 0 and exactly 1 are not the generalized JSD's limits in floating
# point, where the JSD of beta -> 0 tends to 0, not to a KL): the modes the kernels compile (a MODE constexpr).
FORWARD_KL, REVERSE_KL, JSD = 0, 1, 2


def divergence_mode(beta: float) -> int:
    """``FORWARD_KL`` (beta == 0: KL(teacher || student)), ``REVERSE_KL`` (beta == 1: KL(student || teacher)) or
    ``JSD`` (0 < beta < 1: the generalized JSD with mixture (1 - beta) p_student + beta p_teacher).

    Under torch.compile with beta symbolic (automatic dynamic, ``dynamic=True``) the two comparisons are guards of
    the graph, no graph break: the mode is a compile-time choice of the paths (a MODE constexpr of the kernels, a
    branch of the PyTorch chunks), so a beta crossing to 0 or 1 compiles that mode's graph once, which later betas
    of the same mode reuse (docs/api.md, "torch.compile")."""
    return FORWARD_KL if beta == 0.0 else REVERSE_KL if beta == 1.0 else JSD


def _number(name: str, value, *, positive: bool = False) -> float:
    """A finite number (> 0 with ``positive``), concrete or symbolic under torch.compile (``_checks.finite``)."""
    _checks.finite(name, value, positive=positive)
    return float(value)


@dataclass(frozen=True)
class ModelTransform:
    """What the kernels do to one model's raw logit x = h W^T + b before its softmax:
    ``z = softcap * tanh(scale * r(x) / softcap) / temperature`` (no cap: ``scale * r(x) / temperature``), r the
    rounding of ``round_logits`` (the identity when None). TRL's order: scale, then soft cap, then temperature."""

    scale: float = 1.0
    softcap: float | None = None
    temperature: float = 1.0
    round_logits: str | None = None

    @property
    def inv_temperature(self) -> float:
        return 1.0 / self.temperature


@dataclass(frozen=True)
class DistillLossConfig:
    """Every non-tensor option of the two-head divergence (``linear_token_divergence``, ``fused_linear_distill_loss``).

    beta: in [0, 1]; 0 is the forward KL(teacher || student), 1 the reverse KL(student || teacher), anything in
        between the generalized JSD with mixture ``(1 - beta) p_student + beta p_teacher`` (TRL's convention).
    temperature: > 0; both models' logits are divided by it (after scale and soft cap).
    student_logit_scale / teacher_logit_scale: each model's logit multiplier (Cohere's ``logit_scale``, Granite's
        ``1 / logits_scaling``), applied first; any finite number (TRL keeps a real 0.0).
    student_softcap / teacher_softcap: None, or a cap > 0: ``cap * tanh(scale * x / cap)`` (Gemma 2's
        ``final_logit_softcapping``), after the scale, before the temperature.
    round_logits: None, or "bf16" / "fp16": both models' raw logits (accumulated in fp32) rounded to that dtype,
        to nearest even, before the scale (the sampler's recipe, docs/numerics.md "Rounding the logits");
        straight-through in the backward.
    batch_invariant: each token's divergence, entropy and gradient with respect to its hidden state bitwise the same
        whatever else is in the call (fixed row blocks, the last one padded; vocabulary tiles fixed by V); the loss
        and metrics summed in a fixed per-sequence order. Needs ``deterministic``.
    invariant_block_rows: None (the device's block, ``invariance.BLOCK_ROWS``) or the rows per block of
        ``batch_invariant=True``, an int >= 1, refused without it: ``GRPOLossConfig.invariant_block_rows``'s rules
        (``_checks.invariant_block_rows``): another block is another bit pattern, never chosen silently.
    deterministic: every distillation path is free of float atomics (each output element is written by one program
        or one GEMM per chunk, in a fixed order); the flag is accepted for symmetry with ``GRPOLossConfig`` and must
        be True with ``batch_invariant``.
    grad_in_forward: the loss computes the student's gradients in its forward pass when they fit the budget (the
        reduction's per-token weights are known before the sweep); False forces the recompute path.
    memory_budget: bytes of transient memory a call may allocate beyond its inputs and returned gradients, on every
        path (docs/memory.md, "Distillation"); None: 1 GiB of working memory plus the fast path's fp32 weight-gradient
        accumulator.
    """

    beta: float = 1.0
    temperature: float = 1.0
    student_logit_scale: float = 1.0
    student_softcap: float | None = None
    teacher_logit_scale: float = 1.0
    teacher_softcap: float | None = None
    round_logits: str | None = None
    batch_invariant: bool = False
    invariant_block_rows: int | None = None
    deterministic: bool = True
    grad_in_forward: bool = True
    memory_budget: int | None = None

    def __post_init__(self) -> None:
        beta = _number("beta", self.beta)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1] (0: forward KL, 1: reverse KL, else the generalized JSD), "
                             f"got {_checks.shown(self.beta)}")
        _checks.temperature(self.temperature)
        _number("student_logit_scale", self.student_logit_scale)
        _number("teacher_logit_scale", self.teacher_logit_scale)
        for name in ("student_softcap", "teacher_softcap"):
            if getattr(self, name) is not None:
                _number(name, getattr(self, name), positive=True)
        _checks.round_logits(self.round_logits)
        for name in ("batch_invariant", "deterministic", "grad_in_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.batch_invariant and not self.deterministic:
            raise ValueError("batch_invariant=True needs deterministic=True")
        _checks.invariant_block_rows(self.invariant_block_rows, self.batch_invariant)
        if self.memory_budget is not None and (isinstance(self.memory_budget, bool)
                                               or not isinstance(self.memory_budget, int) or self.memory_budget < 0):
            raise ValueError(f"memory_budget must be None or an int number of bytes >= 0, got {self.memory_budget!r}")

    @property
    def mode(self) -> int:
        return divergence_mode(self.beta)

    @property
    def student(self) -> ModelTransform:
        return ModelTransform(float(self.student_logit_scale), self.student_softcap, float(self.temperature),
                              self.round_logits)

    @property
    def teacher(self) -> ModelTransform:
        return ModelTransform(float(self.teacher_logit_scale), self.teacher_softcap, float(self.temperature),
                              self.round_logits)

    def replace(self, **overrides) -> "DistillLossConfig":
        return dataclasses.replace(self, **overrides)


_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(DistillLossConfig))


def resolve_distill_config(config: DistillLossConfig | None, overrides: dict) -> DistillLossConfig:
    """``config`` with keyword overrides applied; unknown names raise a ValueError naming them."""
    if config is None:
        config = DistillLossConfig()
    elif not isinstance(config, DistillLossConfig):
        raise ValueError(f"config must be a DistillLossConfig, got {type(config).__name__}")
    if not overrides:
        return config
    unknown = sorted(set(overrides) - _OPTION_NAMES)
    if unknown:
        raise ValueError(f"unknown distillation option(s) {unknown}; known options: {sorted(_OPTION_NAMES)}")
    return dataclasses.replace(config, **overrides)
