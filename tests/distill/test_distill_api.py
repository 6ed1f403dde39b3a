"""The distillation API's contract: bad input is a ValueError naming the argument; the teacher gets no gradient even
when its tensors require one (TRL's); the entropy is not differentiable; non-finite values propagate (a NaN at a
valid token reaches its divergence and the loss, one at a masked token does not); the module equals the function;
``explain`` prints each plan (path, why, FLOPs, transient memory) on meta tensors."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.distill_config import DistillLossConfig

from ..support.distill_cases import ALL_OPTIONS, make_heads, ours_loss



def _args(heads):
    return heads["sh"], heads["sw"], heads["th"], heads["tw"]


BAD = [
    ("teacher_weight", dict(tw=torch.randn(36, 12)), "teacher_weight must have the student's vocabulary V = 37"),
    ("student_weight", dict(sw=torch.randn(37, 9)), r"student_weight must have shape \(V, H\) = \(V, 8\)"),
    ("teacher_weight", dict(tw=torch.randn(37, 8)), r"teacher_weight must have shape \(V, H\) = \(V, 12\)"),
    ("teacher_hidden", dict(th=torch.randn(2, 4, 12)), "teacher_hidden must have student_hidden's leading dims"),
    ("student_bias", dict(sb=torch.randn(36)), r"student_bias must have shape \(V,\) = \(37,\)"),
    ("teacher_weight", dict(tw=torch.randn(37, 12, dtype=torch.float64)), "teacher_weight dtype"),
    ("student_hidden", dict(sh=torch.randn(10)), "student_hidden must have 2 or 3 dimensions"),
]


@pytest.mark.parametrize("name,change,message", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_tensors_raise_naming_the_argument(name, change, message):
    heads = make_heads()
    heads.update(change)
    for fn in (gk.linear_token_divergence, gk.fused_linear_distill_loss):
        with pytest.raises(ValueError, match=message):
            fn(*_args(heads), student_bias=heads["sb"])


@pytest.mark.parametrize("option,value,message", [
    ("beta", 1.5, r"beta must be in \[0, 1\]"), ("beta", -0.1, r"beta must be in \[0, 1\]"),
    ("beta", float("nan"), "beta must be a finite number"), ("temperature", 0.0, "temperature must be"),
    ("temperature", -1.0, "temperature must be"), ("student_softcap", 0.0, "student_softcap must be > 0"),
    ("teacher_logit_scale", float("inf"), "teacher_logit_scale must be a finite number"),
    ("round_logits", "fp8", "round_logits must be None or one of"), ("memory_budget", -1, "memory_budget must be"),
    ("batch_invariant", 1, "batch_invariant must be a bool"), ("no_such_option", 1, "unknown distillation option"),
])
def test_bad_options_raise_naming_the_option(option, value, message):
    heads = make_heads()
    with pytest.raises(ValueError, match=message):
        gk.fused_linear_distill_loss(*_args(heads), **{option: value})
    with pytest.raises(ValueError, match=message):
        gk.FusedLinearDistillLoss(**{option: value})


def test_bad_loss_arguments_raise():
    heads = make_heads()
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 5\)"):
        gk.fused_linear_distill_loss(*_args(heads), torch.ones(2, 4))
    for n in (0, -3.0, float("nan"), torch.tensor(0.0)):
        with pytest.raises(ValueError, match="num_items_in_batch must be"):
            gk.fused_linear_distill_loss(*_args(heads), num_items_in_batch=n)
    with pytest.raises(ValueError, match=r"student_hidden must have shape \(N, H\) with cu_seqlens"):
        gk.fused_linear_distill_loss(*_args(heads), cu_seqlens=torch.tensor([0, 5, 10]))
    flat = {k: v.reshape(10, -1) if k in ("sh", "th") else v for k, v in heads.items()}
    with pytest.raises(ValueError, match="cu_seqlens must end at the number of packed tokens N = 10"):
        gk.fused_linear_distill_loss(*_args(flat), cu_seqlens=torch.tensor([0, 5, 9]))
    with pytest.raises(ValueError, match="config must be a DistillLossConfig"):
        gk.fused_linear_distill_loss(*_args(heads), config=gk.GRPOLossConfig())


def test_teacher_gets_no_gradient():
    """The teacher's hidden, weight and bias requiring grad change nothing: no gradient reaches them, and the
    student's are the same bits as with a frozen teacher (TRL's ChunkedDivergenceFunction returns None for them)."""
    cfg = DistillLossConfig(beta=0.5, **ALL_OPTIONS)
    heads = make_heads(bias=True, seed=3)
    frozen = ours_loss(heads, cfg)
    th, tw, tb = (heads[k].clone().requires_grad_(True) for k in ("th", "tw", "tb"))
    sh = heads["sh"].clone().requires_grad_(True)
    loss, _ = gk.fused_linear_distill_loss(sh, heads["sw"], th, tw, heads["mask"], teacher_bias=tb,
                                           student_bias=heads["sb"], config=cfg)
    loss.backward()
    assert th.grad is None and tw.grad is None and tb.grad is None
    assert torch.equal(loss.detach(), frozen[0]) and torch.equal(sh.grad, frozen[1][0])
    div, ent = gk.linear_token_divergence(sh, heads["sw"], th, tw, config=cfg)
    assert div.requires_grad and not ent.requires_grad


@pytest.mark.parametrize("impl", ["torch", pytest.param("triton", marks=[pytest.mark.interpreter,
                                                                          pytest.mark.slow])])
def test_non_finite_values_propagate(impl, knobs):
    """A NaN in a valid token's student (or teacher) hidden state makes that token's divergence NaN and the loss
    NaN; the other tokens stay finite; a NaN at a masked token changes nothing (it is not computed)."""
    knobs(fast_path_min_rows=1)
    cfg = DistillLossConfig(beta=0.5)
    for model in ("sh", "th"):
        heads = make_heads(seed=4)
        heads[model] = heads[model].clone()
        heads[model][0, 2, 0] = float("nan")
        div, _ = gk.linear_token_divergence(*_args(heads), mask=heads["mask"], config=cfg, impl=impl)
        assert torch.isnan(div[0, 2]) and torch.isfinite(div[1]).all()
        assert torch.isnan(ours_loss(heads, cfg, impl=impl)[0])
        masked = make_heads(seed=4)
        clean = ours_loss(masked, cfg, impl=impl)
        masked[model] = masked[model].clone()
        masked[model][0, 1, 0] = float("nan")  # make_heads masks token (0, 1)
        poisoned = ours_loss(masked, cfg, impl=impl)
        assert torch.equal(poisoned[0], clean[0]) and torch.equal(poisoned[1][0], clean[1][0])


def test_module_equals_the_function_and_overrides_apply():
    heads = make_heads(bias=True, seed=5)
    cfg = DistillLossConfig(beta=0.3, temperature=0.8)
    module = gk.FusedLinearDistillLoss(cfg, student_softcap=3.0)
    assert module.config == cfg.replace(student_softcap=3.0)
    a = module(*_args(heads), heads["mask"], student_bias=heads["sb"], teacher_bias=heads["tb"])
    b = gk.fused_linear_distill_loss(*_args(heads), heads["mask"], student_bias=heads["sb"], teacher_bias=heads["tb"],
                                     config=cfg, student_softcap=3.0)
    assert torch.equal(a[0], b[0]) and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    assert set(a[1]) == {"divergence", "entropy", "entropy_sum", "num_tokens"}


def _meta_heads(N=8192, Hs=2048, Ht=4096, V=151936, dtype=torch.bfloat16):
    meta = dict(device="meta", dtype=dtype)
    return (torch.empty(N, Hs, requires_grad=True, **meta), torch.empty(V, Hs, requires_grad=True, **meta),
            torch.empty(N, Ht, **meta), torch.empty(V, Ht, **meta))


def test_explain_prints_the_plans():
    """At a Qwen-sized vocabulary with a wider teacher: the loss takes distill.fast with the default budget
    (the accumulator added to it), distill.light over vocabulary tiles in 256 MiB; the per-token function
    distill.light; no gradient distill.no_grad; each with its FLOPs per head and its transient items."""
    args = _meta_heads()
    fast = gk.explain("fused_linear_distill_loss", *args, beta=0.5)
    assert "path distill.fast" in fast and "fp32 d student weight / d bias accumulators: 1.16 GiB" in fast
    assert "note: matmul FLOPs: 6 N V H_student + 2 N V H_teacher (H_student 2048, H_teacher 4096)" in fast
    assert "generalized JSD, mixture (1 - 0.5) p_student + 0.5 p_teacher" in fast
    light = gk.explain(gk.fused_linear_distill_loss, *args, beta=1.0, memory_budget=256 << 20)
    assert "path distill.light" in light and "vocabulary columns per tile:" in light
    assert "reverse KL(student || teacher) (beta = 1)" in light
    token = gk.explain("linear_token_divergence", *args, beta=0.0, temperature=0.7)
    assert "path distill.light" in token and "the gradient of what follows is not known" in token
    with torch.no_grad():
        assert "path distill.no_grad" in gk.explain("linear_token_divergence", *args)
    with pytest.raises(ValueError, match="memory_budget=1024 bytes is below"):
        gk.explain(gk.fused_linear_distill_loss, *args, memory_budget=1024)


def test_api_md_shows_explains_own_output():
    """docs/api.md's two distillation plans are explain's output at their shape, verbatim (the machine-dependent
    fp32-output GEMM line left out): the documentation cannot drift from the planner."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "api.md").read_text()
    args = _meta_heads(Hs=1536, Ht=3584)
    for kw in ({}, {"memory_budget": 512 << 20}):
        plan = gk.explain("fused_linear_distill_loss", *args, beta=0.5, **kw)
        shown = "\n".join(line for line in plan.splitlines() if not line.startswith("  fp32-output GEMM"))
        assert shown in text, f"docs/api.md does not show this plan:\n{shown}"


