"""TRL's ``DistillationTrainer`` on grpo_kernels' two-head divergence (``integrations/trl.py``'s ``patch_trl`` swaps
what ``targets`` lists; its report shows ``routes``).

Where TRL computes the loss. Every TRL series ``patch_trl`` serves (1.12-1.16) has a ``DistillationTrainer`` whose
``_compute_loss`` runs both backbones (the teacher's under no_grad, each through its own DDP / FSDP / DeepSpeed
wrapper with ``_forward_redirection``), reads each model's ``lm_head`` weight and bias, its logit scale and
``final_logit_softcapping``, and makes one call of the module global ``_chunked_divergence_loss(student_hidden
(B, K, H_s), teacher_hidden (B, K, H_t), student_weight (V, H_s), teacher_weight (V, H_t), loss_mask (B, K), beta,
[chunk_size,] num_items_in_batch=, student_lm_head_bias=, teacher_lm_head_bias=, student_logit_scale=,
teacher_logit_scale=, student_final_logit_softcapping=, teacher_final_logit_softcapping=, temperature=)`` ->
``(loss, entropy_sum, n_valid)`` (``chunk_size`` only in 1.12-1.14), inside the student wrapper's forward. That
function is pure: ``sum(D) / num_items_in_batch`` (else the mean over the valid tokens) of the per-token divergence D,
the masked sum of the student's entropy and the valid-token count, which the trainer all-reduces and logs. How it
forms D differs: in 1.15 / 1.16 it calls ``ChunkedDivergenceFunction.apply(student_hidden (N, H_s), student_weight,
student_bias, teacher_hidden (N, H_t), teacher_weight, teacher_bias, beta, temperature, student_logit_scale,
student_final_logit_softcapping, teacher_logit_scale, teacher_final_logit_softcapping) -> (divergence (N,), entropy
(N,))`` (``trl.kernels.chunked_divergence``: 12 N H V FLOPs for a KL, 16 for the JSD; 1.16 looks it up as a global
of ``trl.trainer.distillation_trainer``, 1.15 imports it from its module at each call, and that module needs Triton,
so stock 1.15 cannot distill without it); in 1.12-1.14 it runs ``_chunk`` (both full (256, V) logits chunks in
PyTorch under activation checkpointing) instead.

What ``patch_trl`` swaps:
- ``_chunked_divergence_loss`` (every series) for ``TRLDistillLoss``: ``grpo_kernels.fused_linear_distill_loss``,
  the same reduction (``distill_reference``'s), whose gradient-in-forward path makes the student's gradients in
  the loss's forward: 8 N H V FLOPs at H_s = H_t. So the whole trainer call runs on grpo_kernels, on 1.15 without
  Triton too (the call-time import is never reached). ``chunk_size`` (1.12-1.14) is ignored: the planner chunks.
- ``ChunkedDivergenceFunction`` where TRL looks it up (1.16: the trainer module's global; 1.15: its module's
  attribute, when that module imports) for ``TRLDivergenceFunction``: ``grpo_kernels.linear_token_divergence``
  (recompute backward: 12 N H V), for any other caller of TRL's function (and the calls the loss hands back).
Everything around the call stays TRL's: generation, the teacher's forward, ``num_items_in_batch`` (the generated
tokens over the processes), ``tool_mask``, the logit-scale lookup, metrics and their all-reduce.

Sharded heads. FSDP2: TRL 1.16 turns a DTensor head into a plain tensor (``full_tensor()``) inside the function we
replace; ``fused_linear_distill_loss`` gathers a DTensor head itself, the student's gradient averaged over the mesh
(TRL's ``full_tensor()`` keeps this rank's own: docs/distributed.md); when ``lm_head`` is in the root group (the usual
layout) both see a plain, unsharded tensor during the forward. DeepSpeed ZeRO-3: TRL gathers each head with
``maybe_gather_lm_head_ctx`` around its GEMMs (and again in the backward's recompute); ours passes the same context
per model as ``gather_head`` / ``teacher_gather_head``. The call runs inside the student's forward, as TRL's.

Numbers. In fp32 ours matches TRL to fp32 rounding (and is within K times TRL's own error of float64); under
autocast both run the heads in the autocast dtype with fp32 logits (1.15 / 1.16; 1.12-1.14 round each logits chunk
to it, which ``patch_trl(round_logits="autocast")`` reproduces for those series); fp32 results (fp64 for fp64 inputs
on CPU, where TRL's are fp32).

Handed back to TRL (``TRLDistillLoss`` -> TRL's ``_chunked_divergence_loss``, ``TRLDivergenceFunction`` -> TRL's
``ChunkedDivergenceFunction``), warned once per reason (``patch_trl(strict=True)``: a ValueError at the call):
an option ``DistillLossConfig`` refuses (beta outside [0, 1], a temperature not > 0, a logit scale that is not finite,
a soft cap that is not a finite number > 0: TRL reads a cap of 0 as 1); silently: fp64 off the CPU (the Triton kernels
take fp32 / bf16 / fp16).
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
from typing import Callable

import torch

from ..distill_config import DistillLossConfig

__all__ = ["DistillSeam", "TRLDistillLoss", "TRLDivergenceFunction", "targets", "routes", "trainer_series"]

logger = logging.getLogger("grpo_kernels")

TRAINER_MODULE = "trl.trainer.distillation_trainer"
KERNEL_MODULE = "trl.kernels.chunked_divergence"
LOSS, FUNCTION = "_chunked_divergence_loss", "ChunkedDivergenceFunction"
# Series whose _chunked_divergence_loss runs TRL's PyTorch ``_chunk`` (takes chunk_size; rounds each logits chunk to
# the autocast dtype) rather than ChunkedDivergenceFunction.
CHUNK_SERIES = ("1.12", "1.13", "1.14")
# The report's rows (routes).
LOSS_ROW = "DistillationTrainer loss (TRL 1.12-1.16)"
FUNCTION_ROW = "ChunkedDivergenceFunction (other callers)"
REFUSED_ROW = "  distillation options DistillLossConfig refuses"
SERVER_ROW = "AsyncDistillation / ServerDistillation"
# TRL's argument names -> DistillLossConfig's, in ChunkedDivergenceFunction's order after the six tensors.
_OPTIONS = (("beta", "beta"), ("temperature", "temperature"), ("student_logit_scale", "student_logit_scale"),
            ("student_final_logit_softcapping", "student_softcap"), ("teacher_logit_scale", "teacher_logit_scale"),
            ("teacher_final_logit_softcapping", "teacher_softcap"))


@dataclasses.dataclass(frozen=True)
class DistillSeam:
    """What ``integrations/trl.py`` lends the replacements built here (passed in: this module never imports it).

    fallback: ``(option, reason, using)``: warns once per reason that ``using`` serves those calls, or raises a
        ValueError under ``patch_trl(strict=True)``.
    options: ``(device_type, trl_rounds_logits) -> dict``: the ``DistillLossConfig`` options ``patch_trl`` sets
        (batch_invariant, invariant_block_rows, round_logits; "autocast" resolved for a call on that device, where
        TRL's own function rounds its logits under autocast when ``trl_rounds_logits``).
    gather: ``(weight, bias) -> gather_head | None``: TRL's ZeRO-3 gather of one head, None without ZeRO-3.
    """

    fallback: Callable
    options: Callable
    gather: Callable


def config_of(values: dict, extra: dict) -> tuple[DistillLossConfig | None, tuple[str, str] | None]:
    """``(config, None)`` for TRL's option ``values`` (TRL's names, ``_OPTIONS``) plus ``extra`` (patch_trl's), or
    ``(None, (option, reason))`` naming the first option ``DistillLossConfig`` refuses (its own checks)."""
    for theirs, ours in _OPTIONS:
        try:
            DistillLossConfig(**{ours: values[theirs]})
        except ValueError as exc:
            return None, (f"{theirs}={values[theirs]!r}", str(exc))
    return DistillLossConfig(**{ours: values[theirs] for theirs, ours in _OPTIONS}, **extra), None


def _silent_fallback(hidden: torch.Tensor) -> bool:
    """fp64 off the CPU: the Triton kernels take fp32 / bf16 / fp16 (TRL's function computes fp64 inputs in fp32)."""
    return hidden.dtype == torch.float64 and hidden.device.type != "cpu"


def _in_head_dtype(hidden: torch.Tensor, weight: torch.Tensor, bias):
    """TRL casts a head to its hidden's dtype outside autocast (``weight.to(dtype)``, a master fp32 head beside bf16
    hidden states); under autocast both run in the autocast dtype, which grpo_kernels applies itself."""
    if torch.is_autocast_enabled(hidden.device.type):
        return weight, bias
    return weight.to(hidden.dtype), None if bias is None else bias.to(hidden.dtype)


class _Served:
    """What both replacements share: the seam, TRL's own object for the calls handed back, and the call's config."""

    using = ""
    trl_rounds_logits = False

    def __init__(self, seam: DistillSeam, original):
        self.seam, self.original = seam, original

    def config(self, hidden: torch.Tensor, values: dict) -> DistillLossConfig | None:
        """The call's config, or None after the fallback was announced (warned or, strict, raised)."""
        if _silent_fallback(hidden):
            return None
        cfg, blocker = config_of(values, self.seam.options(hidden.device.type, self.trl_rounds_logits))
        if blocker is not None:
            self.seam.fallback(*blocker, self.using)
        return cfg

    def heads(self, student: tuple, teacher: tuple) -> dict:
        """linear_token_divergence's / fused_linear_distill_loss's head arguments from (hidden, weight, bias) of each
        model: weights in their hidden's dtype (outside autocast), biases, each head's ZeRO-3 gather."""
        (sh, sw, sb), (th, tw, tb) = student, teacher
        gathers = (self.seam.gather(sw, sb), self.seam.gather(tw, tb))
        sw, sb = _in_head_dtype(sh, sw, sb)
        tw, tb = _in_head_dtype(th, tw, tb)
        return dict(student_hidden=sh, student_weight=sw, teacher_hidden=th, teacher_weight=tw, student_bias=sb,
                    teacher_bias=tb, gather_head=gathers[0], teacher_gather_head=gathers[1])


class TRLDivergenceFunction(_Served):
    """Drop-in for TRL's ``ChunkedDivergenceFunction`` (1.15, 1.16; TRL calls only ``apply``), backed by
    ``grpo_kernels.linear_token_divergence``: ``apply(student_hidden (N, H_s), student_weight (V, H_s),
    student_bias, teacher_hidden (N, H_t), teacher_weight (V, H_t), teacher_bias, beta, temperature=1.0,
    student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
    teacher_final_logit_softcapping=None) -> (divergence (N,), student entropy (N,))``, fp32 (fp64 for fp64 inputs on
    CPU); the divergence differentiable to the student's hidden, weight and bias, the entropy not, the teacher never
    (TRL's). ``original``: TRL's own function, for the calls handed back."""

    using = "TRL's own ChunkedDivergenceFunction"

    def apply(self, student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias, beta,
              temperature=1.0, student_logit_scale=1.0, student_final_logit_softcapping=None, teacher_logit_scale=1.0,
              teacher_final_logit_softcapping=None):
        tensors = (student_hidden, student_weight, student_bias, teacher_hidden, teacher_weight, teacher_bias)
        options = (beta, temperature, student_logit_scale, student_final_logit_softcapping, teacher_logit_scale,
                   teacher_final_logit_softcapping)
        cfg = self.config(student_hidden, dict(zip((theirs for theirs, _ in _OPTIONS), options)))
        if cfg is None:
            return self.original.apply(*tensors, *options)
        import grpo_kernels as gk  # at call time: grpo_kernels/__init__.py may import this package

        return gk.linear_token_divergence(**self.heads(tensors[:3], tensors[3:]), config=cfg)


class TRLDistillLoss(_Served):
    """Drop-in for TRL's ``trl.trainer.distillation_trainer._chunked_divergence_loss`` (its signature, read from
    ``original``: 1.12-1.14's takes ``chunk_size``, ignored here), backed by ``grpo_kernels.fused_linear_distill_loss``:
    ``(loss, entropy_sum, n_valid)``: the 0-dim loss ``sum(D) / num_items_in_batch`` over the valid tokens of
    ``completion_mask`` (else their mean, 0 when there are none), differentiable to the student; the student's
    entropy summed over them (no gradient); their count (int64), as TRL returns them."""

    using = "TRL's own _chunked_divergence_loss"

    def __init__(self, seam: DistillSeam, original, series: str):
        super().__init__(seam, original)
        self.signature = inspect.signature(original)
        self.trl_rounds_logits = series in CHUNK_SERIES

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        hidden, mask = a["student_hidden_states"], a["completion_mask"]
        cfg = self.config(hidden, {theirs: a[theirs] for theirs, _ in _OPTIONS})
        if cfg is None:
            return self.original(*args, **kwargs)
        import grpo_kernels as gk  # at call time, as above

        heads = self.heads((hidden, a["student_lm_head_weight"], a["student_lm_head_bias"]),
                           (a["teacher_hidden_states"], a["teacher_lm_head_weight"], a["teacher_lm_head_bias"]))
        loss, metrics = gk.fused_linear_distill_loss(**heads, mask=mask, num_items_in_batch=a["num_items_in_batch"],
                                                     config=cfg)
        return loss, metrics["entropy_sum"], (mask.reshape(-1) != 0).sum()


def trainer_series(series: str) -> bool:
    """Whether TRL ``series`` has a ``DistillationTrainer`` whose loss ``patch_trl`` serves (1.12-1.16)."""
    return series in (*CHUNK_SERIES, "1.15", "1.16")


def _kernel_module():
    """TRL's ``trl.kernels.chunked_divergence`` (1.15, 1.16), or None where it cannot be imported (1.15 without
    Triton; before 1.15 there is none)."""
    try:
        return importlib.import_module(KERNEL_MODULE)
    except ImportError:
        return None


def _original(owner, name: str):
    """What ``owner.name`` held before any patch_trl (already ours: the original it kept; patch_trl is
    idempotent)."""
    value = getattr(owner, name)
    return value.original if isinstance(value, _Served) else value


def targets(series: str, seam: DistillSeam) -> list:
    """(owner, attribute, replacement) of the distillation seam in TRL ``series``: TRL's ``_chunked_divergence_loss``
    and, where it exists, ``ChunkedDivergenceFunction`` where TRL looks it up. Empty when the trainer module does
    not import (an optional part of TRL: never a reason to refuse patching the other trainers)."""
    if not trainer_series(series):
        return []
    try:
        trainer = importlib.import_module(TRAINER_MODULE)
    except Exception as exc:  # e.g. an optional dependency of the trainer missing
        logger.debug("grpo_kernels.patch_trl: %s not patched (%s: %s)", TRAINER_MODULE, type(exc).__name__, exc)
        return []
    if not callable(getattr(trainer, LOSS, None)):
        return []
    found = [(trainer, LOSS, TRLDistillLoss(seam, _original(trainer, LOSS), series))]
    owner = trainer if hasattr(trainer, FUNCTION) else None if series in CHUNK_SERIES else _kernel_module()
    if owner is not None and hasattr(owner, FUNCTION):
        found.append((owner, FUNCTION, TRLDivergenceFunction(seam, _original(owner, FUNCTION))))
    return found


def routes(series: str, strict: bool, route: Callable) -> tuple:
    """The report's distillation rows for TRL ``series``, each ``route(calls, runs_on, why)``."""
    if not trainer_series(series):
        return ()
    refused = "strict: ValueError at the call" if strict else "warned once"
    rows = [(LOSS_ROW, "grpo_kernels",
             "fused_linear_distill_loss: gradient in the forward, 8 N H V; H_t != H_s, biases, scales, caps, sharded")]
    if series in ("1.15", "1.16"):
        where = "the trainer module's global" if series == "1.16" else "its module, where it imports: Triton"
        rows.append((FUNCTION_ROW, "grpo_kernels", f"linear_token_divergence, 12 N H V ({series}: {where})"))
    rows += [(REFUSED_ROW, "TRL",
              f"beta outside [0, 1], T <= 0, a scale not finite, a cap not > 0: {refused}; fp64 on a GPU: silent"),
             (SERVER_ROW, "TRL", "the teacher is a server's top-k log-probs: no second head")]
    if series == "1.12":  # the only series whose DistillationTrainer has a Liger path
        rows.append(("DistillationTrainer use_liger_kernel=True", "TRL", "Liger's LigerFusedLinearJSDLoss"))
    return tuple(route(*row) for row in rows)
