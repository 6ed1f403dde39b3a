"""The TRL series before 1.16 that ``patch_trl()`` serves, and where each one's seam is (``integrations/trl.py``
dispatches here by version; its TRL 1.16 docstring explains the seam those versions share).

TRL 1.15 has 1.16's seam: ``trl.trainer.utils._ChunkedLogProbFunction``, called with ``outputs=`` from the forward
that ``add_fused_lm_head`` installs, in the GRPO, RLOO, SFT, DPO, KTO and AsyncGRPO trainers. So ``patch_trl`` swaps
the same names. What differs: TRL 1.15's ``trl/kernels/chunked_logprob.py`` imports Triton at its top and has only
Triton kernels (no PyTorch tiles, unlike 1.16). Without Triton (macOS, Windows, a CPU-only torch) importing it fails,
``trl.trainer.utils`` catches that and sets ``_ChunkedLogProbFunction = None``, and every fused forward then fails
(``'NoneType' object has no attribute 'apply'``); with Triton but CPU tensors, Triton finds no GPU driver at the
first launch. Either way stock TRL 1.15 cannot train on a CPU; patched, it does, since the global is replaced and
grpo_kernels runs on CPU. The calls ``patch_trl`` otherwise hands back to TRL's kernel then have none to go to
(``trl_kernel``): an empty batch of scored positions is served here (zeros connected to the graph, as TRL's kernel
returns), and a logit scale or soft cap that is not a finite number > 0 raises a RuntimeError naming the cause.

TRL 1.12-1.14 have no fused forward: ``GRPOTrainer._get_per_token_logps_and_entropies`` (RLOO alike) calls the model,
which writes the completion logits (``logits_to_keep + 1`` positions x V), then ``selective_log_softmax`` and
``entropy_from_logits`` (``selective_log_softmax_and_entropy`` in 1.14) read them. ``patch_trl`` replaces that method
on both classes (``trl_logps.py``: the backbone's hidden states and our head, TRL's three-tuple kept, the calls it
cannot serve handed back to TRL's method with a one-time warning) and swaps TRL's older fused function,
``_ChunkedLogProbFunction(hidden, W, b, labels, T, chunk, softcap, scale) -> (log_probs, entropy)``: in
``trl.trainer.utils`` (AsyncGRPO's ``patch_chunked_lm_head`` looks it up there at call time) and, in 1.14, in the
GRPO, DPO and KTO trainer modules, which import it by name and call it under ``use_liger_kernel=True``
(``LegacyChunkedLogProbFunction``, backed by the same ``TRLLogProbFunction``). SFT, and DPO / KTO before 1.14, have no
such seam (they read the model's logits, or Liger's losses under ``use_liger_kernel``) and stay TRL's.
"""
from __future__ import annotations

import dataclasses
import importlib
import inspect
import sys
from typing import Callable

import torch

from .trl_logps import PerTokenLogpsMethod

__all__ = ["LEGACY_SERIES", "Seam", "series_of", "legacy_targets", "routes_for", "trl_kernel",
           "LegacyChunkedLogProbFunction", "dotted_name", "owner_of"]

# TRL series served through the pre-1.15 seams (trl_logps.py); 1.15 shares 1.16's.
LEGACY_SERIES = ("1.12", "1.13", "1.14")
# Series whose trainer modules import ``_ChunkedLogProbFunction`` by name (called under use_liger_kernel=True).
_NAMED_FUNCTION_MODULES = {"1.14": ("trl.trainer.grpo_trainer", "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer")}
_METHOD_OWNERS = (("trl.trainer.grpo_trainer", "GRPOTrainer"), ("trl.trainer.rloo_trainer", "RLOOTrainer"))


@dataclasses.dataclass(frozen=True)
class Seam:
    """What ``integrations/trl.py`` lends the replacements built here (passed in, so this module never imports it).

    head: ``TRLLogProbFunction.apply`` (TRL 1.16's nine arguments, its five-tuple), the one call into our kernels.
    fallback: ``(option, reason, using)``: warns once per reason that ``using`` serves those calls, or raises a
        ValueError under ``patch_trl(strict=True)``.
    """

    head: Callable
    fallback: Callable


def series_of(version: str) -> str:
    """"1.14" for "1.14.2" or "1.14.0.dev0"; the version itself when it has no major.minor."""
    parts = version.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 else version


