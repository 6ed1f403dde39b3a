"""Who is benchmarked: grpo-kernels and its peers, each a builder of a zero-argument callable per path.

A builder takes a ``harness.Case`` and returns ``fn()`` giving the scalar loss (paths "linear" and "logits") or the
(B, T) log-probs (path "logprob", and key "logits_nograd": the logits path's no-grad forward, which computes
log-probs and entropy from the logits; both called under ``torch.no_grad()``). All providers use ``harness.CONFIG``
(dapo, beta 0.04 with reference log-probs, eps 0.2/0.2, bias-corrected KL, temperature 1) and get the case's mask;
each declares the work it does (``work.WorkDecl``: how its lm_head runs, which rows it computes), read from its
own code, so the report's rates count what each one really computes. Providers that can skip padded rows are
given the mask the way their own trainers pass it (ours: ``mask=``; TRL's logits kernel: ``row_mask=``; Liger's
logits kernel: ``completion_mask=``); Liger's and TRL's chunked heads take no mask and compute every row.
The loss stage of the TRL providers is ``grpo_kernels.reference.loss_from_logps`` (TRL's own loss maths is a
method of ``GRPOTrainer`` and cannot be imported on its own); the eager provider is the package's one reference,
``reference_grpo_loss`` on full logits.
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
import types
from typing import Callable

import torch

import grpo_kernels as gk
from grpo_kernels.reference import logprobs_and_entropy, loss_from_logps, reference_grpo_loss

from .harness import CONFIG, Case, Settings, Shape, builder_key
from .work import WorkDecl

# trl 1.16 trainer/utils.py: _CHUNKED_LOGPROB_CHUNK_SIZE, the vocabulary width of TRL's projection tiles.
TRL_VOCAB_CHUNK = 32768


@dataclasses.dataclass(frozen=True)
class Provider:
    name: str
    kind: str  # "ours" or "peer" (the report's "best peer" is the fastest non-"ours" provider)
    builders: dict  # path -> (case -> fn)
    requires: tuple = ()  # importable modules
    triton: tuple = ()  # paths on which this provider is a Triton kernel (CUDA, or the CPU interpreter)
    grads_in_forward: tuple = ()  # paths on which the forward already computes the gradients
    notes: dict = dataclasses.field(default_factory=dict)  # path -> note for the report (mutable on purpose)
    work: WorkDecl = WorkDecl()
    triton_on_cuda: tuple = ()  # paths on which impl="auto" runs Triton kernels on CUDA
    fallbacks: dict = dataclasses.field(default_factory=dict)  # path -> (label of the failed try, builder, note)
    only: tuple | None = None  # (variant, mode) pairs this provider runs; None: all
    grads_in_forward_on_triton: tuple = ()  # paths on which its Triton kernels compute the gradients in the forward
    # (case, provider, mode, value) -> note: checks the first call's value before timing (raises for ours)
    check: Callable | None = None

    def runs_triton(self, path: str, s: Settings) -> bool:
        return path in self.triton or (s.cuda and path in self.triton_on_cuda)

    def computes_grads_in_forward(self, path: str, s: Settings) -> bool:
        """Its forward already computes the gradients (its "backward" only scales them): not a peer backward time."""
        return path in self.grads_in_forward or (path in self.grads_in_forward_on_triton and self.runs_triton(path, s))

    def skip_reason(self, path: str, shape: Shape, s: Settings) -> str | None:
        for module in self.requires:
            try:
                importlib.import_module(module)
            except ImportError as exc:
                return f"needs {module.split('.')[0]}: {type(exc).__name__}: {exc}"
        if path in self.triton and not s.cuda:
            if not s.interpret:
                return ("needs CUDA: runs Triton kernels and there is no CUDA device "
                        "(--bench-interpret runs them on the Triton CPU interpreter at the smallest shape)")
            if not shape.interp:
                return "Triton CPU interpreter: only at the smallest (interp) shape"
        return None

    def build(self, path: str, case: Case) -> Callable[[], torch.Tensor]:
        return self.builders[path](case)


def _cfg_args(case: Case) -> dict:
    return dict(mask=case.mask, old_logps=case.old_logps, ref_logps=case.ref_logps, config=CONFIG)


# ----------------------------------------------------------------------------------------------------------------
# eager PyTorch: the package's reference on full logits (materializes N x V and its softmax)


def _eager_linear(hidden, weight, ids, advantages, mask, old_logps, ref_logps):
    logits = hidden @ weight.T
    return reference_grpo_loss(logits, ids, advantages, mask, old_logps, ref_logps, config=CONFIG)[0]


def _eager_logits(logits, ids, advantages, mask, old_logps, ref_logps):
    return reference_grpo_loss(logits, ids, advantages, mask, old_logps, ref_logps, config=CONFIG)[0]


def _eager_logprob(hidden, weight, ids):
    return logprobs_and_entropy(hidden @ weight.T, ids, CONFIG.temperature)[0]


def _eager_logits_nograd(logits, ids):
    logp, entropy = logprobs_and_entropy(logits, ids, CONFIG.temperature)
    return logp, entropy


def _loss_args(case: Case):
    return case.ids, case.advantages, case.mask, case.old_logps, case.ref_logps


def _eager_builders(wrap):
    """Builders of the eager reference; ``wrap(path, f)`` is the identity or ``torch.compile``."""
    def linear(c):
        f = wrap("linear", _eager_linear)
        return lambda: f(c.hidden, c.weight, *_loss_args(c))

    def logits(c):
        f = wrap("logits", _eager_logits)
        return lambda: f(c.logits, *_loss_args(c))

    def logprob(c):
        f = wrap("logprob", _eager_logprob)
        return lambda: f(c.hidden, c.weight, c.ids)

    def logits_nograd(c):
        f = wrap("logits_nograd", _eager_logits_nograd)
        return lambda: f(c.logits, c.ids)[0]
    return {"linear": linear, "logits": logits, "logprob": logprob, "logits_nograd": logits_nograd}


_COMPILED: dict = {}


def _compiled(path, fn):
    # One compiled callable per path for the whole session: a new shape is a (dynamic) recompile, not a new cache.
    if path not in _COMPILED:
        _COMPILED[path] = torch.compile(fn)
    return _COMPILED[path]


# ----------------------------------------------------------------------------------------------------------------
# grpo-kernels


def _ours_builders(impl: str, **overrides):
    logprob = {k: v for k, v in overrides.items() if k == "batch_invariant"}  # the log-prob calls' one option
    return {
        "linear": lambda c: lambda: gk.fused_linear_grpo_loss(c.hidden, c.weight, c.ids, c.advantages,
                                                              impl=impl, **_cfg_args(c), **overrides)[0],
        "logits": lambda c: lambda: gk.grpo_loss(c.logits, c.ids, c.advantages, impl=impl, **_cfg_args(c),
                                                 **overrides)[0],
        "logprob": lambda c: lambda: gk.linear_token_logprobs(c.hidden, c.weight, c.ids, impl=impl, mask=c.mask,
                                                              **logprob),
        # under no_grad: the plain forward sweep (log-probs + entropy), never the gradient-in-forward kernel
        "logits_nograd": lambda c: lambda: gk.token_logprobs(c.logits, c.ids, CONFIG.temperature,
                                                             return_entropy=True, impl=impl, **logprob)[0],
    }


# ----------------------------------------------------------------------------------------------------------------
# Liger-Kernel


def _liger_chunked_linear(case: Case, compiled: bool | None = None):
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    # compiled=True (Liger's default) torch.compiles its loss maths on CUDA; on CPU compiled=False.
    compiled = case.device.type == "cuda" if compiled is None else compiled
    module = LigerFusedLinearGRPOLoss(beta=CONFIG.beta, compiled=compiled, use_ref_model=True,
                                      chunk_size=1, epsilon_low=CONFIG.epsilon_low,
                                      epsilon_high=CONFIG.epsilon_high, loss_type=CONFIG.loss_type,
                                      temperature=CONFIG.temperature,
                                      use_bias_correction_kl=CONFIG.use_bias_correction_kl)

    def fn():
        out = module(case.hidden, case.weight, case.ids, case.mask, case.advantages,
                     ref_per_token_logps=case.ref_logps, old_per_token_logps=case.old_logps)
        return out[0] if isinstance(out, (tuple, list)) else out
    return fn


def _liger_chunked_logprob(case: Case):
    from liger_kernel.chunked_loss.fused_linear_ppo import LigerFusedLinearPPOBase

    return lambda: LigerFusedLinearPPOBase.chunk_forward(case.hidden, case.weight, case.ids,
                                                         temperature=CONFIG.temperature)


def _liger_triton_logits(case: Case):
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    B, T, V = case.logits.shape
    if "liger_logits" not in case.extra:
        # Liger's kernel takes (B, T+1, V) logits (the last position is never read) and, with inplace=True (its
        # default), overwrites them with d logits in the backward.
        buf = torch.zeros(B, T + 1, V, dtype=case.dtype, device=case.device)
        case.extra["liger_logits"] = buf.requires_grad_(True)
    logits = case.extra["liger_logits"]

    def fn():
        out = triton_grpo_loss(logits, case.old_logps, case.ref_logps, case.ids, case.advantages,
                               completion_mask=case.mask, temperature=CONFIG.temperature, beta=CONFIG.beta,
                               eps_low=CONFIG.epsilon_low, eps_high=CONFIG.epsilon_high, inplace=True,
                               loss_type=CONFIG.loss_type, reduce=True,
                               use_bias_correction_kl=CONFIG.use_bias_correction_kl)
        return out[0]

    def prepare():  # untimed: restore the logits the previous in-place backward overwrote
        with torch.no_grad():
            logits[:, :T].copy_(case.logits)
    fn.prepare = prepare
    return fn


def _liger_triton_logits_nograd(case: Case):
    from liger_kernel.ops.grpo_loss import fused_selective_log_softmax

    B, T, V = case.logits.shape
    if "liger_logits" not in case.extra:  # shared with the loss above: (B, T+1, V), the last position unread
        buf = torch.zeros(B, T + 1, V, dtype=case.dtype, device=case.device)
        case.extra["liger_logits"] = buf.requires_grad_(True)
    logits = case.extra["liger_logits"]

    def fn():
        return fused_selective_log_softmax(logits.detach(), case.ids, temperature=CONFIG.temperature,
                                           mask=case.mask)

    def prepare():  # untimed: the buffer may hold d logits of an in-place backward of the loss benchmark
        with torch.no_grad():
            logits[:, :T].copy_(case.logits)
    fn.prepare = prepare
    return fn


# ----------------------------------------------------------------------------------------------------------------
# TRL


def trl_trainer_utils(notes: dict, path: str) -> None:
    """Make ``trl.trainer.utils`` importable: TRL's chunked kernels import it (for a DeepSpeed ZeRO-3 gather), and
    it pulls accelerate, datasets and pandas. Where those are missing (the offline GPU image), that module is
    replaced by a stub whose ``maybe_gather_lm_head_ctx`` is the ``nullcontext`` TRL returns without ZeRO-3, so the
    measured code is TRL's own; ``notes[path]`` says so."""
    try:
        importlib.import_module("trl.trainer.utils")
    except ImportError as exc:
        stub = types.ModuleType("trl.trainer.utils")
        stub.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = stub
        notes[path] = (f"trl.trainer.utils not importable ({exc}); maybe_gather_lm_head_ctx stubbed as nullcontext "
                       "(TRL's value without DeepSpeed ZeRO-3)")


