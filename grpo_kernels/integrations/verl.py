"""Run verl's fused-kernel path (``use_fused_kernels=True``) on grpo_kernels' fused linear head.

Usage: verl loads ``grpo_kernels.verl`` by name in each worker (``actor_rollout_ref.model.external_lib=
grpo_kernels.verl``: ``HFModelConfig.__post_init__`` imports it before the model is built); importing that module
calls ``patch_verl()``. By hand::

    report = grpo_kernels.integrations.patch_verl()   # logs one info line; print(report) shows what runs where
    ...
    grpo_kernels.integrations.unpatch_verl()          # verl exactly as it was

The seam. verl 0.9's fused forwards compute per-token log-probs and entropies with one call,
``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy(hidden, weight, labels, temperature, "none",
dist_process_group)``: the Hugging Face forwards of its FSDP engine with ``fused_kernel_options.impl_backend=triton``
(``verl.models.transformers.dense_common.forward_with_triton_backend`` and the Qwen2-VL, Qwen3-VL, Qwen3.5 and
GLM-4V ones) import it from that module at call time; Megatron's fused forward (``verl.models.mcore.
model_forward_fused``, both its output-processor hook and its legacy ``GPTModel.forward``) and the 1F1B-overlap
forward (``model_forward_1f1b_overlap``) bound the name when they were imported, passing the tensor-parallel group.
``patch_verl`` replaces the attribute of the defining module and that name in every loaded ``verl.*`` module that
holds verl's function; a module imported later binds ours from the defining module. ``unpatch_verl`` gives every
``verl.*`` module holding ours verl's function back. verl's engines, losses and model forwards are not touched.

``linear_cross_entropy`` below keeps verl's signature and results: hidden (..., H) (verl's packed (1, N, H),
Megatron's (N, 1, H), or (N, H)) flattened to rows, labels flattened alike; log-probs (N,) float32 for
``reduction="none"`` (their sum / mean, a 0-dim tensor, for "sum" / "mean", as verl's kernel; case-insensitive as
verl's ``reduction.lower()``), entropy (N,) float32; gradients to hidden and weight through both outputs; under
``torch.no_grad()`` (verl's old / reference log-probs) the one-sweep no-grad path. With a ``dist_process_group`` of
more than one rank (Megatron's tensor-parallel group) ``weight`` is this rank's contiguous vocabulary shard (rank r
holds ids r * V_r ...), labels are full-vocabulary ids, every rank returns the whole vocabulary's log-probs and
entropy, and d hidden is this rank's partial gradient, not all-reduced, as verl's kernel returns it (Megatron's
sequence-parallel gather reduce-scatters it in its backward): ``linear_token_logprobs(..., process_group=group,
hidden_grad="partial")``.

Not served here, and why (docs/verl.md):
- ``fused_kernel_options.impl_backend=torch`` (verl's default) or ``liger`` on the FSDP engine run verl's
  ``FusedLinearForPPO`` / Liger, not this seam: set ``impl_backend=triton`` to run on grpo_kernels;
- Σπ² (``calculate_sum_pi_squared``, the optimal-token baseline): verl's engines raise NotImplementedError for it
  with fused kernels before any forward, and the seam returns two outputs; serving it needs a third output from
  this function and changes in verl's engines and model forwards.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import sys

import torch

from .report import Route, backend, route_table

__all__ = ["SUPPORTED_VERL_VERSIONS", "REDUCTIONS", "linear_cross_entropy", "patch_verl", "unpatch_verl",
           "is_verl_patched", "VerlPatchReport"]

logger = logging.getLogger("grpo_kernels")

# verl release series (major.minor) whose fused-kernel seam this module was written against and tested with.
SUPPORTED_VERL_VERSIONS = ("0.9",)
# verl's kernel module and the name its fused forwards call.
SEAM_MODULE = "verl.utils.kernel.linear_cross_entropy"
SEAM_NAME = "linear_cross_entropy"
# The reductions verl's kernel accepts (verl.utils.kernel.kernels.get_entropy_reduction_enum_number).
REDUCTIONS = ("none", "sum", "mean")

# verl's own function while patched (None when not patched) and the modules whose name was swapped.
_STATE: dict = {"original": None, "swapped": (), "batch_invariant": False}
# Set to 1 in verl's workers' environment to make the patched seam batch-invariant (``grpo_kernels.verl`` patches at
# import, so an environment variable is how a verl config reaches it; ``patch_verl(batch_invariant=True)`` in code).
BATCH_INVARIANT_ENV = "GRPO_KERNELS_BATCH_INVARIANT"


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                         reduction: str = "none", dist_process_group=None):
    """verl's ``linear_cross_entropy`` on ``grpo_kernels.linear_token_logprobs``: per-token log-probs and entropies of
    ``softmax(hidden @ weight.T / temperature)``.

    hidden: (..., H) float32 / bfloat16 / float16, rows flattened ((1, N, H), (N, 1, H) and (N, H) alike); weight:
    (V, H) in hidden's dtype (or this rank's vocabulary shard (V_r, H) with ``dist_process_group``); labels: integer
    ids, N of them in any shape, in [0, V) (the full vocabulary with a group); temperature: a number > 0; reduction:
    "none", "sum" or "mean" (any case). Returns (log_probs, entropy): log_probs (N,) float32, or its sum / mean as a
    0-dim tensor; entropy (N,) float32 (float64 for float64 inputs). Differentiable w.r.t. hidden and weight through
    both. dist_process_group: None, or a tensor-parallel group: each rank's d hidden is its shard's part (the caller
    sums it over the group), its d weight its shard's gradient.
    """
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ValueError(f"temperature must be a float (verl's fused kernels take one temperature), got "
                         f"{type(temperature).__name__}")
    if not isinstance(reduction, str) or reduction.lower() not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS} (any case), got {reduction!r}")
    for name, value in (("hidden", hidden), ("weight", weight), ("labels", labels)):
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have shape (..., H) with at least 2 dimensions, got {tuple(hidden.shape)}")
    rows = hidden.reshape(-1, hidden.shape[-1])
    ids = labels.reshape(-1)
    if ids.shape[0] != rows.shape[0]:
        raise ValueError(f"labels must hold one id per row of hidden: {rows.shape[0]} rows of hidden "
                         f"{tuple(hidden.shape)}, {ids.shape[0]} labels {tuple(labels.shape)}")
    import grpo_kernels as gk  # at call time: grpo_kernels/__init__.py may import this package

    sharded = _tensor_parallel(dist_process_group)
    extra = dict(process_group=dist_process_group, hidden_grad="partial") if sharded else {}
    logp, entropy = gk.linear_token_logprobs(rows, weight, ids, temperature=float(temperature), return_entropy=True,
                                             batch_invariant=_STATE["batch_invariant"], **extra)
    reduction = reduction.lower()
    if reduction == "sum":
        logp = logp.sum()
    elif reduction == "mean":
        logp = logp.mean()
    return logp, entropy


def _tensor_parallel(group) -> bool:
    """Whether ``group`` shards the vocabulary: a group of more than one rank. One rank holds the whole head (the
    unsharded call: the same numbers, without the group's validation all-gather); anything that is not a group is
    left to ``linear_token_logprobs`` to refuse."""
    if group is None:
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and isinstance(group, dist.ProcessGroup):
        return dist.get_world_size(group) > 1
    return True


def _verl_version() -> str:
    import verl

    return str(getattr(verl, "__version__", "unknown"))


def is_supported_verl_version(version: str) -> bool:
    """True when ``version`` (e.g. "0.9.1", "0.9.2.dev0") belongs to a series of ``SUPPORTED_VERL_VERSIONS``."""
    from packaging.version import InvalidVersion, Version  # a dependency of verl

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return any(tuple(release[:2]) == tuple(int(x) for x in s.split(".")) for s in SUPPORTED_VERL_VERSIONS)


def _holders(value) -> list[str]:
    """The loaded ``verl.*`` modules whose ``linear_cross_entropy`` is ``value``, the defining module first."""
    names = [name for name, module in list(sys.modules.items())
             if (name == "verl" or name.startswith("verl.")) and module is not None
             and getattr(module, SEAM_NAME, None) is value]
    return sorted(names, key=lambda name: (name != SEAM_MODULE, name))


def _swap(names, value) -> None:
    for name in names:
        setattr(sys.modules[name], SEAM_NAME, value)


@dataclasses.dataclass(frozen=True)
class VerlPatchReport:
    """What ``patch_verl`` did: the verl version, the names it swapped, and which calls run on grpo_kernels and which
    stay verl's (and why). ``print(report)`` shows it as a short table."""

    verl_version: str
    patched: tuple[str, ...]
    routes: tuple[Route, ...]
    newly_patched: bool

    def __str__(self) -> str:
        head = (f"grpo_kernels.verl: verl {self.verl_version} {'patched' if self.newly_patched else 'already patched'}"
                f"; swapped: " + ", ".join(self.patched))
        return route_table(head, self.routes)


def _routes() -> tuple[Route, ...]:
    return (
        Route("FSDP fused forward, impl_backend=triton", "grpo_kernels", backend()),
        Route("old / reference log-probs (no grad)", "grpo_kernels", "the one-sweep no-grad path"),
        Route("Megatron fused forward (TP vocab shards)", "grpo_kernels",
              "vocab-parallel head; partial d hidden, as verl's kernel"),
        Route("FSDP impl_backend=torch / liger", "verl", "FusedLinearForPPO / Liger: not this seam"),
        Route("calculate_sum_pi_squared with fused kernels", "verl", "refused by verl's engines (NotImplementedError)"),
    )


def patch_verl(batch_invariant: bool | None = None) -> VerlPatchReport:
    """Make verl's fused-kernel path run on grpo_kernels: replace ``linear_cross_entropy`` in
    ``verl.utils.kernel.linear_cross_entropy`` and in every loaded ``verl.*`` module that imported it.

    batch_invariant: every call of the seam is batch-invariant (``linear_token_logprobs(batch_invariant=True)``: a
    sequence's log-probs, entropies and d hidden the same in any micro-batch); None: ``GRPO_KERNELS_BATCH_INVARIANT=1``
    in the environment says so (how a verl config reaches the module it imports).

    Idempotent (a second call also swaps the name in modules loaded since, that imported verl's function before the
    first). ``unpatch_verl()`` restores verl exactly. Returns a ``VerlPatchReport`` and logs one INFO line on the
    ``grpo_kernels`` logger. Raises RuntimeError, changing nothing, when the installed verl is not in
    ``SUPPORTED_VERL_VERSIONS`` or lacks the seam; ImportError when verl cannot be imported.
    """
    import importlib

    try:
        version = _verl_version()
        seam = importlib.import_module(SEAM_MODULE)
    except ImportError as exc:
        raise ImportError(f"grpo_kernels.verl needs verl {SUPPORTED_VERL_VERSIONS[0]}.x: pip install 'verl==0.9.1' "
                          f"(scripts/setup_verl.sh makes such an environment); importing it failed: {exc}") from exc
    if not is_supported_verl_version(version):
        raise RuntimeError(f"grpo_kernels.verl supports verl {', '.join(s + '.x' for s in SUPPORTED_VERL_VERSIONS)}, "
                           f"found verl {version}; nothing was patched")
    if batch_invariant is None:
        batch_invariant = os.environ.get(BATCH_INVARIANT_ENV, "0") == "1"
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool or None, got {batch_invariant!r}")
    _STATE["batch_invariant"] = batch_invariant
    current = getattr(seam, SEAM_NAME, None)
    newly = _STATE["original"] is None
    if newly:
        if not callable(current):
            raise RuntimeError(f"{SEAM_MODULE}.{SEAM_NAME} not found: this verl does not have the fused-kernel seam "
                               f"grpo_kernels.verl patches; nothing was patched")
        _STATE["original"] = current
    swapped = _holders(_STATE["original"])
    _swap(swapped, linear_cross_entropy)
    _STATE["swapped"] = tuple(dict.fromkeys(_STATE["swapped"] + tuple(swapped)))
    report = VerlPatchReport(verl_version=version, patched=tuple(f"{name}.{SEAM_NAME}" for name in _STATE["swapped"]),
                             routes=_routes(), newly_patched=newly)
    logger.info("grpo_kernels.verl: verl %s %s: %s replaced by grpo_kernels' fused head [%s%s]; verl's own for: %s",
                version, "patched" if newly else "already patched", ", ".join(report.patched), backend(),
                ", batch-invariant" if batch_invariant else "",
                "; ".join(r.calls for r in report.routes if r.runs_on != "grpo_kernels"))
    return report


def unpatch_verl() -> None:
    """Undo ``patch_verl``: every loaded ``verl.*`` module whose ``linear_cross_entropy`` is ours (swapped, or imported
    while patched) gets verl's own function back. No-op when not patched."""
    original = _STATE["original"]
    if original is None:
        return
    _swap(_holders(linear_cross_entropy), original)
    _STATE["original"], _STATE["swapped"], _STATE["batch_invariant"] = None, (), False


def is_verl_patched() -> bool:
    """Whether ``patch_verl`` is in effect."""
    return _STATE["original"] is not None
