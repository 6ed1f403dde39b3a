"""patch_trl and TRL 1.16's DistillationTrainer: the two swapped seams against TRL's own on every option, and TRL's
trainer stock vs patched (offline, CPU, a tiny student and a wider teacher: tests/support/trl_distill_runs.py).

- ``ChunkedDivergenceFunction`` (ours: ``TRLDivergenceFunction`` on ``linear_token_divergence``) against TRL's own (its
  PyTorch tiles on CPU) and the float64 truth (``distill_reference``), three-way: betas 0, 1 and between, temperature,
  each model's logit scale and soft cap, biases, H_t != H_s;
- ``_chunked_divergence_loss`` (ours: ``TRLDistillLoss`` on ``fused_linear_distill_loss``) alike, with a mask and
  ``num_items_in_batch``;
- what is handed back to TRL (warned once; strict: a ValueError naming the option), unpatching, the report;
- the trainer: every logged metric and final parameter of the patched run within the three-way rule of the stock
  one, no call left on TRL's function or loss (counted).
"""
import warnings

import pytest
import torch

pytest.importorskip("trl")
import trl.trainer.distillation_trainer as trl_distill_trainer  # noqa: E402
from trl.kernels.chunked_divergence import ChunkedDivergenceFunction  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels.distill_config import DistillLossConfig  # noqa: E402
from grpo_kernels.distill_reference import reference_distill_loss  # noqa: E402
from grpo_kernels.integrations.trl import patch_trl, unpatch_trl  # noqa: E402
from grpo_kernels.integrations.trl_distill import TRLDistillLoss, TRLDivergenceFunction  # noqa: E402

from ..support.tolerances import ATOL, assert_same_maths, assert_three_way, grad_scale, max_err  # noqa: E402
from ..support.trl_distill_runs import (  # noqa: E402
    assert_function_three_way, compare_runs, function_truth, head_inputs, run_function,
)
from ..support.trl_runs import assert_informative  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")
TRL_LOSS = trl_distill_trainer._chunked_divergence_loss

# (beta, temperature, student scale, student cap, teacher scale, teacher cap): TRL's positional options.
OPTIONS = {
    "forward-kl": (0.0, 1.0, 1.0, None, 1.0, None),
    "reverse-kl-T": (1.0, 0.7, 1.0, None, 1.0, None),
    "jsd-scales": (0.5, 1.0, 1.7, None, 0.6, None),
    "jsd-caps-T": (0.3, 1.3, 1.0, 4.0, 1.0, 2.5),
    "forward-kl-all": (0.0, 0.8, -0.8, 3.0, 1.4, 6.0),
    "reverse-kl-caps": (1.0, 1.1, 0.9, 2.0, 1.0, 5.0),
    "jsd-near-0-flat-teacher": (0.02, 1.0, 1.2, None, 0.0, None),
    "jsd-near-1": (0.97, 0.9, 1.0, 3.5, 2.0, None),
}


def _swapped_function() -> TRLDivergenceFunction:
    patch_trl()
    fn = trl_distill_trainer.ChunkedDivergenceFunction
    assert isinstance(fn, TRLDivergenceFunction) and fn.original is ChunkedDivergenceFunction
    return fn


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_function_matches_trl_and_float64(name, bias):
    """Values and the student's gradients of sum(w D) (w per token), each option on its own and together; the
    teacher (H_t 12, the student's 8) gets no gradient, the entropy none either (``run_function``)."""
    fn = _swapped_function()
    options = OPTIONS[name]
    inputs = head_inputs(bias=bias)
    ours = run_function(fn, inputs, options)
    theirs = run_function(ChunkedDivergenceFunction, inputs, options)
    assert ours[0][0].dtype == torch.float32 and ours[0][0].shape == (13,)
    assert_function_three_way(ours, theirs, function_truth(inputs, options), name)


def test_function_same_width_and_one_token():
    """H_t == H_s, and a single token (N = 1)."""
    fn = _swapped_function()
    for inputs in (head_inputs(student_width=10, teacher_width=10), head_inputs(n=1, vocab=5)):
        options = OPTIONS["jsd-caps-T"]
        assert_function_three_way(run_function(fn, inputs, options), run_function(ChunkedDivergenceFunction, inputs,
                                                                                  options),
                                  function_truth(inputs, options), f"N {inputs[0].shape[0]}")


