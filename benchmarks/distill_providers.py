"""The distill path's providers: grpo-kernels' two-head divergence against TRL's ``ChunkedDivergenceFunction``,
Liger-Kernel's fused (Triton) and chunked JSD, eager PyTorch and ``torch.compile`` of it, on the same inputs.

Every provider computes TRL 1.16's ``_chunked_divergence_loss``: the divergence ``harness.DISTILL_BETA`` selects
(TRL's convention: beta 0 KL(teacher || student), 1 KL(student || teacher), else the generalized JSD with mixture
(1 - beta) p_student + beta p_teacher; Liger's ``beta`` / ``jsd_beta`` is the same: its kernels weight the
teacher's distribution by beta in the mixture and special-case 0 and 1 the same way), temperature 1, the mean over
the valid tokens, the gradient to the student only. The no-grad builders (``"distill_nograd"``) return the per-token
divergence (B, T) under ``torch.no_grad()``; Liger has no such call (both of its losses make the gradients in their
forward whatever autograd's mode), so it is not in that case.

``check_value`` runs before the timing: each provider's first value against the float64 divergence of the same
(rounded) inputs, by the project's three-way rule (tests/support/tolerances.py), the plain-PyTorch term being the
eager computation in the inputs' dtype. Ours outside the bound fails the benchmark; a peer outside it is timed and
its note says so.
"""
from __future__ import annotations

import torch

import grpo_kernels as gk
from grpo_kernels.distill import plan_of
from grpo_kernels.distill_config import DistillLossConfig
from grpo_kernels.distill_reference import head_logits, loss_from_divergence, token_divergence

from .harness import DISTILL_BETA, Case
from .providers import Provider, trl_trainer_utils
from .work import WorkDecl, distill_multiples


def distill_config(case: Case) -> DistillLossConfig:
    return DistillLossConfig(beta=DISTILL_BETA[case.variant], temperature=1.0)


def _flat(case: Case) -> tuple:
    """(student hidden (N, H_s), its weight, teacher hidden (N, H_t), its weight, valid (N,) bool)."""
    return (case.hidden.reshape(-1, case.shape.H), case.weight, case.teacher_hidden.reshape(-1, case.shape.H_teacher),
            case.teacher_weight, case.mask.reshape(-1))


# ----------------------------------------------------------------------------------------------------------------
# eager PyTorch: the package's reference maths (grpo_kernels.distill_reference) on both heads' full logits


def _eager_fns(beta: float):
    cfg = DistillLossConfig(beta=beta)

    def loss(hidden, weight, teacher_hidden, teacher_weight, mask):
        xs = hidden @ weight.T  # (B, T, V) in the inputs' dtype, kept for autograd
        with torch.no_grad():
            xt = teacher_hidden @ teacher_weight.T
        div, ent = token_divergence(xs, xt, cfg)  # fp32 from here
        return loss_from_divergence(div, ent, mask)[0]

    def divergence(hidden, weight, teacher_hidden, teacher_weight):
        return token_divergence(hidden @ weight.T, teacher_hidden @ teacher_weight.T, cfg)[0]
    return loss, divergence


def _eager_builders(wrap):
    """``wrap(key, f)``: the identity or ``torch.compile`` (one compiled callable per divergence and mode)."""
    def loss(c):
        f = wrap(("loss", DISTILL_BETA[c.variant]), _eager_fns(DISTILL_BETA[c.variant])[0])
        return lambda: f(c.hidden, c.weight, c.teacher_hidden, c.teacher_weight, c.mask)

    def divergence(c):
        f = wrap(("divergence", DISTILL_BETA[c.variant]), _eager_fns(DISTILL_BETA[c.variant])[1])
        return lambda: f(c.hidden, c.weight, c.teacher_hidden, c.teacher_weight)
    return {"distill": loss, "distill_nograd": divergence}


_COMPILED: dict = {}


def _compiled(key, fn):
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(fn)
    return _COMPILED[key]


# ----------------------------------------------------------------------------------------------------------------
# grpo-kernels


