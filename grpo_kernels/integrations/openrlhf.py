"""Run OpenRLHF's ``Actor.forward`` on grpo_kernels' fused linear head: the log-probs (and entropies) OpenRLHF reads,
without the (B, T, V) logits.

Usage: ``import grpo_kernels.openrlhf`` (it calls ``patch_openrlhf()``) in every process that runs an ``Actor``; for
OpenRLHF's Ray workers, ``python -m grpo_kernels.openrlhf openrlhf.cli.train_ppo_ray ...`` or a Ray setup hook
(``ray_runtime_env``; docs/openrlhf.md). By hand::

    report = grpo_kernels.integrations.openrlhf.patch_openrlhf()   # logs one info line; print(report): what runs where
    ...
    grpo_kernels.integrations.openrlhf.unpatch_openrlhf()          # OpenRLHF exactly as it was

The seam. OpenRLHF 0.11's ``openrlhf.models.actor.Actor.forward`` serves every log-prob the trainers use: the
policy's training step (``trainer/ray/ppo_actor.py``, with ``return_entropy`` when ``--actor.entropy_coef`` is set),
the old log-probs (``PolicyModelActor.forward``, no grad), the reference model (``ReferenceModelActor``, no grad),
SFT and DPO (``return_logprobs=True``, all T - 1 positions). Stock, it runs the Hugging Face model on every position,
casts the (B, T, V) logits to fp32, divides them by the temperature in place, takes a softmax over all of them for the
entropy and a log-softmax for the log-probs, and keeps the last A columns. ``patch_openrlhf`` replaces that one class
attribute with ``fused_actor_forward``: the model's own forward runs with ``logits_to_keep`` an empty index (its
``lm_head`` sees no row; MoE routers still give ``aux_loss``), a forward hook on its backbone keeps the final hidden
states, and ``grpo_kernels.linear_token_logprobs`` scores only the positions whose log-probs are read: the rows that
predict the A action tokens (the rows ``action_mask`` drops are skipped: their log-prob is 0, as stock's ``x * 0``),
or the T - 1 predicting rows with ``return_logprobs``. Same signature and results as OpenRLHF's (see
``fused_actor_forward``).

Numbers. In bf16 OpenRLHF's lm_head returns bf16 logits that it then casts to fp32; the default
``round_logits="model"`` rounds our fp32-accumulated logits to the head's dtype the same way before the fp32
log-softmax, so the patched trainer keeps OpenRLHF's own numbers (old, reference and policy log-probs alike);
``round_logits=None`` keeps fp32 logits (closer to exact). Under ZeRO-3 the head is gathered for the call with
``zero3_gather_head`` (inside the engine's forward, where ZeRO-3 takes its gradient); PEFT models are unwrapped with
``get_base_model()``, a DeepSpeed engine with ``.module``.

Not served here, handed to OpenRLHF's own forward with a one-line warning (once per reason), never a wrong answer:
- a call that returns the logits (no ``action_mask`` and no ``return_logprobs``), or ``allgather_logits=True``;
- ring attention (``ring_attn_group``): its sequence-sliced rows and all-gather stay OpenRLHF's;
- vision-language actors (``is_vlm`` or multimodal inputs): not tested here;
- a model whose head the fused path cannot express: no ``lm_head`` / not an ``nn.Linear``, a PEFT adapter on
  ``lm_head``, a logit scale or ``final_logit_softcapping`` that is not a finite number > 0, no backbone module, no
  ``logits_to_keep`` argument in its forward.
``output.logits`` of a served call is None (the logits are never built): a caller that reads them gets a TypeError
or KeyError, not numbers; ``stock_forward(actor, ...)`` runs OpenRLHF's own forward for such a caller.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import sys
import warnings

import torch

from ..distributed.sharded_head import zero3_gather_head
from .transformers import (is_peft_layer, text_config, unwrap_peft, cast_to, fold_logit_scale,
                           fused_head_blocker, logit_scale_of)
from .report import Route, backend, route_table

__all__ = ["SUPPORTED_OPENRLHF_VERSIONS", "ROUNDINGS", "fused_actor_forward", "stock_forward", "patch_openrlhf",
           "unpatch_openrlhf", "is_openrlhf_patched", "OpenRLHFPatchReport", "ray_runtime_env", "SETUP_HOOK"]

logger = logging.getLogger("grpo_kernels")

# OpenRLHF release series (major.minor) whose Actor.forward this module was written against and tested with.
SUPPORTED_OPENRLHF_VERSIONS = ("0.11",)
ACTOR_MODULE = "openrlhf.models.actor"
# patch_openrlhf's round_logits: "model" rounds the raw logits to the dtype the model's lm_head computes in (bf16 /
# fp16 weights or autocast: OpenRLHF's own logits are that dtype before its fp32 cast), None keeps them fp32.
ROUNDINGS = ("model", None, "bf16", "fp16")
_DTYPE_ROUNDING = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# The environment reaches the Ray workers, where the module patches at import: how a launch sets the options.
ROUND_LOGITS_ENV = "GRPO_KERNELS_OPENRLHF_ROUND_LOGITS"  # "model" (default), "none", "bf16", "fp16"
BATCH_INVARIANT_ENV = "GRPO_KERNELS_BATCH_INVARIANT"  # "1": batch-invariant head calls
# The Ray worker setup hook (``runtime_env["worker_process_setup_hook"]``): Ray imports the module and calls it.
SETUP_HOOK = "grpo_kernels.openrlhf.patch"

# Actor class -> its own forward while patched; the options; the fallback reasons already warned about.
_STATE: dict = {"originals": {}, "round_logits": "model", "batch_invariant": False, "warned": set()}


def _warn_fallback(reason: str) -> None:
    if reason not in _STATE["warned"]:
        _STATE["warned"].add(reason)
        warnings.warn(f"grpo_kernels.openrlhf: {reason}; OpenRLHF's own Actor.forward serves these calls",
                      UserWarning, stacklevel=3)


def stock_forward(actor, *args, **kwargs):
    """OpenRLHF's own ``Actor.forward`` on ``actor`` (patched or not): for a caller that needs the logits."""
    original = _STATE["originals"].get(_defining_class(type(actor)))
    forward = original if original is not None else type(actor).forward
    return forward(actor, *args, **kwargs)


