"""Route Hugging Face TRL's per-token log-prob / entropy computation through grpo_kernels' fused linear head.

Usage (before the trainer is built)::

    import grpo_kernels
    report = grpo_kernels.patch_trl()   # logs one info line; print(report) shows what runs where
    trainer = trl.GRPOTrainer(...)
    grpo_kernels.unpatch_trl()          # TRL exactly as it was

or scoped: ``with grpo_kernels.patch_trl() as report: ...`` unpatches on exit (unless it was already patched
before the ``with``). ``patch_trl(strict=True)`` raises where the default warns and falls back (below).

Versions: TRL 1.16, described here; TRL 1.15 has the same seam, and 1.12-1.14 have older ones
(``trl_versions.py``, which the version dispatch of ``_targets`` / ``_routes`` hands those series to).

Distillation: TRL's ``DistillationTrainer`` (1.12-1.16) runs on the two-head divergence through its own seam,
``_chunked_divergence_loss`` (and ``ChunkedDivergenceFunction`` where TRL looks it up): ``trl_distill.py``, whose
targets and report rows ``_targets`` / ``_routes`` add on every series.

The hook. TRL 1.16's trainers call ``model(..., labels=labels, fused_lm_head=True)`` after
``trl.trainer.utils.add_fused_lm_head``; that forward runs the backbone, selects the positions to score, handles
FSDP2 DTensors, ZeRO-3 gathering, ``cast_lm_head_to_fp32``, MoE aux losses and device maps, and then makes a single
call ``_ChunkedLogProbFunction.apply(hidden (N, H), weight (V, H), bias, targets (N,), temperature, chunk_size,
final_logit_softcapping, logit_scale, outputs)``, looked up as a global of ``trl.trainer.utils`` at call time.
``patch_trl`` replaces that one global with ``TRLLogProbFunction``, which calls
``grpo_kernels.linear_token_logprobs``. Everything around it, TRL's output object and TRL's whole loss, stays TRL's
own: this is the narrowest seam that removes the (N x V) work, and ``unpatch_trl`` restores it with one assignment.
The global is shared by every TRL trainer, and every ``outputs`` set TRL's function accepts is served:
``log_probs`` and ``entropy`` (differentiable), and the non-differentiable ``log_sum_sq_probs`` (log sum_v p_v^2, DPO's
WPO weights), ``mean_logits`` (the mean over V of the transformed logits, DPO's and KTO's ``logits/chosen`` and
``logits/rejected``) and ``is_top1`` (the target is the argmax, the first maximum winning ties: SFT's and DPO's
``mean_token_accuracy``), computed by ``linear_token_logprobs(..., extra_outputs=...)`` in the same sweep over V.
So GRPO's and RLOO's policies, SFTTrainer's, DPOTrainer's and KTOTrainer's policies, and every trainer's reference
model run on grpo_kernels; ``patch_trl`` also wraps each of those trainers' ``add_fused_lm_head`` for its setup-time
check (below).

Padding-free rows (TRL's ``AsyncGRPOTrainer``, ``trl.experimental.async_grpo``) take the same seam. Its
``compute_loss`` packs a rank's samples into one row, ``model(input_ids (1, N), position_ids (1, N), shift_labels
(1, N), fused_lm_head=True, tree_*=...)``: ``position_ids`` restart at 0 per sequence (they are the depth in TRL's
prefix trie, where the samples of a group share their prompt tokens), ``shift_labels`` holds the next token at each
trained position and -100 elsewhere, and the ``tree_*`` cu_seqlens / kv indices only steer attention. The fused
forward then scores ``shift_labels`` unshifted and makes the same single call, on (N, H) hidden rows of the whole
packed row (the scored positions only on CUDA, where TRL compacts): per-token maths, blind to where one sequence ends,
so it runs on grpo_kernels with no packing-specific path. ``patch_trl`` also wraps that module's own
``add_fused_lm_head`` (imported quietly, without TRL's experimental-API notice), so ``strict=True`` checks an
AsyncGRPO model at trainer setup as it does a GRPOTrainer's; the async trainer has no reference model.

The loss is not rerouted through ``fused_linear_grpo_loss``: TRL's ``_compute_loss`` interleaves the maths with
trainer state (gradient-accumulation normalizers, ``num_items_in_batch`` spanning the generation batch,
``tool_mask``, the adaptive entropy controller, MoE aux loss, metrics all-reduced across processes), so replacing
it would mean copying it. TRL's eager loss runs on our (B, T) log-probs, so the B x T x V passes are gone anyway.
Consequently every loss option of TRL (all loss types, importance_sampling_level, top_entropy_quantile,
mask_truncated_completions, off_policy_mask_threshold, vLLM importance-sampling correction, beta with a reference
model, num_iterations, gradient accumulation, entropy bonus) works unchanged.

Soft-capped heads (``final_logit_softcapping``: Gemma 2, a Gemma 3 config that sets it) run on grpo_kernels too:
TRL scores ``cap * tanh(logit_scale * x / cap) / temperature`` (scale, cap, temperature), which is exactly
``linear_token_logprobs(..., temperature=temperature / logit_scale, softcap=cap / logit_scale)``
(``grpo_kernels.integrations.transformers.fold_logit_scale``); the kernels apply the cap inside their sweeps.

Calls the fused path cannot express are served by TRL's own ``ChunkedLogProbFunction``, unchanged:
- a logit scale or a ``final_logit_softcapping`` that is not a finite number > 0: warned once;
- an output TRL computes and grpo_kernels does not (none in TRL 1.16; a later TRL might add one): silent;
- an empty batch of scored positions (TRL's compact path): silent, TRL's function keeps the graph connected;
- float64 on a GPU (the Triton kernels take fp32 / bf16 / fp16): silent.
Numbers: in fp32 the patched trainer matches TRL to float rounding (docs/api.md, "TRL"). Under bf16
autocast both cast hidden and head to bf16, but TRL also rounds every logits tile to bf16 while grpo_kernels keeps
the logits in fp32, so the two differ at bf16 precision, grpo_kernels being the closer to the exact value.
``patch_trl(strict=True)`` turns the warned fallbacks into ValueErrors, raised at trainer setup where TRL calls
``add_fused_lm_head`` on the policy and reference models (GRPO, RLOO, SFT, DPO, KTO, AsyncGRPO).

Sharded heads stay on our kernels:
- DeepSpeed ZeRO-3: TRL's forward gathers the partitioned ``lm_head`` around the call (``maybe_gather_lm_head_ctx``)
  and ZeRO-3 empties it again before the backward; ``TRLLogProbFunction`` passes the same context to
  ``linear_token_logprobs(..., gather_head=...)``, which re-enters it around the backward's recompute (as TRL's own
  kernel does). The call runs inside the model's forward, so ZeRO-3 reduces the head's gradient as usual.
- FSDP2: TRL turns a DTensor head into a plain tensor with ``weight.full_tensor()`` before the call, so our function
  sees a plain tensor. When ``lm_head`` is in the root ``fully_shard`` group (the usual layout) the head is already
  unsharded during the root's forward and FSDP2 averages its gradient. When ``lm_head`` is wrapped in its own
  ``fully_shard`` unit, ``full_tensor()``'s backward keeps only this rank's own gradient (no reduction across ranks),
  which is TRL's behaviour with or without this patch (docs/distributed.md, "TRL under FSDP2 and ZeRO-3").
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

import torch

from .. import _checks
from ..config import EXTRA_OUTPUTS
from .report import Route, backend, route_table
from . import trl_distill, trl_versions
from .transformers import zero3_enabled, cast_to, fold_logit_scale, fused_head_blocker, logit_scale_of

__all__ = ["SUPPORTED_TRL_VERSIONS", "patch_trl", "unpatch_trl", "is_trl_patched", "TRLLogProbFunction",
           "TRLPatchReport"]

logger = logging.getLogger("grpo_kernels")

# TRL release series (major.minor) patch_trl serves, each tested in its own environment: 1.16's fused-LM-head seam
# (this module; 1.15 has it too), the seams of 1.12-1.14 (trl_versions.py).
SUPPORTED_TRL_VERSIONS = ("1.12", "1.13", "1.14", "1.15", "1.16")

# Outputs of TRL's ChunkedLogProbFunction that grpo_kernels computes: all five of TRL 1.16 (log_probs always; TRL
# ignores a name it does not know, and so does TRLLogProbFunction; one TRL knows and this set does not, as a later
# TRL might add, falls back to TRL's kernel).
_ROUTED_OUTPUTS = frozenset({"log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1"})
# TRL's trainer modules whose ``add_fused_lm_head`` patch_trl wraps with its setup-time check (each imported it by
# name); the kernel swap serves every trainer whether its module is listed or not.
_TRAINER_MODULES = ("trl.trainer.grpo_trainer", "trl.trainer.rloo_trainer", "trl.trainer.sft_trainer",
                    "trl.trainer.dpo_trainer", "trl.trainer.kto_trainer")

# (module, attribute) -> original value, filled by patch_trl and emptied by unpatch_trl.
_ORIGINALS: dict = {}
_STATE = {"strict": False, "warned": set(), "batch_invariant": False, "round_logits": None,
          "invariant_block_rows": None}
# patch_trl's round_logits values: a dtype name (GRPOLossConfig.round_logits), or "autocast"
TRL_ROUNDINGS = (None, "bf16", "fp16", "autocast")
_AUTOCAST_ROUNDING = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def rounding_for(device_type: str, option: str | None) -> str | None:
    """The ``round_logits`` a call on ``device_type`` gets from patch_trl's option: "autocast" is the autocast
    dtype when torch autocast is enabled there at call time (bf16 / fp16, as TRL's head then rounds its logits to
    it), else None; any other value is itself."""
    if option != "autocast":
        return option
    if not torch.is_autocast_enabled(device_type):
        return None
    return _AUTOCAST_ROUNDING.get(torch.get_autocast_dtype(device_type))


def _trl_version() -> str:
    import trl

    return str(getattr(trl, "__version__", "unknown"))


def is_supported_trl_version(version: str) -> bool:
    """True when ``version`` (e.g. "1.16.0", "1.16.1.dev0") belongs to a series of ``SUPPORTED_TRL_VERSIONS``."""
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # pragma: no cover - packaging ships with pip / transformers
        return version.split(".")[:2] in [s.split(".") for s in SUPPORTED_TRL_VERSIONS]
    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return any(tuple(release[:2]) == tuple(int(x) for x in s.split(".")) for s in SUPPORTED_TRL_VERSIONS)


def _fallback(option: str, reason: str, using: str = "TRL's own ChunkedLogProbFunction") -> None:
    """Strict mode: raise naming the option. Otherwise warn once per reason that TRL's own kernel (``using``) is
    used."""
    if _STATE["strict"]:
        raise ValueError(f"grpo_kernels.patch_trl(strict=True): {option} is not supported by the fused linear "
                         f"head: {reason}")
    if reason not in _STATE["warned"]:
        _STATE["warned"].add(reason)
        warnings.warn(f"grpo_kernels: {option}: {reason}; using {using} for these calls",
                      UserWarning, stacklevel=3)


def _trl_kernel(hidden):
    """TRL's kernel for a call handed back (also when unpatched while a model still holds a reference: behave exactly
    like TRL), in TRL 1.16's call convention whatever the version; a stand-in where TRL 1.15 has none that runs here.
    Looked up only when a call is handed back: a served call, compiled too, imports nothing."""
    return trl_versions.trl_kernel(_ORIGINALS.get(("trl.trainer.utils", "_ChunkedLogProbFunction")), hidden)


class TRLLogProbFunction:
    """Drop-in for TRL 1.16's ``ChunkedLogProbFunction`` (only ``apply`` is used by TRL), backed by
    ``grpo_kernels.linear_token_logprobs``.

    ``apply(hidden (N, H), weight (V, H), bias (V,) | None, targets (N,) int64, temperature, chunk_size,
    final_logit_softcapping=None, logit_scale=1.0, outputs=(...))`` returns TRL's 5-tuple in TRL's order
    ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, each (N,) and None unless ``outputs`` names it
    (log_probs always): fp32 (float64 for float64 inputs on CPU), is_top1 bool; of
    ``z = cap * tanh(logit_scale * (hidden @ weight.T + bias) / cap) / temperature`` (no cap when None). Only
    log_probs and entropy are differentiable, as in TRL. ``chunk_size`` (TRL's vocabulary tile) is ignored:
    grpo_kernels' planner chooses its own chunking.
    """

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")):
        args = (hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping, logit_scale,
                outputs)
        # Silent fallbacks first: an output of TRL's that grpo_kernels does not compute (none in TRL 1.16), TRL's
        # empty compact batch, and fp64 on a GPU (the Triton kernels take fp32/bf16/fp16; TRL's tiles take fp64).
        if not set(outputs) & _trl_outputs() <= _ROUTED_OUTPUTS or hidden.shape[0] == 0 or \
                (hidden.dtype == torch.float64 and hidden.device.type != "cpu"):
            return _trl_kernel(hidden).apply(*args)
        blocker = fused_head_blocker(final_logit_softcapping, logit_scale)
        if blocker is not None:
            _fallback(*blocker)
            return _trl_kernel(hidden).apply(*args)

        import grpo_kernels as gk  # at call time: grpo_kernels/__init__.py may import this package

        want_entropy = "entropy" in outputs
        extras = tuple(name for name in EXTRA_OUTPUTS if name in outputs)  # TRL ignores any other name
        # TRL multiplies in hidden's dtype outside autocast (fp32 under cast_lm_head_to_fp32, where TRL has already
        # upcast hidden and disabled autocast), casting the head to it; under autocast linear_token_logprobs runs
        # the head in the autocast dtype, as TRL's cuBLAS tiles do.
        head_params = (weight, bias)
        hidden, weight, bias = cast_to(hidden.dtype, hidden, weight, bias)
        # cap * tanh(s * x / cap) / T == (cap / s) * tanh(x / (cap / s)) / (T / s) for any scale s > 0.
        kernel_temperature, kernel_softcap = fold_logit_scale(temperature, logit_scale, final_logit_softcapping)
        out = gk.linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=kernel_temperature,
                                       batch_invariant=_STATE["batch_invariant"],
                                       invariant_block_rows=_STATE["invariant_block_rows"],
                                       round_logits=rounding_for(hidden.device.type, _STATE["round_logits"]),
                                       softcap=kernel_softcap, return_entropy=want_entropy,
                                       gather_head=_zero3_gather(*head_params), extra_outputs=extras)
        if extras:
            return out.logp, out.entropy, out.log_sum_sq_probs, out.mean_logits, out.is_top1
        logp, entropy = out if want_entropy else (out, None)
        return logp, entropy, None, None, None


def _trl_outputs() -> frozenset:
    """The output names TRL's ChunkedLogProbFunction computes (``log_probs`` and its ``OPTIONAL_OUTPUTS``)."""
    try:
        from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS
    except ImportError:  # TRL < 1.15 (no such module), or 1.15 without Triton (imported at its top): ours are all
        return _ROUTED_OUTPUTS

    return frozenset(("log_probs", *OPTIONAL_OUTPUTS))


def _zero3_gather(weight, bias):
    """Under ZeRO-3, TRL's own gather of the head parameters as a ``gather_head`` callable (entered again in the
    backward, where ZeRO-3 has emptied the partition); None otherwise. TRL's context is a no-op for parameters that
    are already gathered (the forward's call, a tied embedding)."""
    if not zero3_enabled():
        return None
    import trl.trainer.utils as trl_utils  # looked up at call time, like TRL's own kernel does

    return lambda: trl_utils.maybe_gather_lm_head_ctx(weight, bias)


def _distill_options(device_type: str, trl_rounds_logits: bool) -> dict:
    """The ``DistillLossConfig`` options patch_trl sets for a distillation call on ``device_type``: batch_invariant
    and invariant_block_rows as given, and round_logits, its "autocast" resolved as TRL's own distillation head
    rounds (1.12-1.14's PyTorch chunks round their logits to the autocast dtype, 1.15 / 1.16's
    ChunkedDivergenceFunction keeps fp32 logits tiles)."""
    option = _STATE["round_logits"]
    rounding = None if option == "autocast" and not trl_rounds_logits else rounding_for(device_type, option)
    return {"batch_invariant": _STATE["batch_invariant"], "invariant_block_rows": _STATE["invariant_block_rows"],
            "round_logits": rounding}


# What the distillation replacements borrow from this module (trl_distill.py).
_DISTILL_SEAM = trl_distill.DistillSeam(fallback=_fallback, options=_distill_options, gather=_zero3_gather)


def _checked_add_fused_lm_head(trainer_module: str):
    """TRL's ``add_fused_lm_head`` as ``trainer_module`` imported it, preceded by a setup-time check of what the
    fused path cannot serve (a logit scale or soft cap that is not a finite number > 0; a valid soft cap runs on
    grpo_kernels).

    Non-strict: warns (once) and the affected calls run TRL's kernel. Strict: raises a ValueError naming the option.
    """
    def checked_add_fused_lm_head(model, *args, **kwargs):
        original = _ORIGINALS[(trainer_module, "add_fused_lm_head")]
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        blocker = fused_head_blocker(getattr(config, "final_logit_softcapping", None), logit_scale_of(config))
        if blocker is not None:
            _fallback(*blocker)
        return original(model, *args, **kwargs)

    return checked_add_fused_lm_head


# TRL's padding-free trainer (one packed row per rank, shift_labels): experimental in TRL 1.16, so optional here.
_ASYNC_GRPO = "trl.experimental.async_grpo.async_grpo_trainer"


def _async_grpo_module():
    """TRL's AsyncGRPO trainer module, imported without TRL's experimental-API notice (the user did not import it;
    importing it later shows nothing either, as the package is then loaded); None when it cannot be imported (its
    ``add_fused_lm_head`` then stays TRL's, and the kernel swap still serves its calls)."""
    import importlib
    import sys

    if _ASYNC_GRPO in sys.modules:
        return sys.modules[_ASYNC_GRPO]
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"You are importing from 'trl\.experimental'")
        try:
            return importlib.import_module(_ASYNC_GRPO)
        except Exception as exc:  # an optional TRL module: never a reason to refuse patching GRPOTrainer
            logger.debug("grpo_kernels.patch_trl: %s not patched (%s: %s)", _ASYNC_GRPO, type(exc).__name__, exc)
            return None