def _trl_chunked_function():
    """TRL's ``ChunkedLogProbFunction`` (its backward imports ``trl.trainer.utils``: ``trl_trainer_utils``)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    trl_trainer_utils(TRL_CHUNKED.notes, "linear")
    return ChunkedLogProbFunction


def _trl_chunked_linear(case: Case):
    f = _trl_chunked_function()
    B, T, H = case.hidden.shape

    def fn():
        logp, entropy = f.apply(case.hidden.view(-1, H), case.weight, None, case.ids.view(-1), CONFIG.temperature,
                                TRL_VOCAB_CHUNK, None, 1.0, ("entropy",))[:2]
        return loss_from_logps(logp.view(B, T), case.advantages, entropy=entropy.view(B, T), **_cfg_args(case))[0]
    return fn


def _trl_chunked_logprob(case: Case):
    f = _trl_chunked_function()
    B, T, H = case.hidden.shape
    return lambda: f.apply(case.hidden.view(-1, H), case.weight, None, case.ids.view(-1), CONFIG.temperature,
                           TRL_VOCAB_CHUNK, None, 1.0, ())[0].view(B, T)


def _trl_triton_logits_nograd(case: Case):
    from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

    return lambda: selective_log_softmax_and_entropy(case.logits, case.ids, temperature=CONFIG.temperature,
                                                     row_mask=case.mask)[0]


def _trl_triton_logits(case: Case):
    from trl.kernels.logprob_entropy import selective_log_softmax_and_entropy

    def fn():
        logp, entropy = selective_log_softmax_and_entropy(case.logits, case.ids, temperature=CONFIG.temperature,
                                                          row_mask=case.mask)
        return loss_from_logps(logp, case.advantages, entropy=entropy, **_cfg_args(case))[0]
    return fn


# ----------------------------------------------------------------------------------------------------------------
# the registry, in report order

_OURS_SRC = ("the path grpo_kernels.explain names (docs/DESIGN.md section 5): on CUDA head.fast (per chunk of valid "
             "rows cuBLAS logits, epilogue, dH / dW GEMMs, all in the forward), head.no_grad without gradients, "
             "logits.fast for the logits path; on CPU head.torch / logits.torch (tiled PyTorch); mask= gathers the "
             "valid rows first")
OURS = Provider("ours", "ours", _ours_builders("auto"), triton_on_cuda=("linear", "logits", "logprob"),
                work=WorkDecl("recompute", {"linear": "always", "logprob": "always", "logits": "triton"},
                              linear_triton="gemm-in-forward", logits_in_forward="triton",
                              exact_logits_traffic="triton", source=_OURS_SRC),
                grads_in_forward_on_triton=("linear", "logits"),
                notes={"linear": "impl=auto: Triton on CUDA (gradients in the forward, 6NHV), chunked torch on CPU",
                       "logits": "impl=auto: Triton on CUDA (d logits written by the forward kernel), chunked torch "
                                 "on CPU",
                       "logprob": "impl=auto under no_grad, mask= (valid rows only)",
                       "logits_nograd": "token_logprobs(return_entropy=True) under no_grad: the plain forward "
                                        "sweep (Triton on CUDA, chunked torch on CPU)"})
OURS_INVARIANT = Provider("ours-batch-invariant", "ours", _ours_builders("auto", batch_invariant=True),
                         triton_on_cuda=("linear", "logits", "logprob"),
                         work=WorkDecl("recompute", {"linear": "always", "logprob": "always", "logits": "triton"},
                                       linear_triton="gemm-in-forward", logits_in_forward="triton",
                                       exact_logits_traffic="triton", source=_OURS_SRC),
                         grads_in_forward_on_triton=("linear", "logits"),
                         only=(("valid", "fwdbwd"), ("valid", "fwd"), ("padded", "fwdbwd"), ("valid", "nograd"),
                               ("padded", "nograd")),
                         notes={p: "batch_invariant=True: the same paths with fixed-size row blocks (the last one "
                                   "zero-padded) and a vocabulary order that does not follow N (docs/numerics.md, "
                                   "Batch invariance)"
                                for p in ("linear", "logits", "logprob", "logits_nograd")})
# Under no_grad the light path is ours (no gradient anywhere): no "logits_nograd" entry.
OURS_LIGHT = Provider("ours-light", "ours", {k: b for k, b in _ours_builders("triton", grad_in_forward=False).items()
                                            if k != "logits_nograd"}, triton=("linear", "logits"),
                      work=WorkDecl("recompute", {"linear": "always", "logits": "triton"},
                                    exact_logits_traffic="triton", source=_OURS_SRC),
                      only=(("valid", "fwdbwd"), ("valid", "fwd"), ("valid", "bwd"), ("padded", "fwdbwd")),
                      notes={"linear": "grad_in_forward=False: the memory-light recompute path (8NHV)",
                             "logits": "grad_in_forward=False: forward sweep + separate backward sweep"})
OURS_ATOMIC = Provider("ours-atomic", "ours", {"linear": _ours_builders("triton", deterministic=False,
                                                                        grad_in_forward=False)["linear"]},
                       triton=("linear",),
                       work=WorkDecl("recompute", {"linear": "always"}, source=_OURS_SRC),
                       only=(("valid", "fwdbwd"), ("valid", "bwd"), ("padded", "fwdbwd")),
                       notes={"linear": "deterministic=False: one backward kernel, float atomics for dH / dW "
                                        "(the torch path on CPU is always deterministic: CUDA only)"})
OURS_INTERP = Provider("ours-triton-interp", "ours", _ours_builders("triton"), triton=("linear", "logits", "logprob"),
                       work=WorkDecl("recompute", {"linear": "always", "logprob": "always", "logits": "triton"},
                                     linear_triton="gemm-in-forward", logits_in_forward="triton",
                                     exact_logits_traffic="triton", source=_OURS_SRC),
                       grads_in_forward_on_triton=("linear", "logits"),
                       notes={p: "impl=triton under TRITON_INTERPRET=1"
                              for p in ("linear", "logits", "logprob", "logits_nograd")})
_EAGER_WORK = WorkDecl("materialize", exact_logits_traffic="never",
                       source="hidden @ W.T kept for autograd (no recompute); several passes over the logits")
EAGER = Provider("eager", "peer", _eager_builders(lambda path, f: f), work=_EAGER_WORK,
                 notes={"linear": "reference_grpo_loss(hidden @ W.T): full logits",
                        "logits": "reference_grpo_loss", "logprob": "logprobs_and_entropy(hidden @ W.T)",
                        "logits_nograd": "logprobs_and_entropy(logits)"})
COMPILE = Provider("compile", "peer", _eager_builders(_compiled), work=_EAGER_WORK,
                   notes={p: "torch.compile of the eager provider (compilation untimed)"
                          for p in ("linear", "logits", "logprob", "logits_nograd")})
LIGER_CHUNKED = Provider(
    "liger-chunked", "peer", {"linear": _liger_chunked_linear, "logprob": _liger_chunked_logprob},
    requires=("liger_kernel.chunked_loss",), grads_in_forward=("linear",),
    work=WorkDecl("grads-in-forward", source="liger_kernel/chunked_loss/fused_linear_ppo.py: the forward runs "
                  "chunk_forward (logits), then autograd.grad through _ChunkedSelectiveLogProbFunction (recompute, "
                  "dH, dW) per chunk of rows, all rows"),
    fallbacks={"linear": ("compiled=True", lambda c: _liger_chunked_linear(c, compiled=False),
                          "measured with compiled=False")},
    notes={"linear": "LigerFusedLinearGRPOLoss (chunk_size=1, compiled on CUDA only); computes the gradients "
                     "inside its forward",
           "logprob": "LigerFusedLinearPPOBase.chunk_forward (log-probs only)"})
LIGER_TRITON = Provider("liger-triton", "peer", {"logits": _liger_triton_logits,
                                                 "logits_nograd": _liger_triton_logits_nograd},
                        requires=("liger_kernel.transformers.grpo_loss",), triton=("logits",),
                        work=WorkDecl(skips_padded={"logits": "always"},
                                      source="liger_kernel/ops/grpo_loss.py: one read per valid row forward; "
                                             "backward reads valid rows, writes d logits (zeros at padding) "
                                             "in place"),
                        notes={"logits": "triton_grpo_loss(inplace=True, reduce=True) on (B, T+1, V) logits",
                               "logits_nograd": "fused_selective_log_softmax on (B, T+1, V) logits: log-probs only "
                                                "(Liger has no no-grad entropy kernel)"})
TRL_CHUNKED = Provider("trl-chunked", "peer", {"linear": _trl_chunked_linear, "logprob": _trl_chunked_logprob},
                       requires=("trl.kernels.chunked_logprob",),
                       work=WorkDecl("recompute", source="trl/kernels/chunked_logprob.py: forward GEMM per "
                                     "(4096 x 32768) tile; backward recomputes each tile, then dH and dW GEMMs "
                                     "(dW skipped for a frozen head); no mask: all rows"),
                       notes={"linear": "ChunkedLogProbFunction(outputs=('entropy',)) + loss_from_logps",
                              "logprob": "ChunkedLogProbFunction(outputs=()) (log-probs only)"})
TRL_TRITON = Provider("trl-triton", "peer", {"logits": _trl_triton_logits,
                                             "logits_nograd": _trl_triton_logits_nograd},
                      requires=("trl.kernels.logprob_entropy",), triton=("logits",),
                      work=WorkDecl(skips_padded={"logits": "always"},
                                    source="trl/kernels/logprob_entropy.py: one read per valid row (row_mask) "
                                           "forward; backward reads valid rows, writes a new d logits buffer"),
                      notes={"logits": "selective_log_softmax_and_entropy(row_mask=mask) + loss_from_logps",
                             "logits_nograd": "selective_log_softmax_and_entropy(row_mask=mask)"})

PROVIDERS = (OURS, OURS_INVARIANT, OURS_LIGHT, OURS_ATOMIC, OURS_INTERP, EAGER, COMPILE, LIGER_CHUNKED, LIGER_TRITON, TRL_CHUNKED,
             TRL_TRITON)


def all_providers() -> tuple:
    """Every provider: the GRPO ones above, then the distillation ones (``distill_providers.py``, built on
    ``Provider``)."""
    from .distill_providers import DISTILL_PROVIDERS

    return PROVIDERS + DISTILL_PROVIDERS


def providers_for(path: str, variant: str, mode: str, s: Settings) -> list[Provider]:
    """Providers benchmarked on this case here; ``ours-triton-interp`` only with --bench-interpret on CPU."""
    out = []
    for p in all_providers():
        if builder_key(path, mode) not in p.builders:
            continue
        if p is OURS_INTERP and (s.cuda or not s.interpret):
            continue
        if p.only is not None and (variant, mode) not in p.only:
            continue
        out.append(p)
    return out