def test_function_float64_is_served_in_float64():
    """fp64 inputs on the CPU run on grpo_kernels in fp64 (TRL's function computes them in fp32): the float64 truth's
    maths in another order of its sums (``assert_same_maths``)."""
    fn = _swapped_function()
    options = OPTIONS["forward-kl-all"]
    inputs = head_inputs(dtype=torch.float64)
    (div, ent), grads = run_function(fn, inputs, options)
    (t_div, t_ent), t_grads = function_truth(inputs, options)
    assert div.dtype == ent.dtype == torch.float64
    assert_same_maths(div, t_div, torch.float64, "divergence")
    assert_same_maths(ent, t_ent, torch.float64, "entropy")
    for name, o, t in zip(("d hidden", "d weight", "d bias"), grads, t_grads):
        assert_same_maths(o, t, torch.float64, name, scale=grad_scale(t))


def test_function_under_bf16_autocast():
    """Under bf16 autocast both run each head on bf16 operands with fp32 logits (TRL 1.16's ``_project``): values and
    gradients by the fp32 rule against the float64 truth of the bf16-rounded operands, the plain fp32 reference on
    those operands the middle term; the values' middle term TRL's too, and ours at least as accurate as TRL, whose
    backward meets the bf16 head with d logits rounded to bf16 (ours 3e-7 there, TRL 1e-3). The fp32 biases stay
    unrounded in both (added to the fp32 logits): the truth rounds hidden states and weights only (a bias rounded
    to bf16 would be ~1e-3 off, far outside the fp32 bound)."""
    fn = _swapped_function()
    options = OPTIONS["jsd-caps-T"]
    inputs = head_inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        values, grads = run_function(fn, inputs, options)
        n_values, n_grads = run_function(ChunkedDivergenceFunction, inputs, options)
    rounded = [x.detach().clone().requires_grad_() if i in (2, 5) else x.detach().bfloat16().float().requires_grad_()
               for i, x in enumerate(inputs)]
    t_values, t_grads = function_truth(rounded, options)
    p_values, p_grads = function_truth(rounded, options, dtype=torch.float32)
    assert values[0].dtype == torch.float32
    for name, o, n, p, t in zip(("divergence", "entropy"), values, n_values, p_values, t_values):
        assert_three_way(o, n, t, torch.float32, f"{name} (TRL)")
        assert_three_way(o, p, t, torch.float32, f"{name} (fp32)")
    for name, o, n, p, t in zip(("d hidden", "d weight", "d bias"), grads, n_grads, p_grads, t_grads):
        assert_three_way(o, p, t, torch.float32, name, scale=grad_scale(t))
        assert max_err(o, t) <= max_err(n, t) + ATOL[torch.float32] * grad_scale(t), name