def _targets():
    """(owner, attribute, replacement) for every name patch_trl swaps; raises if the seam is not there."""
    import importlib

    series = trl_versions.series_of(_trl_version())
    if series in trl_versions.LEGACY_SERIES:
        return trl_versions.legacy_targets(series, trl_versions.Seam(TRLLogProbFunction.apply, _fallback)) + \
            trl_distill.targets(series, _DISTILL_SEAM)

    utils = importlib.import_module("trl.trainer.utils")
    trainers = [importlib.import_module(name) for name in _TRAINER_MODULES]
    for module, name in ((utils, "_ChunkedLogProbFunction"), *((t, "add_fused_lm_head") for t in trainers)):
        if not hasattr(module, name):
            raise RuntimeError(f"{module.__name__}.{name} not found: this TRL does not have the fused-LM-head seam "
                               f"grpo_kernels patches (supported TRL series: {', '.join(SUPPORTED_TRL_VERSIONS)})")
    targets = [(utils, "_ChunkedLogProbFunction", TRLLogProbFunction)]
    targets += [(t, "add_fused_lm_head", _checked_add_fused_lm_head(t.__name__)) for t in trainers]
    async_grpo = _async_grpo_module()
    if async_grpo is not None and hasattr(async_grpo, "add_fused_lm_head"):
        targets.append((async_grpo, "add_fused_lm_head", _checked_add_fused_lm_head(async_grpo.__name__)))
    return targets + trl_distill.targets(series, _DISTILL_SEAM)