class LegacyChunkedLogProbFunction:
    """Drop-in for TRL 1.12-1.14's ``_ChunkedLogProbFunction`` (TRL calls only ``apply``):
    ``apply(hidden (N, H), weight (V, H), [bias,] targets (N,), temperature, chunk_size, final_logit_softcapping=None,
    logit_scale=1.0) -> (log_probs (N,), entropy (N,))``, fp32 and both differentiable, as TRL's; ``bias`` only where
    TRL's takes it (1.13, 1.14; ``takes_bias``). Served by the TRL 1.16 drop-in (``Seam.head``) with
    ``outputs=("log_probs", "entropy")``, so its fallbacks (to this TRL's own function, through ``trl_kernel``),
    ZeRO-3 gathering and options are the same."""

    def __init__(self, head: Callable, takes_bias: bool):
        self._head, self.takes_bias = head, takes_bias

    def apply(self, hidden, weight, *args):
        bias, args = (args[0], args[1:]) if self.takes_bias else (None, args)
        targets, temperature, chunk_size, final_logit_softcapping, logit_scale = _with_defaults(*args)
        logp, entropy, *_ = self._head(hidden, weight, bias, targets, temperature, chunk_size,
                                       final_logit_softcapping, logit_scale, ("log_probs", "entropy"))
        return logp, entropy


def _with_defaults(targets, temperature, chunk_size, final_logit_softcapping=None, logit_scale=1.0):
    return targets, temperature, chunk_size, final_logit_softcapping, logit_scale


def _takes_bias(kernel) -> bool:
    """TRL 1.12's chunked function has no ``bias`` argument; 1.13's and 1.14's have it after ``weight``."""
    if isinstance(kernel, LegacyChunkedLogProbFunction):  # already patched (patch_trl is idempotent)
        return kernel.takes_bias
    return "bias" in inspect.signature(kernel.forward).parameters


def legacy_targets(series: str, seam: Seam) -> list:
    """(owner, attribute, replacement) for every name ``patch_trl`` swaps in TRL ``series`` (1.12-1.14): module
    globals and two trainer classes' methods. Raises RuntimeError when one is missing, changing nothing."""
    utils = importlib.import_module("trl.trainer.utils")
    if getattr(utils, "_ChunkedLogProbFunction", None) is None:
        raise RuntimeError(f"trl.trainer.utils._ChunkedLogProbFunction not found: not the TRL {series} layout "
                           "grpo_kernels patches")
    function = LegacyChunkedLogProbFunction(seam.head, _takes_bias(utils._ChunkedLogProbFunction))
    modules = ("trl.trainer.utils", *_NAMED_FUNCTION_MODULES.get(series, ()))
    owners = [(importlib.import_module(name), "_ChunkedLogProbFunction") for name in modules]
    owners += [(getattr(importlib.import_module(module), cls), PerTokenLogpsMethod.NAME)
               for module, cls in _METHOD_OWNERS]
    for owner, name in owners:
        if not hasattr(owner, name):
            raise RuntimeError(f"{dotted_name(owner)}.{name} not found: not the TRL {series} layout grpo_kernels "
                               "patches")
    return [(owner, name, function if inspect.ismodule(owner) else PerTokenLogpsMethod(owner, series, seam).bound())
            for owner, name in owners]


def dotted_name(owner) -> str:
    """A module's name, or a class's ``module.QualName``: the key under which a swapped attribute's owner is found
    again (``owner_of``)."""
    return owner.__name__ if inspect.ismodule(owner) else f"{owner.__module__}.{owner.__qualname__}"


def owner_of(name: str):
    """The module or class ``dotted_name`` named."""
    if name in sys.modules:
        return sys.modules[name]
    module, _, attribute = name.rpartition(".")
    return getattr(sys.modules[module], attribute)


def routes_for(series: str, strict: bool, backend: str, routes_116: tuple, route: Callable) -> tuple:
    """The report's rows for ``series``, each ``route(calls, runs_on, why)``; ``routes_116`` are TRL 1.16's rows,
    which 1.15 keeps, its fallback rows said as they are on this machine."""
    if series == "1.15":
        return _routes_115(routes_116, route)
    handed_back = "TRL's own method (full logits); " + ("strict: ValueError at the call" if strict else "warned once")
    named = series in _NAMED_FUNCTION_MODULES
    rows = [("GRPO/RLOO per-token log-probs + entropy (policy, old, ref)", "grpo_kernels",
             f"_get_per_token_logps_and_entropies: backbone -> fused head; {backend}")]
    if named:
        rows.append(("  GRPO use_liger_kernel=True (ZeRO-3, FSDP too)", "grpo_kernels",
                     "TRL's chunked path, its _ChunkedLogProbFunction swapped"))
    rows += [
        ("  vision inputs, compute_aux_loss (MoE), FSDP, ZeRO-3", "TRL", handed_back),
        ("  lm_head not foldable / PEFT on lm_head / no backbone", "TRL", handed_back),
        ("AsyncGRPO packed rows (patch_chunked_lm_head)", "grpo_kernels", "trl.trainer.utils._ChunkedLogProbFunction"),
    ]
    if named:
        rows += [("DPO/KTO use_liger_kernel=True (policy + reference)", "grpo_kernels",
                  "_ChunkedLogProbFunction swapped in their modules"),
                 ("DPO/KTO without use_liger_kernel, SFT", "TRL", "they read the model's logits: no seam")]
    else:
        rows += [("GRPO use_liger_kernel=True: the loss", "TRL", "Liger's / TRL's fused GRPO loss (no logits)"),
                 ("DPO/KTO/SFT", "TRL", "they read the model's logits, or Liger's losses: no seam")]
    return tuple(route(*row) for row in rows)