def _ours_note(fn, case: Case, mode: str, args: tuple, kwargs: dict) -> None:
    """The path our planner picks for this call, in the report's note; its FLOPs must be the declared ones (else
    the rates would be wrong: a benchmark error, not a result)."""
    with torch.no_grad() if mode == "nograd" else torch.enable_grad():
        plan = plan_of(fn, args, kwargs)
    jsd = 0.0 < DISTILL_BETA[case.variant] < 1.0
    declared = sum(distill_multiples(OURS.work, mode, jsd))
    if plan.flops_nhv != declared:
        raise AssertionError(f"{plan.path} runs {plan.flops_nhv} N H V, the work model declares {declared}: "
                             "update benchmarks/distill_providers.py")
    OURS.notes["distill_nograd" if mode == "nograd" else "distill"] = (
        ("no-grad: " if mode == "nograd" else "") + f"{fn.__name__}: path {plan.path} ({plan.flops_nhv} N H V by its "
        f"plan, {plan.chunk_rows} rows per chunk)")


def _ours_loss(case: Case):
    cfg = distill_config(case)
    args = (case.hidden, case.weight, case.teacher_hidden, case.teacher_weight, case.mask)
    _ours_note(gk.fused_linear_distill_loss, case, "fwdbwd", args, {"config": cfg})
    return lambda: gk.fused_linear_distill_loss(*args, config=cfg)[0]


def _ours_divergence(case: Case):
    cfg = distill_config(case)
    args = (case.hidden, case.weight, case.teacher_hidden, case.teacher_weight)
    _ours_note(gk.linear_token_divergence, case, "nograd", args, {"mask": case.mask, "config": cfg})
    return lambda: gk.linear_token_divergence(*args, mask=case.mask, config=cfg)[0]


# ----------------------------------------------------------------------------------------------------------------
# TRL


def _trls_own(obj):
    """``obj`` itself, after checking it is TRL's code (not a stand-in ``grpo_kernels.patch_trl()`` left bound)."""
    module = getattr(obj, "__module__", "") or ""
    if not module.startswith("trl."):
        raise RuntimeError(f"{getattr(obj, '__qualname__', obj)} comes from {module}, not TRL: unpatch_trl() first")
    return obj


def _trl_function():
    trl_trainer_utils(TRL.notes, "distill")  # chunked_divergence imports trl.trainer.utils at its top
    from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
    from trl.kernels.chunked_logprob import _use_triton

    return _trls_own(ChunkedDivergenceFunction), _use_triton


def _trl_loss(case: Case):
    """TRL's own loss, ``_chunked_divergence_loss`` (it projects only the valid rows on Triton devices)."""
    trl_trainer_utils(TRL.notes, "distill")
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    _trls_own(_chunked_divergence_loss)
    beta = DISTILL_BETA[case.variant]
    return lambda: _chunked_divergence_loss(case.hidden, case.teacher_hidden, case.weight, case.teacher_weight,
                                            case.mask, beta, temperature=1.0)[0]


def _trl_per_token(case: Case):
    """``ChunkedDivergenceFunction.apply`` as ``_chunked_divergence_loss`` calls it: (N,) divergences, the valid
    rows only on Triton devices (0 elsewhere), every row otherwise (masked to 0 afterwards)."""
    f, use_triton = _trl_function()
    hs, ws, ht, wt, valid = _flat(case)
    beta = DISTILL_BETA[case.variant]

    def per_token():
        compact = use_triton(hs.device)
        h_s, h_t = (hs[valid], ht[valid]) if compact else (hs, ht)
        div = f.apply(h_s, ws, None, h_t, wt, None, beta, 1.0, 1.0, None, 1.0, None)[0]
        if compact:
            return torch.zeros(valid.shape, dtype=div.dtype, device=div.device).masked_scatter(valid, div)
        return div.masked_fill(~valid, 0)
    return per_token, valid


def _trl_function_loss(case: Case):
    """The fallback where TRL's trainer module does not import: its reduction on the function's output."""
    per_token, valid = _trl_per_token(case)
    return lambda: per_token().sum() / valid.sum().clamp(min=1)