@dataclasses.dataclass(frozen=True)
class TRLPatchReport:
    """What ``patch_trl`` did: the TRL version, the names it swapped, and which calls use grpo_kernels and which
    fall back to TRL's own kernel (and why). ``print(report)`` shows it as a short table.

    Also a context manager: ``with grpo_kernels.patch_trl() as report:`` unpatches TRL on exit, unless it was
    already patched before this call (``newly_patched`` False), so nested uses keep the outer patch.
    """

    trl_version: str
    strict: bool
    patched: tuple[str, ...]
    routes: tuple[Route, ...]
    newly_patched: bool
    batch_invariant: bool = False
    round_logits: str | None = None
    invariant_block_rows: int | None = None

    @property
    def kernel_calls(self) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.runs_on == "grpo_kernels")

    @property
    def fallbacks(self) -> tuple[Route, ...]:
        return tuple(r for r in self.routes if r.runs_on != "grpo_kernels")

    def __str__(self) -> str:
        head = (f"grpo_kernels.patch_trl: TRL {self.trl_version} "
                f"{'patched' if self.newly_patched else 'already patched'} (strict={self.strict}"
                + (", batch_invariant=True" if self.batch_invariant else "")
                + (f", invariant_block_rows={self.invariant_block_rows}" if self.invariant_block_rows else "")
                + (f", round_logits={self.round_logits!r}" if self.round_logits is not None else "") + "); swapped: "
                + ", ".join(self.patched))
        return route_table(head, self.routes)

    def __enter__(self) -> "TRLPatchReport":
        return self

    def __exit__(self, *exc) -> None:
        if self.newly_patched:
            unpatch_trl()