@pytest.mark.interpreter
def test_triton_paths_through_the_seam(monkeypatch, plans):
    """The Triton paths (the CUDA default; Triton's interpreter on CPU tensors here) behind both swapped seams: the
    function (recompute backward) and the loss (gradient in the forward), against TRL's own and the float64 truth."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    fn = _swapped_function()
    options = OPTIONS["jsd-caps-T"]
    inputs = head_inputs()
    assert_function_three_way(run_function(fn, inputs, options), run_function(ChunkedDivergenceFunction, inputs, options),
                              function_truth(inputs, options), "triton")
    unpatch_trl()
    _assert_loss_matches(7.5, options)
    assert [p.path for p in plans] == ["distill.light", "distill.fast"]


def _loss_call(fn, inputs, mask, num_items, options):
    """TRL's ``_chunked_divergence_loss`` call convention (the trainer's keywords), then the backward of the loss:
    ((loss, entropy_sum, n_valid), [d student hidden, d weight, d bias])."""
    sh, sw, sb, th, tw, tb = inputs
    for x in inputs:
        x.grad = None
    beta, temperature, s_scale, s_cap, t_scale, t_cap = options
    loss, entropy_sum, n_valid = fn(sh, th, sw, tw, mask, beta, num_items_in_batch=num_items, student_lm_head_bias=sb,
                                    teacher_lm_head_bias=tb, student_logit_scale=s_scale, teacher_logit_scale=t_scale,
                                    student_final_logit_softcapping=s_cap, teacher_final_logit_softcapping=t_cap,
                                    temperature=temperature)
    loss.backward()
    assert all(x.grad is None for x in inputs[3:]), "the teacher got a gradient"
    return (loss.detach(), entropy_sum.detach(), n_valid), [x.grad.clone() for x in inputs[:3]]


@pytest.mark.parametrize("num_items", [None, 7.5, "tensor"])
def test_loss_matches_trl_and_float64(num_items):
    """The trainer's call: (B, K, H) hiddens, a loss mask with a fully masked row, num_items_in_batch (None: the
    mean over valid tokens; a number; a tensor); the loss, entropy sum and gradients three-way, n_valid exactly."""
    _assert_loss_matches(torch.tensor(9.0) if num_items == "tensor" else num_items, OPTIONS["jsd-caps-T"])


def _assert_loss_matches(num_items, options):
    """Ours against TRL's own loss (called unpatched: patched, TRL's loss would call our function) and float64."""
    inputs = [x.reshape(3, 5, -1).detach().requires_grad_() if i in (0, 3) else x  # the hiddens (B, K, H)
              for i, x in enumerate(head_inputs(n=15))]
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 1, 1, 1]])
    theirs = _loss_call(TRL_LOSS, inputs, mask, num_items, options)
    patch_trl()
    ours_fn = trl_distill_trainer._chunked_divergence_loss
    assert isinstance(ours_fn, TRLDistillLoss) and ours_fn.original is TRL_LOSS
    ours = _loss_call(ours_fn, inputs, mask, num_items, options)
    leaves = [x.detach().double().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    beta, temperature, s_scale, s_cap, t_scale, t_cap = options
    cfg = DistillLossConfig(beta=beta, temperature=temperature, student_logit_scale=s_scale, student_softcap=s_cap,
                            teacher_logit_scale=t_scale, teacher_softcap=t_cap)
    loss64, metrics64 = reference_distill_loss(leaves[0], leaves[1], leaves[3], leaves[4], mask, leaves[2],
                                               leaves[5], num_items, cfg)
    grads64 = torch.autograd.grad(loss64, leaves[:3])
    (loss, ent_sum, n_valid), grads = ours
    (t_loss, t_ent_sum, t_n_valid), t_grads = theirs
    assert torch.equal(n_valid, t_n_valid) and n_valid.dtype == t_n_valid.dtype == torch.int64
    assert_three_way(loss, t_loss, loss64, torch.float32, "loss")
    assert_three_way(ent_sum, t_ent_sum, metrics64["entropy_sum"], torch.float32, "entropy_sum")
    for name, o, n, t in zip(("d hidden", "d weight", "d bias"), grads, t_grads, grads64):
        assert_three_way(o, n, t, torch.float32, name, scale=grad_scale(t))


# (option, value): what DistillLossConfig refuses, each handed back to TRL; the message names TRL's argument.
REFUSED = [("student_final_logit_softcapping", 0.0), ("teacher_final_logit_softcapping", -5.0),
           ("temperature", -1.0), ("student_logit_scale", float("inf"))]
_POSITION = {"beta": 0, "temperature": 1, "student_logit_scale": 2, "student_final_logit_softcapping": 3,
             "teacher_logit_scale": 4, "teacher_final_logit_softcapping": 5}


def _with(option: str, value) -> tuple:
    options = list(OPTIONS["jsd-caps-T"])
    options[_POSITION[option]] = value
    return tuple(options)


def _grpo_kernels_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "grpo_kernels" in str(w.message)]


def test_refused_options_warn_once_and_run_trl_exactly():
    """Each refused option warns once (naming it) and gives TRL's own function's results bit for bit (NaN where
    TRL's are); the same reason again is silent; the loss hands such a call to TRL's own loss, warning as well."""
    fn = _swapped_function()
    inputs = head_inputs()
    for i, (option, value) in enumerate(REFUSED + [REFUSED[0]]):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ours = run_function(fn, inputs, _with(option, value))
        theirs = run_function(ChunkedDivergenceFunction, inputs, _with(option, value))
        messages = _grpo_kernels_warnings(caught)
        if i < len(REFUSED):
            assert len(messages) == 1 and f"{option}={value!r}" in messages[0], messages
            assert "using TRL's own ChunkedDivergenceFunction" in messages[0]
        else:
            assert messages == []  # warned once already
        for a, b in zip([*ours[0], *ours[1]], [*theirs[0], *theirs[1]]):
            # bound: exact: TRL's own function on the same inputs both times
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    with pytest.warns(UserWarning, match="beta=1.5"), pytest.raises(ValueError, match="math domain error"):
        run_function(fn, inputs, _with("beta", 1.5))  # TRL's own function, and its error (log(1 - beta))
    mask = torch.ones(13, dtype=torch.long)
    call = (*inputs[::3], *inputs[1::3], mask, 0.5)  # student, teacher hidden; their weights; mask; beta
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = trl_distill_trainer._chunked_divergence_loss(*call, student_final_logit_softcapping=-2.0)
    messages = _grpo_kernels_warnings(caught)
    assert len(messages) == 1 and "student_final_logit_softcapping=-2.0" in messages[0]
    assert "using TRL's own _chunked_divergence_loss" in messages[0]
    unpatch_trl()
    assert torch.equal(loss[0], TRL_LOSS(*call, student_final_logit_softcapping=-2.0)[0])


@pytest.mark.parametrize("option,value", [REFUSED[1], ("beta", 1.5)])
def test_strict_refuses_with_the_option_named(option, value):
    patch_trl(strict=True)
    inputs = head_inputs()
    with pytest.raises(ValueError, match=rf"strict=True\): {option}={value!r} is not supported"):
        trl_distill_trainer.ChunkedDivergenceFunction.apply(*inputs, *_with(option, value))
    mask = torch.ones(13, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"{option}={value!r}"):
        trl_distill_trainer._chunked_divergence_loss(*inputs[::3], *inputs[1::3], mask, **{"beta": 0.5, option: value})


def test_empty_batch_is_served_and_connected():
    """TRL's compact path hands an empty batch when no position is valid: empty outputs, zero gradients."""
    fn = _swapped_function()
    sh, sw, sb, th, tw, tb = head_inputs()
    div, ent = fn.apply(sh[:0], sw, sb, th[:0], tw, tb, *OPTIONS["jsd-scales"])
    assert div.shape == ent.shape == (0,)
    div.sum().backward()
    assert all(t.grad is not None and (t.grad == 0).all() for t in (sh, sw, sb))


def test_patch_swaps_where_trl_looks_and_unpatch_restores():
    report = patch_trl()
    assert "trl.trainer.distillation_trainer._chunked_divergence_loss" in report.patched
    assert "trl.trainer.distillation_trainer.ChunkedDivergenceFunction" in report.patched
    patch_trl()  # idempotent: the originals kept are TRL's, not ours
    assert trl_distill_trainer._chunked_divergence_loss.original is TRL_LOSS
    unpatch_trl()
    assert trl_distill_trainer._chunked_divergence_loss is TRL_LOSS
    assert trl_distill_trainer.ChunkedDivergenceFunction is ChunkedDivergenceFunction
    import trl.kernels.chunked_divergence as kernel_module
    assert kernel_module.ChunkedDivergenceFunction is ChunkedDivergenceFunction  # never swapped on 1.16


def test_report_lists_the_distillation_rows():
    report = patch_trl()
    rows = {r.calls.strip(): r for r in report.routes}
    assert rows["DistillationTrainer loss (TRL 1.12-1.16)"].runs_on == "grpo_kernels"
    assert rows["ChunkedDivergenceFunction (other callers)"].runs_on == "grpo_kernels"
    assert rows["distillation options DistillLossConfig refuses"].runs_on == "TRL"
    assert "warned once" in rows["distillation options DistillLossConfig refuses"].why
    assert rows["AsyncDistillation / ServerDistillation"].runs_on == "TRL"
    assert "strict: ValueError at the call" in str(patch_trl(strict=True))


def test_patch_options_reach_the_distillation_calls(monkeypatch):
    """batch_invariant, invariant_block_rows and round_logits from patch_trl go into each call's DistillLossConfig;
    "autocast" rounds nothing on 1.16 (TRL's function keeps fp32 logits tiles) and nothing outside autocast."""
    configs = []
    original = grpo_kernels.linear_token_divergence
    monkeypatch.setattr(grpo_kernels, "linear_token_divergence",
                        lambda *a, **k: configs.append(k["config"]) or original(*a, **k))
    inputs = head_inputs()
    for kwargs, want in ((dict(batch_invariant=True, round_logits="bf16"), (True, None, "bf16")),
                         (dict(batch_invariant=True, invariant_block_rows=8), (True, 8, None)),
                         (dict(round_logits="autocast"), (False, None, None))):
        unpatch_trl()
        patch_trl(**kwargs)
        trl_distill_trainer.ChunkedDivergenceFunction.apply(*inputs, *OPTIONS["jsd-scales"])
        cfg = configs[-1]
        assert (cfg.batch_invariant, cfg.invariant_block_rows, cfg.round_logits) == want
        assert configs[-1].beta == 0.5 and configs[-1].student_logit_scale == 1.7


def test_trainer_jsd_different_widths(tmp_path):
    """TRL's DistillationTrainer, beta 0.5, temperature 0.9, student width 16 and teacher 24: stock vs patched."""
    logs = compare_runs(tmp_path)
    assert_informative(logs, "loss", "grad_norm", "entropy")


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(beta=0.0, temperature=1.0, gradient_accumulation_steps=2, per_device_train_batch_size=2),
    dict(beta=1.0, temperature=0.7, student=dict(bias=True), teacher=dict(bias=True, final_logit_softcapping=3.0)),
    dict(beta=0.2, student=dict(logit_scale=1.5, final_logit_softcapping=4.0), teacher=dict(logit_scale=0.5)),
], ids=["forward-kl-accumulation", "reverse-kl-biases-teacher-cap", "jsd-scales-caps"])
def test_trainer_more_options(tmp_path, cfg):
    logs = compare_runs(tmp_path, **cfg)
    assert_informative(logs, "loss", "grad_norm", "entropy")