def test_autocast_runs_the_heads_in_the_autocast_dtype():
    """Under autocast each head's hidden states and weight run in the autocast dtype, like nn.Linear, and each bias
    stays in its own dtype, added in fp32 to the fp32 logits (TRL's ``_project``): the loss is the one of the
    bf16-cast hidden states and weights with the fp32 biases (the same operations: bitwise), and fp32 master weights
    get the fp32 accumulators as their gradients (the bf16 call's gradients are those rounded once); a bias rounded
    to bf16 would change the loss."""
    cfg = DistillLossConfig(beta=0.5, **ALL_OPTIONS)
    heads = make_heads(bias=True, seed=6)
    sh, sw = heads["sh"].clone().requires_grad_(True), heads["sw"].clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = gk.fused_linear_distill_loss(sh, sw, heads["th"], heads["tw"], heads["mask"], config=cfg,
                                               student_bias=heads["sb"], teacher_bias=heads["tb"], impl="torch")
    loss.backward()
    bf16 = {k: None if v is None or not v.is_floating_point() else v.to(torch.bfloat16) for k, v in heads.items()}
    bf16["mask"], bf16["weights"], bf16["sb"], bf16["tb"] = heads["mask"], heads["weights"], heads["sb"], heads["tb"]
    want, grads, _ = ours_loss(bf16, cfg, impl="torch")
    rounded_bias = dict(bf16, sb=heads["sb"].bfloat16(), tb=heads["tb"].bfloat16())
    assert not torch.equal(ours_loss(rounded_bias, cfg, impl="torch")[0].float(), loss), "the biases' test is blind"
    assert sh.grad.dtype == sw.grad.dtype == torch.float32
    assert torch.equal(loss, want) and torch.equal(sw.grad.to(torch.bfloat16), grads[1])