def _routes(strict: bool) -> tuple[Route, ...]:
    series = trl_versions.series_of(_trl_version())
    distill = trl_distill.routes(series, strict, Route)
    if series != "1.16":
        return trl_versions.routes_for(series, strict, backend(), _routes_116(strict), Route) + distill
    return _routes_116(strict) + distill


def _routes_116(strict: bool) -> tuple[Route, ...]:
    refused = "strict: ValueError at trainer setup" if strict else "warned once"
    return (
        Route("GRPO/RLOO policy log-probs + entropy", "grpo_kernels", backend()),
        Route("SFT/DPO/KTO policy + extra outputs", "grpo_kernels",
              "is_top1, mean_logits, log_sum_sq_probs: same sweep over V, no gradient"),
        Route("reference model log-probs (DPO, KTO, GRPO beta > 0)", "grpo_kernels", "same fused head, no gradient"),
        Route("ZeRO-3 / FSDP2 sharded lm_head", "grpo_kernels", "TRL gathers the head around the call"),
        Route("final_logit_softcapping (Gemma 2/3)", "grpo_kernels", "cap applied in the kernels; scale folded"),
        Route("padding-free packed row (AsyncGRPO)", "grpo_kernels", "shift_labels row: one (N, H) call, per token"),
        Route("logit scale / soft cap not finite > 0", "TRL", f"no such head to fold; {refused}"),
        Route("float64 on a GPU", "TRL", "the Triton kernels take fp32/bf16/fp16; silent"),
        Route("an empty batch of scored positions", "TRL", "TRL's kernel keeps the graph connected; silent"),
    )