def _defining_class(cls):
    """The class in ``cls``'s MRO whose ``forward`` was patched (a subclass of Actor inherits it)."""
    for klass in cls.__mro__:
        if klass in _STATE["originals"]:
            return klass
    return cls


def _unwrap(model):
    """The transformers model under a DeepSpeed engine (``.module``) and a PEFT wrapper (``get_base_model()``)."""
    for _ in range(4):
        if type(model).__module__.split(".")[0] == "deepspeed" and hasattr(model, "module"):
            model = model.module
        elif is_peft_layer(model) and hasattr(model, "get_base_model"):
            model = unwrap_peft(model)
        else:
            return model
    return model


def _head_blocker(lm) -> str | None:
    """Why ``lm``'s head cannot go through the fused path, or None."""
    get_head = getattr(lm, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if head is None:
        return f"{type(lm).__name__} has no lm_head (get_output_embeddings() is None)"
    if is_peft_layer(head):
        return f"a PEFT adapter on lm_head ({type(head).__name__}); merge it or leave lm_head out of target_modules"
    if not isinstance(head, torch.nn.Linear):
        return f"lm_head is a {type(head).__name__}, not a torch.nn.Linear"
    config = text_config(lm)
    blocker = fused_head_blocker(getattr(config, "final_logit_softcapping", None), logit_scale_of(config))
    if blocker is not None:
        return f"{blocker[0]}: {blocker[1]}"
    if getattr(lm, "base_model", lm) is lm:
        return f"{type(lm).__name__} exposes no backbone module (base_model_prefix)"
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        return f"{type(lm).__name__}.forward takes no logits_to_keep (the head would run on every position)"
    return None


def _call_blocker(actor, action_mask, return_logprobs, allgather_logits, ring_attn_group, mm_inputs) -> str | None:
    """Why this call goes to OpenRLHF's own forward, or None."""
    if action_mask is None and not return_logprobs:
        return "a call that returns the logits (no action_mask, no return_logprobs)"
    if allgather_logits:
        return "allgather_logits=True (the caller gathers logits)"
    if ring_attn_group is not None:
        return "ring attention (ring_attn_group): sequence-sliced rows are not served"
    if getattr(actor, "is_vlm", False) or mm_inputs:
        return "a vision-language actor (is_vlm / multimodal inputs): not tested with the fused head"
    return _head_blocker(_unwrap(actor.model))


def _rounding(weight: torch.Tensor) -> str | None:
    """The ``round_logits`` of a call: the option, or for "model" the dtype OpenRLHF's lm_head output has."""
    option = _STATE["round_logits"]
    if option != "model":
        return option
    device = weight.device.type
    if torch.is_autocast_enabled(device):
        return _DTYPE_ROUNDING.get(torch.get_autocast_dtype(device))
    return _DTYPE_ROUNDING.get(weight.dtype)


def _run_model(actor, sequences, attention_mask, position_ids, lm):
    """The model's own forward with no row through ``lm_head``; returns (output without logits, final hidden)."""
    captured = []

    def keep_hidden(module, args, out):
        captured.append(out[0] if isinstance(out, tuple) else out.last_hidden_state)

    handle = lm.base_model.register_forward_hook(keep_hidden)
    try:
        no_rows = torch.empty(0, dtype=torch.long, device=sequences.device)
        out = actor.model(sequences, attention_mask=attention_mask, position_ids=position_ids, logits_to_keep=no_rows)
    finally:
        handle.remove()
    if not captured:
        raise RuntimeError(f"grpo_kernels.openrlhf: {type(lm).__name__}'s backbone ({type(lm.base_model).__name__}) "
                           "did not run in its forward: cannot take the final hidden states")
    # a new output of the model's own class without the (B, 0, V) logits: output.logits is None, not a wrong tensor
    output = type(out)(**{key: value for key, value in out.items() if key != "logits"})
    return output, captured[-1]


def _score(actor, lm, hidden, ids, mask, entropy):
    """``linear_token_logprobs`` on the rows ``hidden`` (..., H) predicting ``ids``; returns (logp, entropy | None)."""
    import grpo_kernels as gk  # at call time: grpo_kernels/__init__.py may import this package

    head = lm.get_output_embeddings()
    weight, bias = head.weight, head.bias
    rounding = _rounding(weight)
    if weight.dtype != hidden.dtype and not torch.is_autocast_enabled(hidden.device.type):
        hidden, weight, bias = cast_to(torch.promote_types(hidden.dtype, weight.dtype), hidden, weight, bias)
    config = text_config(lm)
    softcap = getattr(config, "final_logit_softcapping", None)
    temperature, softcap = fold_logit_scale(actor.temperature, logit_scale_of(config), softcap)
    gather = zero3_gather_head(head.weight, head.bias) if hasattr(head.weight, "ds_id") else None
    out = gk.linear_token_logprobs(hidden, weight, ids.to(hidden.device), bias=bias, temperature=temperature,
                                   softcap=softcap, return_entropy=entropy, mask=mask, gather_head=gather,
                                   batch_invariant=_STATE["batch_invariant"], round_logits=rounding)
    return out if entropy else (out, None)


def _padded(actor, lm, sequences, attention_mask, action_mask, return_entropy):
    """Padded rows: (log-probs (B, A) or (B, T - 1), entropy (B, T - 1) | None, output)."""
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    output, hidden = _run_model(actor, sequences, attention_mask, position_ids, lm)
    batch, seqlen = sequences.shape
    if action_mask is None:  # return_logprobs: every predicting position
        logp, entropy = _score(actor, lm, hidden[:, :-1], sequences[:, 1:], None, return_entropy)
        return logp, entropy, output
    actions = action_mask.shape[1]
    logp, entropy = _score(actor, lm, hidden[:, seqlen - 1 - actions:seqlen - 1], sequences[:, seqlen - actions:],
                           action_mask != 0, return_entropy)
    if entropy is not None:
        entropy = torch.cat([entropy.new_zeros(batch, seqlen - 1 - actions), entropy], dim=1)
    return logp * action_mask.float(), entropy, output


def _packed(actor, lm, sequences, attention_mask, action_mask, return_entropy):
    """``packing_samples``: OpenRLHF's own unpadding into one row of real tokens, the read rows scored, padded back."""
    module = sys.modules[_defining_class(type(actor)).__module__]  # actor.py's own unpadding helpers
    batch, seqlen = sequences.shape
    rows, position_ids, rolled, _, indices = module.unpad_and_slice_tensor(sequences, attention_mask, None)
    output, hidden = _run_model(actor, rows, None, position_ids, lm)
    read = torch.zeros(batch, seqlen, dtype=torch.bool, device=sequences.device)
    if action_mask is None:
        read[:, :-1] = True
    else:
        actions = action_mask.shape[1]
        read[:, seqlen - 1 - actions:seqlen - 1] = action_mask != 0
    logp, entropy = _score(actor, lm, hidden, rolled, read.reshape(1, -1)[:, indices], return_entropy)

    def unpacked(values):  # (1, N) -> (B, T - 1), zeros where no real token is
        return module.gather_and_pad_tensor(values, None, 0, indices, batch, seqlen)[:, :-1]

    logp = unpacked(logp)
    entropy = None if entropy is None else unpacked(entropy)
    if action_mask is not None:
        logp = logp[:, -action_mask.shape[1]:] * action_mask.float()
    return logp, entropy, output


def fused_actor_forward(self, sequences: torch.LongTensor, action_mask=None, attention_mask=None,
                        return_output=False, allgather_logits=False, return_logprobs=False, ring_attn_group=None,
                        packed_seq_lens=None, return_entropy=False, **mm_inputs):
    """OpenRLHF 0.11's ``Actor.forward`` on grpo_kernels' fused head; OpenRLHF's signature and results:

    - ``action_mask`` (B, A): the log-probs of the last A tokens of ``sequences`` (B, T), times ``action_mask``: (B, A)
      float32 (the rows predicting them only; rows the mask drops are not computed and hold 0);
    - else ``return_logprobs``: (B, T - 1), position t the log-prob of token t + 1 (all positions, padding included,
      as OpenRLHF's; with ``packing_samples`` 0 at padding, as OpenRLHF's);
    - ``return_output``: also the model's output (its own class: ``aux_loss`` / ``router_logits`` for MoE) with
      ``logits`` None; with ``return_entropy``, ``output.entropy`` (B, T - 1) float32: the entropy at the rows scored
      (the last A columns where ``action_mask`` is set, where OpenRLHF reads it), 0 at the others;
    - at ``self.temperature``, with the model's logit scale / soft cap folded in; log-probs of the logits rounded to
      the head's dtype first by default (``patch_openrlhf(round_logits=)``); differentiable to every parameter.
    Calls it does not serve (module docstring) run OpenRLHF's own forward, warned once per reason.
    """
    reason = _call_blocker(self, action_mask, return_logprobs, allgather_logits, ring_attn_group, mm_inputs)
    if reason is not None:
        _warn_fallback(reason)
        return stock_forward(self, sequences, action_mask, attention_mask, return_output, allgather_logits,
                             return_logprobs, ring_attn_group, packed_seq_lens, return_entropy, **mm_inputs)
    if return_entropy and not return_output:
        raise ValueError("return_entropy=True needs return_output=True (the entropy is output.entropy), as "
                         "OpenRLHF's Actor.forward asserts")
    if action_mask is not None and not 1 <= action_mask.shape[1] <= sequences.shape[1] - 1:
        raise ValueError(f"action_mask must have 1 to T - 1 = {sequences.shape[1] - 1} columns (the completion "
                         f"after at least one prompt token), got shape {tuple(action_mask.shape)}")
    lm = _unwrap(self.model)
    run = _packed if getattr(self, "packing_samples", False) else _padded
    logp, entropy, output = run(self, lm, sequences, attention_mask, action_mask, return_entropy)
    if entropy is not None:
        setattr(output, "entropy", entropy)
    return (logp, output) if return_output else logp


def _openrlhf_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("openrlhf")
    except PackageNotFoundError:
        import openrlhf

        return str(getattr(openrlhf, "__version__", "unknown"))


def is_supported_openrlhf_version(version: str) -> bool:
    """True when ``version`` (e.g. "0.11.2") belongs to a series of ``SUPPORTED_OPENRLHF_VERSIONS``."""
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(version).release
    except InvalidVersion:
        return False
    return any(tuple(release[:2]) == tuple(int(x) for x in s.split(".")) for s in SUPPORTED_OPENRLHF_VERSIONS)


@dataclasses.dataclass(frozen=True)
class OpenRLHFPatchReport:
    """What ``patch_openrlhf`` did: the OpenRLHF version, the attribute it swapped, the options, and which calls run on
    grpo_kernels and which stay OpenRLHF's (and why). ``print(report)`` shows it as a short table."""

    openrlhf_version: str
    patched: tuple[str, ...]
    routes: tuple[Route, ...]
    newly_patched: bool
    round_logits: str | None = "model"
    batch_invariant: bool = False

    def __str__(self) -> str:
        head = (f"grpo_kernels.openrlhf: OpenRLHF {self.openrlhf_version} "
                f"{'patched' if self.newly_patched else 'already patched'} (round_logits={self.round_logits!r}"
                + (", batch_invariant=True" if self.batch_invariant else "") + "); swapped: " + ", ".join(self.patched))
        return route_table(head, self.routes)


def _routes() -> tuple[Route, ...]:
    return (
        Route("policy step (action_mask, entropy)", "grpo_kernels", f"the A action rows only; {backend()}"),
        Route("old / reference log-probs (no grad)", "grpo_kernels", "the one-sweep no-grad path"),
        Route("SFT / DPO (return_logprobs)", "grpo_kernels", "the T - 1 predicting rows"),
        Route("packing_samples", "grpo_kernels", "OpenRLHF's unpadding; the read rows of the packed row"),
        Route("ZeRO-3 / PEFT / DeepSpeed engine", "grpo_kernels", "zero3_gather_head; get_base_model(); .module"),
        Route("logits returned / allgather_logits", "OpenRLHF", "the caller wants logits; warned once"),
        Route("ring attention (ring_attn_group)", "OpenRLHF", "sequence-sliced rows; warned once"),
        Route("vision-language actor", "OpenRLHF", "not tested with the fused head; warned once"),
        Route("no nn.Linear lm_head / adapter on it / bad scale", "OpenRLHF", "not expressible; warned once"),
    )


def _options(round_logits, batch_invariant):
    if round_logits == "from_env":
        value = os.environ.get(ROUND_LOGITS_ENV, "model").strip().lower()
        round_logits = None if value == "none" else value
    if round_logits not in ROUNDINGS:
        raise ValueError(f"round_logits must be one of {ROUNDINGS} (or {ROUND_LOGITS_ENV}=model|none|bf16|fp16), "
                         f"got {round_logits!r}")
    if batch_invariant is None:
        batch_invariant = os.environ.get(BATCH_INVARIANT_ENV, "0") == "1"
    if not isinstance(batch_invariant, bool):
        raise ValueError(f"batch_invariant must be a bool or None, got {batch_invariant!r}")
    return round_logits, batch_invariant


def patch_openrlhf(round_logits="from_env", batch_invariant: bool | None = None, actor_class=None):
    """Make OpenRLHF's ``Actor.forward`` run on grpo_kernels' fused head (``fused_actor_forward``).

    round_logits: "model" (the default): round the raw logits to the dtype the model's lm_head computes in (bf16 /
        fp16 weights, or the autocast dtype) before the fp32 log-softmax, as OpenRLHF's own forward (and vLLM's
        sampler) has them, so the patched numbers are OpenRLHF's; None: keep fp32 logits (closer to the exact value,
        and no longer OpenRLHF's numbers in bf16); "bf16" / "fp16": always round to that dtype. "from_env": read
        ``GRPO_KERNELS_OPENRLHF_ROUND_LOGITS`` (model | none | bf16 | fp16; unset: model).
    batch_invariant: batch-invariant head calls; None: ``GRPO_KERNELS_BATCH_INVARIANT=1`` says so.
    actor_class: the class to patch (default ``openrlhf.models.actor.Actor``; a copy of that module loaded under
        another name, as OpenRLHF's own unit tests do, can be given).
    Idempotent (a second call updates the options); ``unpatch_openrlhf()`` restores OpenRLHF exactly. Returns an
    ``OpenRLHFPatchReport`` and logs one INFO line on the ``grpo_kernels`` logger. Raises RuntimeError, changing
    nothing, when the installed OpenRLHF is not in ``SUPPORTED_OPENRLHF_VERSIONS``; ImportError without OpenRLHF.
    """
    import importlib

    round_logits, batch_invariant = _options(round_logits, batch_invariant)
    try:
        version = _openrlhf_version()
        cls = actor_class if actor_class is not None else importlib.import_module(ACTOR_MODULE).Actor
    except ImportError as exc:
        raise ImportError(f"grpo_kernels.openrlhf needs OpenRLHF {SUPPORTED_OPENRLHF_VERSIONS[0]}.x: pip install "
                          f"'openrlhf==0.11.2' (scripts/setup_openrlhf.sh makes such an environment); importing it "
                          f"failed: {exc}") from exc
    if not is_supported_openrlhf_version(version):
        raise RuntimeError(f"grpo_kernels.openrlhf supports OpenRLHF "
                           f"{', '.join(s + '.x' for s in SUPPORTED_OPENRLHF_VERSIONS)}, found {version}; nothing "
                           f"was patched")
    if not callable(cls.__dict__.get("forward")):
        raise RuntimeError(f"{cls.__module__}.{cls.__qualname__} defines no forward: not OpenRLHF's Actor; nothing "
                           f"was patched")
    newly = cls not in _STATE["originals"]
    if newly:
        _STATE["originals"][cls] = cls.__dict__["forward"]
        cls.forward = fused_actor_forward
    _STATE["round_logits"], _STATE["batch_invariant"] = round_logits, batch_invariant
    report = OpenRLHFPatchReport(openrlhf_version=version, newly_patched=newly, round_logits=round_logits,
                                 patched=tuple(f"{c.__module__}.{c.__qualname__}.forward" for c in _STATE["originals"]),
                                 routes=_routes(), batch_invariant=batch_invariant)
    logger.info("grpo_kernels.openrlhf: OpenRLHF %s %s: %s on grpo_kernels' fused head [%s, round_logits=%r%s]; "
                "OpenRLHF's own for: %s", version, "patched" if newly else "already patched",
                ", ".join(report.patched), backend(), round_logits, ", batch-invariant" if batch_invariant else "",
                "; ".join(r.calls for r in report.routes if r.runs_on != "grpo_kernels"))
    return report


def unpatch_openrlhf() -> None:
    """Undo ``patch_openrlhf``: every patched class gets OpenRLHF's own forward back. No-op when not patched."""
    for cls, original in list(_STATE["originals"].items()):
        cls.forward = original
    _STATE["originals"].clear()
    _STATE["round_logits"], _STATE["batch_invariant"] = "model", False
    _STATE["warned"].clear()


def is_openrlhf_patched() -> bool:
    """Whether ``patch_openrlhf`` is in effect."""
    return bool(_STATE["originals"])


def ray_runtime_env(runtime_env: dict | None = None) -> dict:
    """``runtime_env`` (a copy; None: empty) with Ray's ``worker_process_setup_hook`` set to ``SETUP_HOOK``, so that
    every Ray worker process imports ``grpo_kernels.openrlhf`` (and so patches) before it runs a task or actor:
    ``ray.init(runtime_env=ray_runtime_env({"env_vars": {...}}))``. Raises ValueError when ``runtime_env`` already
    has another setup hook (call ``grpo_kernels.openrlhf.patch()`` from that hook instead)."""
    env = dict(runtime_env or {})
    hook = env.get("worker_process_setup_hook")
    if hook not in (None, SETUP_HOOK):
        raise ValueError(f"runtime_env already has worker_process_setup_hook={hook!r}: call "
                         f"grpo_kernels.openrlhf.patch() from it instead of adding {SETUP_HOOK!r}")
    env["worker_process_setup_hook"] = SETUP_HOOK
    return env