def _routes_115(routes_116: tuple, route: Callable) -> tuple:
    if _trl_kernel_runs_here():
        return routes_116
    kept = [r for r in routes_116 if r.runs_on == "grpo_kernels"]
    return (*kept,
            route("an empty batch of scored positions", "grpo_kernels",
                  "zeros connected to the graph (TRL 1.15's kernel needs Triton on a GPU)"),
            route("logit scale / soft cap not finite > 0", "-",
                  "RuntimeError at the call: no TRL 1.15 kernel runs here (Triton on a GPU only)"))


def _trl_kernel_runs_here() -> bool:
    """Whether TRL 1.15's Triton-only kernel can run on this machine's tensors: Triton and a CUDA device, or Triton's
    interpreter (TRITON_INTERPRET=1 before TRL's kernels were defined, as the tests set it)."""
    try:
        module = importlib.import_module("trl.kernels.chunked_logprob")  # imports Triton at its top
    except ImportError:
        return False
    return torch.cuda.is_available() or _interpreted(module)


def _interpreted(module) -> bool:
    return type(getattr(module, "_forward_kernel", None)).__name__ == "InterpretedFunction"


def trl_kernel(saved, hidden: torch.Tensor):
    """TRL's own fused-head function for the calls ``TRLLogProbFunction`` hands back, called with TRL 1.16's nine
    arguments and returning its five-tuple: ``saved`` (what ``patch_trl`` swapped out; None when not patched, then
    the one ``trl.trainer.utils`` holds now), adapted to TRL 1.12-1.14's eight arguments and pair, or, where TRL 1.15
    has no kernel that runs on ``hidden`` (no Triton; CPU tensors without Triton's interpreter), ``_NoTRLKernel``."""
    kernel = saved if saved is not None else getattr(importlib.import_module("trl.trainer.utils"),
                                                     "_ChunkedLogProbFunction", None)
    if kernel is None or not hasattr(kernel, "forward"):  # TRL had None (1.15 without Triton), now ours
        return _NoTRLKernel
    if "outputs" not in inspect.signature(kernel.forward).parameters:
        return _PairKernel(kernel)
    module = sys.modules.get(kernel.__module__)
    if not hasattr(module, "_use_triton") and hidden.device.type not in ("cuda", "xpu") and not _interpreted(module):
        return _NoTRLKernel  # TRL 1.15: Triton tiles only
    return kernel


@dataclasses.dataclass(frozen=True)
class _PairKernel:
    """TRL 1.12-1.14's ``_ChunkedLogProbFunction`` behind TRL 1.16's call: no ``outputs`` (nor, in 1.12, ``bias``),
    ``(log_probs, entropy)``."""

    kernel: object

    def apply(self, hidden, weight, bias, *args):
        args = args[:5]  # targets, temperature, chunk_size, final_logit_softcapping, logit_scale
        if _takes_bias(self.kernel):
            logp, entropy = self.kernel.apply(hidden, weight, bias, *args)
        elif bias is None:
            logp, entropy = self.kernel.apply(hidden, weight, *args)
        else:
            raise RuntimeError("grpo_kernels.patch_trl: this call cannot run on grpo_kernels, and TRL 1.12's own "
                               "_ChunkedLogProbFunction has no lm_head bias argument")
        return logp, entropy, None, None, None


class _NoTRLKernel:
    """Where TRL 1.15 has no kernel to hand a call back to: an empty batch gets TRL's answer (empty outputs whose
    gradient is zero for hidden, weight and bias), anything else a RuntimeError naming the cause."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        if hidden.shape[0] != 0:
            raise RuntimeError(
                f"grpo_kernels.patch_trl: this call (logit_scale={logit_scale!r}, final_logit_softcapping="
                f"{final_logit_softcapping!r}, {hidden.dtype} on {hidden.device.type}) cannot run on grpo_kernels, "
                "and TRL 1.15's own ChunkedLogProbFunction needs Triton on a CUDA or XPU device (it has no PyTorch "
                "fallback; TRL 1.16 does)")
        zero = 0 * (weight.sum() + (0 if bias is None else bias.sum()))
        empty = hidden.float().sum(-1) + zero.float()
        entropy = empty.clone() if "entropy" in outputs else None
        extras = [torch.zeros(0, device=hidden.device) if name in outputs else None
                  for name in ("log_sum_sq_probs", "mean_logits")]
        is_top1 = torch.zeros(0, dtype=torch.bool, device=hidden.device) if "is_top1" in outputs else None
        return empty, entropy, *extras, is_top1
