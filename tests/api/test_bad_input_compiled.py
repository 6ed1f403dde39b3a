"""Bad input never becomes a number, eager or compiled (docs/api.md, "Errors"): every public entry point, on both
impls, refuses each kind of bad value. Eager raises the ValueError naming the argument; under ``torch.compile`` the
same device-side check is part of the graph and the compiled call raises a RuntimeError with the same message (a
device-side assert on a GPU), never a plausible log-prob read from the next row.

The kinds: an id out of [0, V) (above and below), a negative ``is_ratio`` at a valid position, malformed
``cu_seqlens`` (not starting at 0, decreasing, not ending at N), a NaN ``num_items_in_batch``. Each entry point is
compiled once per impl (``dynamic=False``): the bad values are values, not shapes, so each case runs the same graph
(a recompile would also be fine, but the cases then prove that the check is in the graph, not in a guard).
Good inputs through the same compiled function give eager's numbers (the checks pass)."""
from __future__ import annotations

import functools

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import liger
from grpo_kernels.integrations.trl import TRLLogProbFunction

from ..support.tolerances import assert_three_way

B, T, V, H = 2, 4, 37, 8
IMPLS = ["torch", "triton"]


def _good(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    x = dict(hidden=torch.randn(B, T, H, generator=g), weight=torch.randn(V, H, generator=g) / 3,
             ids=torch.randint(0, V, (B, T), generator=g), adv=torch.randn(B, generator=g),
             mask=torch.ones(B, T), is_ratio=torch.rand(B, T, generator=g) + 0.5,
             num_items=torch.tensor(float(B * T)), old=torch.randn(B, T, generator=g) * 0.1 - 3.0)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in x.items()}


def _bad(kind: str) -> dict:
    x = _good()
    if kind == "id_above":
        x["ids"][1, 2] = V + 2
    elif kind == "id_below":
        x["ids"][0, 1] = -1
    elif kind == "is_ratio":
        x["is_ratio"][1, 0] = -0.5
    elif kind == "num_items_nan":
        x["num_items"] = torch.tensor(float("nan"))
    return x


# entry point -> (callable(x, impl) -> tensor, the argument its message names per kind, the kinds it takes)
def _token_logprobs(x, impl):
    return gk.token_logprobs(x["hidden"] @ x["weight"].T, x["ids"], impl=impl)


def _linear_token_logprobs(x, impl):
    return gk.linear_token_logprobs(x["hidden"], x["weight"], x["ids"], impl=impl)


def _loss_kwargs(x):
    return dict(old_logps=x["old"], is_ratio=x["is_ratio"], num_items_in_batch=x["num_items"])


def _grpo_loss(x, impl):
    return gk.grpo_loss(x["hidden"] @ x["weight"].T, x["ids"], x["adv"], x["mask"], impl=impl, **_loss_kwargs(x))[0]


def _fused_linear_grpo_loss(x, impl):
    return gk.fused_linear_grpo_loss(x["hidden"], x["weight"], x["ids"], x["adv"], x["mask"], impl=impl,
                                     **_loss_kwargs(x))[0]


def _grpo_loss_module(x, impl):
    return gk.GRPOLoss(impl=impl)(x["hidden"] @ x["weight"].T, x["ids"], x["adv"], x["mask"], **_loss_kwargs(x))[0]


def _fused_module(x, impl):
    return gk.FusedLinearGRPOLoss(impl=impl)(x["hidden"], x["weight"], x["ids"], x["mask"], x["adv"],
                                             old_logps=x["old"], is_ratio=x["is_ratio"],
                                             num_items_in_batch=x["num_items"])[0]


def _liger_module(x, impl):
    module = liger.LigerFusedLinearGRPOLoss(beta=0.0)
    module.impl = impl
    return module(x["hidden"], x["weight"], x["ids"], x["mask"], x["adv"], old_per_token_logps=x["old"],
                  vllm_is_ratio=x["is_ratio"], num_items_in_batch=x["num_items"])[0]


def _liger_triton_grpo_loss(x, impl):
    # Liger's (B, L + 1, V) logits: the last position scores nothing; impl: the planner's choice (auto) on CPU is the
    # torch path, so this entry point is run once (impl ignored) with both of its own paths (reduce True / False)
    logits = torch.cat([x["hidden"], x["hidden"][:, -1:]], 1) @ x["weight"].T
    loss, _ = liger.triton_grpo_loss(logits, x["old"], None, x["ids"], x["adv"], x["mask"], beta=0.0,
                                     vllm_is_ratio=x["is_ratio"], num_items_in_batch=x["num_items"], reduce=True,
                                     inplace=False)
    return loss


def _trl_function(x, impl):
    logp = TRLLogProbFunction.apply(x["hidden"].reshape(-1, H), x["weight"], None, x["ids"].reshape(-1), 1.0, 4096,
                                    None, 1.0, ("log_probs", "entropy"))[0]
    return logp