def _trl_divergence(case: Case):
    per_token, _ = _trl_per_token(case)
    return lambda: per_token().view(case.shape.B, case.shape.T)


# ----------------------------------------------------------------------------------------------------------------
# Liger-Kernel


def _labels(case: Case) -> torch.Tensor:
    """Liger's masking: a label per token, ``ignore_index`` (-100) where the mask drops it."""
    return case.ids.reshape(-1).masked_fill(~case.mask.reshape(-1), -100)


def _liger_chunked(case: Case, compiled: bool = True):
    from liger_kernel.chunked_loss import LigerFusedLinearJSDLoss

    # weight_hard_loss 0: the distillation term alone (Liger then skips the CE log-softmax); chunk_size its default
    module = LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=DISTILL_BETA[case.variant],
                                     ignore_index=-100, temperature=1.0, compiled=compiled, chunk_size=1024)
    hs, ws, ht, wt, _ = _flat(case)
    labels = _labels(case)
    return lambda: module(hs, ws, ht, wt, labels)


def _liger_fused(case: Case):
    from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

    module = LigerFusedLinearJSD(jsd_beta=DISTILL_BETA[case.variant], ignore_index=-100, temperature=1.0)
    hs, ws, ht, wt, _ = _flat(case)
    labels = _labels(case)
    return lambda: module(hs, ws, ht, wt, labels)


# ----------------------------------------------------------------------------------------------------------------
# the check before timing

_TRUTH: dict = {}


def _mean_divergence(case: Case, dtype: torch.dtype, chunk: int = 1024) -> float:
    """The mean divergence over the valid tokens with both heads' logits in ``dtype`` (float64: the truth of the
    rounded inputs; the inputs' dtype: plain PyTorch's), a row chunk at a time (no N x V tensor at the GPU shape)."""
    hs, ws, ht, wt, valid = _flat(case)
    cfg = distill_config(case)
    ws_d, wt_d = ws.detach().to(dtype), wt.detach().to(dtype)
    total = torch.zeros((), dtype=torch.float64, device=hs.device)
    with torch.no_grad():
        for r0 in range(0, hs.shape[0], chunk):
            r = slice(r0, r0 + chunk)
            div = token_divergence(head_logits(hs[r], ws_d, None, dtype), head_logits(ht[r], wt_d, None, dtype),
                                   cfg)[0]
            total += div.double().masked_fill(~valid[r], 0).sum()
    return float(total / valid.sum().clamp(min=1))


def check_value(case: Case, provider: Provider, mode: str, value: float) -> str:
    """The three-way rule on the first call's value (loss, or mean divergence under no_grad: the same number):
    ``|value - truth| <= K |plain - truth| + ATOL[dtype]``, relative to max(1, |truth|). Raises for ours; returns
    a note for a peer outside the bound, else ""."""
    from tests.support.tolerances import assert_errors_three_way

    key = (case.shape, case.variant, case.device, case.dtype)
    if key not in _TRUTH:
        _TRUTH[key] = (_mean_divergence(case, torch.float64), _mean_divergence(case, case.dtype))
    truth, plain = _TRUTH[key]
    try:
        assert_errors_three_way(abs(value - truth), abs(plain - truth), case.dtype,
                                f"{provider.name}'s distillation {'divergence' if mode == 'nograd' else 'loss'} "
                                f"against float64", max(1.0, abs(truth)))
    except AssertionError as exc:
        if provider.kind == "ours":
            raise
        return f"its value is outside the three-way bound ({exc})"
    return ""


# ----------------------------------------------------------------------------------------------------------------
# the registry, in report order