def patch_trl(strict: bool = False, batch_invariant: bool = False, round_logits: str | None = None,
              invariant_block_rows: int | None = None) -> TRLPatchReport:
    """Route TRL's fused-LM-head log-probs and entropies through ``grpo_kernels.linear_token_logprobs``, and its
    DistillationTrainer's loss through ``grpo_kernels.fused_linear_distill_loss`` (``trl_distill.py``).

    Call it before building the trainer (the kernel swap also reaches trainers built earlier, the setup-time checks
    do not). Idempotent; ``unpatch_trl()`` restores TRL exactly, as does leaving ``with patch_trl():``.
    strict: raise a ValueError naming the option (a logit scale or a ``final_logit_softcapping`` that is not a
        finite number > 0) instead of warning and running TRL's own kernel for those calls (for the distillation
        calls: an option ``DistillLossConfig`` refuses, raised at the call).
    batch_invariant: every call TRL makes through the seam is batch-invariant (``linear_token_logprobs(...,
        batch_invariant=True)``: a sequence's log-probs, entropies, extra outputs and d hidden are bitwise the same in
        any batch, docs/numerics.md "Batch invariance"; the distillation calls' ``DistillLossConfig`` too).
    round_logits: None (default: fp32 logits), "bf16" / "fp16" (every call rounds the raw logits to that dtype
        before the soft cap / temperature, ``linear_token_logprobs(..., round_logits=)``), or "autocast": round to
        the autocast dtype when torch autocast is enabled at call time (a trainer with ``bf16=True``), else not, so
        the log-probs are those of TRL's own head, which computes its logits in the autocast dtype (docs/numerics.md
        "Rounding the logits"). The distillation calls take it too (both models' logits), "autocast" rounding where
        TRL's own distillation head does (1.12-1.14; 1.15 / 1.16 keep fp32 logits tiles).
    invariant_block_rows: None (the device's block) or the rows per block of ``batch_invariant=True`` on every
        log-prob call and every distillation call (``GRPOLossConfig.invariant_block_rows``,
        ``DistillLossConfig.invariant_block_rows``: another block is another bit pattern); refused without
        batch_invariant.
    Returns a ``TRLPatchReport`` (printable table of what was patched and what runs where) and logs one INFO line
    on the ``grpo_kernels`` logger.
    Raises RuntimeError, changing nothing, when the installed TRL is not in ``SUPPORTED_TRL_VERSIONS``.
    """
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be a bool, got {strict!r}")
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool, got {batch_invariant!r}")
    if round_logits not in TRL_ROUNDINGS:
        raise ValueError(f"round_logits must be one of {TRL_ROUNDINGS}, got {round_logits!r}")
    _checks.invariant_block_rows(invariant_block_rows, batch_invariant)
    try:
        version = _trl_version()
    except ImportError as exc:
        raise ImportError("grpo_kernels.patch_trl needs TRL: pip install 'trl>=1.12,<1.17'") from exc
    if not is_supported_trl_version(version):
        raise RuntimeError(f"grpo_kernels.patch_trl supports TRL {', '.join(s + '.x' for s in SUPPORTED_TRL_VERSIONS)}"
                           f", found TRL {version}; nothing was patched")
    targets = _targets()  # resolve everything before changing anything
    _STATE["strict"], _STATE["batch_invariant"], _STATE["round_logits"] = strict, batch_invariant, round_logits
    _STATE["invariant_block_rows"] = invariant_block_rows
    newly = not _ORIGINALS
    if newly:
        for module, name, replacement in targets:
            _ORIGINALS[(trl_versions.dotted_name(module), name)] = getattr(module, name)
            setattr(module, name, replacement)
    report = TRLPatchReport(trl_version=version, strict=strict,
                            patched=tuple(f"{trl_versions.dotted_name(module)}.{name}" for module, name, _ in targets),
                            routes=_routes(strict), newly_patched=newly, batch_invariant=batch_invariant,
                            round_logits=round_logits, invariant_block_rows=invariant_block_rows)
    fallbacks = "; ".join(r.calls.strip() for r in report.fallbacks)
    on_ours = "; ".join(r.calls.strip() for r in report.kernel_calls)
    logger.info("grpo_kernels.patch_trl: TRL %s %s (strict=%s, batch_invariant=%s): on grpo_kernels: %s [%s]; "
                "TRL's own for: %s", version, "patched" if newly else "already patched", strict, batch_invariant,
                on_ours, backend(), fallbacks)
    return report


def unpatch_trl() -> None:
    """Undo ``patch_trl``: every swapped attribute gets back the exact object TRL had. No-op when not patched."""
    for (module_name, name), original in list(_ORIGINALS.items()):
        setattr(trl_versions.owner_of(module_name), name, original)
    _ORIGINALS.clear()
    _STATE["strict"] = _STATE["batch_invariant"] = False
    _STATE["round_logits"] = _STATE["invariant_block_rows"] = None
    _STATE["warned"].clear()


def is_trl_patched() -> bool:
    """Whether ``patch_trl`` is in effect."""
    return bool(_ORIGINALS)