LOGPROB_KINDS = ("id_above", "id_below")
LOSS_KINDS = LOGPROB_KINDS + ("is_ratio", "num_items_nan")
ENTRY_POINTS = {
    "token_logprobs": (_token_logprobs, LOGPROB_KINDS),
    "linear_token_logprobs": (_linear_token_logprobs, LOGPROB_KINDS),
    "grpo_loss": (_grpo_loss, LOSS_KINDS),
    "fused_linear_grpo_loss": (_fused_linear_grpo_loss, LOSS_KINDS),
    "GRPOLoss": (_grpo_loss_module, LOSS_KINDS),
    "FusedLinearGRPOLoss": (_fused_module, LOSS_KINDS),
    "liger.LigerFusedLinearGRPOLoss": (_liger_module, LOSS_KINDS),
    "liger.triton_grpo_loss": (_liger_triton_grpo_loss, LOSS_KINDS),
    "patch_trl's TRLLogProbFunction": (_trl_function, LOGPROB_KINDS),
}
NAMED = {"id_above": "ids must lie in [0, V)", "id_below": "ids must lie in [0, V)",
         "is_ratio": "is_ratio must be >= 0", "num_items_nan": "num_items_in_batch must be > 0"}
# The impl-independent entry points run once: Liger's triton_grpo_loss and TRL's function take no impl argument
# (the planner's auto choice runs; GRPO_KERNELS_IMPL picks the Triton impl for the second run)
IMPL_FREE = ("liger.triton_grpo_loss", "patch_trl's TRLLogProbFunction")


@functools.lru_cache(maxsize=None)
def _compiled(name: str):
    return torch.compile(ENTRY_POINTS[name][0], fullgraph=True, dynamic=False)


def _call(name, impl, mode, x, monkeypatch):
    if name in IMPL_FREE:
        monkeypatch.setenv("GRPO_KERNELS_IMPL", impl)
    fn = ENTRY_POINTS[name][0] if mode == "eager" else _compiled(name)
    return fn(x, impl)


CASES = [pytest.param(name, impl, mode, id=f"{name}-{impl}-{mode}") for name in ENTRY_POINTS for impl in IMPLS
         for mode in ("eager", "compiled")]


@pytest.mark.parametrize("name, impl, mode", CASES)
def test_each_bad_value_is_refused_and_good_values_pass(name, impl, mode, monkeypatch):
    good = _call(name, impl, mode, _good(), monkeypatch)
    if mode == "compiled":  # the checks pass on good values: eager's numbers, up to inductor's own fusion
        truth = _call(name, "torch", "eager", _good(torch.float64), monkeypatch)
        eager = _call(name, impl, "eager", _good(), monkeypatch)
        assert_three_way(good, eager, truth, torch.float32, f"{name} compiled on good inputs")
    assert torch.isfinite(good).all()
    for kind in ENTRY_POINTS[name][1]:
        error = ValueError if mode == "eager" else RuntimeError
        with pytest.raises(error, match=NAMED[kind].replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
            out = _call(name, impl, mode, _bad(kind), monkeypatch)
            pytest.fail(f"{kind}: returned {out.flatten()[:4].tolist()} instead of refusing")


def _packed(x, cu):
    """The (N, H) packed call of the good batch's tokens, two sequences of T tokens."""
    return dict(hidden=x["hidden"].reshape(-1, H), ids=x["ids"].reshape(-1), mask=x["mask"].reshape(-1), cu=cu)


def _packed_grpo_loss(p, w, adv, impl):
    return gk.grpo_loss(p["hidden"] @ w.T, p["ids"], adv, p["mask"], impl=impl, cu_seqlens=p["cu"])[0]


def _packed_fused(p, w, adv, impl):
    return gk.fused_linear_grpo_loss(p["hidden"], w, p["ids"], adv, p["mask"], impl=impl, cu_seqlens=p["cu"])[0]


BAD_CU = {"not starting at 0": ([1, T, 2 * T], "cu_seqlens must start at 0"),
          "decreasing": ([0, T + 3, T + 1, 2 * T], "cu_seqlens must be non-decreasing"),
          "not ending at N": ([0, T, 2 * T - 1], "cu_seqlens must end at the number of packed tokens")}


@pytest.mark.parametrize("mode", ["eager", "compiled"])
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("fn", [_packed_grpo_loss, _packed_fused], ids=["grpo_loss", "fused_linear_grpo_loss"])
def test_malformed_cu_seqlens_is_refused(fn, impl, mode):
    x = _good()
    call = fn if mode == "eager" else torch.compile(fn, fullgraph=True, dynamic=False)
    good = call(_packed(x, torch.tensor([0, T, 2 * T])), x["weight"], x["adv"], impl)
    assert torch.isfinite(good)
    for what, (cu, message) in BAD_CU.items():
        adv = x["adv"] if len(cu) == B + 1 else torch.cat([x["adv"], x["adv"][:1]])
        error = ValueError if mode == "eager" else RuntimeError
        with pytest.raises(error, match=message):
            out = call(_packed(x, torch.tensor(cu)), x["weight"], adv, impl)
            pytest.fail(f"{what}: returned {out.item()} instead of refusing")