_DISTILL_NOTE = "no-grad: the per-token divergence under no_grad"
OURS = Provider("ours", "ours", {"distill": _ours_loss, "distill_nograd": _ours_divergence},
                triton_on_cuda=("distill",), grads_in_forward=("distill",), check=check_value,
                work=WorkDecl(skips_padded={"distill": "always"}, distill="grads-in-forward",
                              source="grpo_kernels distillation (docs/DESIGN.md section 8): on CUDA distill.fast (per "
                                     "chunk of valid rows both heads' cuBLAS fp32 logits, one Triton epilogue, the "
                                     "student's dH / dW GEMMs, all in the forward), distill.no_grad under no_grad; on "
                                     "CPU distill.torch_fast / distill.torch (PyTorch row chunks); mask= compacts"),
                notes={"distill": "fused_linear_distill_loss", "distill_nograd": "linear_token_divergence"})
_EAGER_SRC = ("both heads' full logits (hidden @ W.T in the inputs' dtype; the student's kept for autograd), "
              "grpo_kernels.distill_reference.token_divergence in fp32, loss_from_divergence")
EAGER = Provider("eager", "peer", _eager_builders(lambda key, f: f), check=check_value,
                 work=WorkDecl(distill="materialize", source=_EAGER_SRC),
                 notes={"distill": "the package's reference maths on full logits", "distill_nograd": _DISTILL_NOTE})
COMPILE = Provider("compile", "peer", _eager_builders(_compiled), check=check_value,
                   work=WorkDecl(distill="materialize", source=_EAGER_SRC),
                   notes={"distill": "torch.compile of the eager provider (compilation untimed)",
                          "distill_nograd": "no-grad: torch.compile of the eager per-token divergence"})
TRL = Provider("trl-chunked", "peer", {"distill": _trl_loss, "distill_nograd": _trl_divergence}, requires=("trl",),
               triton_on_cuda=("distill",), check=check_value,
               work=WorkDecl(skips_padded={"distill": "triton"}, distill="recompute", distill_jsd_passes=2,
                             source="trl/kernels/chunked_divergence.py: per (4096 x 32768) tile both heads' GEMMs "
                                    "and a fold (Triton on CUDA, torch elsewhere); the JSD projects both heads "
                                    "again for the mixture; the backward recomputes both, then the student's dH and "
                                    "dW; only the valid rows on Triton devices"),
               fallbacks={"distill": ("_chunked_divergence_loss", _trl_function_loss,
                                      "ChunkedDivergenceFunction with _chunked_divergence_loss's reduction")},
               notes={"distill": "trl.trainer.distillation_trainer._chunked_divergence_loss",
                      "distill_nograd": "no-grad: ChunkedDivergenceFunction under no_grad"})
LIGER_CHUNKED = Provider(
    "liger-chunked", "peer", {"distill": _liger_chunked}, requires=("liger_kernel.chunked_loss",),
    grads_in_forward=("distill",), check=check_value,
    work=WorkDecl(distill="grads-in-forward",
                  source="liger_kernel/chunked_loss/fused_linear_distillation.py: per chunk of 1024 rows both "
                         "heads' logits (the teacher's under no_grad), torch.func.grad_and_value for the student's "
                         "dH and dW, all in the forward, every row"),
    fallbacks={"distill": ("compiled=True", lambda c: _liger_chunked(c, compiled=False),
                           "measured with compiled=False")},
    notes={"distill": "LigerFusedLinearJSDLoss(weight_hard_loss=0, weight_soft_loss=1, compiled=True, "
                      "chunk_size=1024), labels -100 where masked"})
LIGER_FUSED = Provider(
    "liger-fused", "peer", {"distill": _liger_fused}, requires=("liger_kernel.transformers.fused_linear_jsd",),
    triton=("distill",), grads_in_forward=("distill",), check=check_value,
    work=WorkDecl(distill="grads-in-forward",
                  source="liger_kernel/ops/fused_linear_jsd.py: per chunk of rows both heads' fp32 logits, "
                         "log-softmaxes, the Triton JSD kernel, the student's dH and dW, all in the forward, every "
                         "row"),
    notes={"distill": "LigerFusedLinearJSD (Triton), labels -100 where masked"})

DISTILL_PROVIDERS = (OURS, EAGER, COMPILE, LIGER_CHUNKED, LIGER_FUSED, TRL)
