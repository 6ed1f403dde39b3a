"""patch_trl and the DistillationTrainer of TRL 1.12-1.15 (each series in its own environment,
tests/support/trl_versions_env.py): every series has one, calling ``_chunked_divergence_loss`` (1.12-1.14 with a
``chunk_size`` and TRL's PyTorch ``_chunk``; 1.15 with ``ChunkedDivergenceFunction``, Triton only, imported at each
call), and patched it runs on ``fused_linear_distill_loss`` with TRL's numbers.

The trainer runs: stock fp32, patched fp32, and a float64 truth independent of grpo_kernels' integration: stock TRL
in float64 on 1.12-1.14 (their chunks compute in the model's dtype), the reference loss on 1.15 (its Triton function
computes in fp32; tests/support/trl_distill_runs.py). Stock 1.15 runs TRL's Triton kernels under the interpreter
(TRITON_INTERPRET=1, tests/conftest.py).
"""
import importlib
import sys

import pytest
import torch

from ..support.trl_versions_env import require_series

SERIES = require_series("1.12", "1.13", "1.14", "1.15")

import trl.trainer.distillation_trainer as trl_distill_trainer  # noqa: E402

from grpo_kernels.integrations.trl import patch_trl, unpatch_trl  # noqa: E402
from grpo_kernels.integrations.trl_distill import TRLDistillLoss, TRLDivergenceFunction  # noqa: E402

from ..support.tolerances import assert_three_way, grad_scale  # noqa: E402
from ..support.trl_distill_runs import (  # noqa: E402
    assert_function_three_way, compare_runs, function_truth, head_inputs, reference_loss, run_function,
)
from ..support.trl_runs import assert_informative  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")
TRL_LOSS = trl_distill_trainer._chunked_divergence_loss
LOSS_NAME = "trl.trainer.distillation_trainer._chunked_divergence_loss"


def test_patch_swaps_the_loss_and_unpatch_restores():
    report = patch_trl()
    assert isinstance(trl_distill_trainer._chunked_divergence_loss, TRLDistillLoss)
    distill = [name for name in report.patched if "divergence" in name.lower()]
    if SERIES == "1.15":
        import trl.kernels.chunked_divergence as kernel_module  # Triton is installed in this environment
        trl_function = kernel_module.ChunkedDivergenceFunction
        assert isinstance(trl_function, TRLDivergenceFunction)
        assert distill == [LOSS_NAME, "trl.kernels.chunked_divergence.ChunkedDivergenceFunction"]
    else:
        assert distill == [LOSS_NAME]  # no ChunkedDivergenceFunction before 1.15
    rows = {r.calls.strip(): r.runs_on for r in report.routes}
    assert rows["DistillationTrainer loss (TRL 1.12-1.16)"] == "grpo_kernels"
    assert (rows.get("DistillationTrainer use_liger_kernel=True") == "TRL") == (SERIES == "1.12")
    unpatch_trl()
    assert trl_distill_trainer._chunked_divergence_loss is TRL_LOSS
    if SERIES == "1.15":
        assert kernel_module.ChunkedDivergenceFunction is trl_function.original


def _loss_args(chunked: bool):
    """The trainer's call of TRL's loss on (3, 5) tokens with a mask: positional arguments (1.12-1.14's chunk_size
    third from last of them), keywords."""
    inputs = [x.reshape(3, 5, -1).detach().requires_grad_() if i in (0, 3) else x
              for i, x in enumerate(head_inputs(n=15))]
    sh, sw, sb, th, tw, tb = inputs
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 1, 0, 1, 1]])
    args = (sh, th, sw, tw, mask, 0.3) + ((4,) if chunked else ())
    kwargs = dict(num_items_in_batch=torch.tensor(6.5), student_lm_head_bias=sb, teacher_lm_head_bias=tb,
                  student_logit_scale=1.2, teacher_logit_scale=0.7, student_final_logit_softcapping=4.0,
                  teacher_final_logit_softcapping=None, temperature=0.9)
    return inputs, args, kwargs


def _loss_grads(fn, inputs, args, kwargs):
    for x in inputs:
        x.grad = None
    loss, entropy_sum, n_valid = fn(*args, **kwargs)
    loss.backward()
    return (loss.detach(), entropy_sum.detach(), n_valid), [x.grad.clone() for x in inputs[:3]]


def test_loss_matches_trl_and_float64():
    """Ours against TRL's own loss on one call (chunk_size ignored on 1.12-1.14) and the float64 reference; the
    valid-token count exactly."""
    inputs, args, kwargs = _loss_args(SERIES != "1.15")
    # TRL's own first: patched, 1.15's loss would import our function
    (t_loss, t_ent, t_n), t_grads = _loss_grads(TRL_LOSS, inputs, args, kwargs)
    patch_trl()
    (loss, ent, n), grads = _loss_grads(trl_distill_trainer._chunked_divergence_loss, inputs, args, kwargs)
    leaves = [x.detach().double().requires_grad_(i < 3) for i, x in enumerate(inputs)]
    args64 = (leaves[0], leaves[3], leaves[1], leaves[4], *args[4:])
    loss64, ent64, n64 = reference_loss(*args64, **{**kwargs, "student_lm_head_bias": leaves[2],
                                                    "teacher_lm_head_bias": leaves[5]})
    grads64 = torch.autograd.grad(loss64, leaves[:3])
    assert torch.equal(n, t_n) and torch.equal(n, n64)
    assert_three_way(loss, t_loss, loss64, torch.float32, "loss")
    assert_three_way(ent, t_ent, ent64, torch.float32, "entropy_sum")
    for name, o, t, t64 in zip(("d hidden", "d weight", "d bias"), grads, t_grads, grads64):
        assert_three_way(o, t, t64, torch.float32, name, scale=grad_scale(t64))


@pytest.mark.skipif(SERIES != "1.15", reason="ChunkedDivergenceFunction exists from TRL 1.15 (runs in .venv-trl115)")
def test_function_matches_trl_triton_function():
    """TRL 1.15's Triton-only function (under the interpreter) against ours and the float64 truth."""
    import trl.kernels.chunked_divergence as kernel_module

    theirs_fn = kernel_module.ChunkedDivergenceFunction
    patch_trl()
    ours_fn = kernel_module.ChunkedDivergenceFunction
    for options in ((0.0, 0.8, 1.3, None, 1.0, 3.0), (0.6, 1.0, 1.0, 2.5, 0.5, None)):
        inputs = head_inputs()
        assert_function_three_way(run_function(ours_fn, inputs, options), run_function(theirs_fn, inputs, options),
                                  function_truth(inputs, options), str(options))


@pytest.mark.skipif(SERIES != "1.15", reason="TRL 1.15's kernel module needs Triton (runs in .venv-trl115)")
def test_115_without_triton_the_loss_still_runs(monkeypatch):
    """Without Triton TRL 1.15's loss cannot import its function (stock: ImportError at the first call); patched,
    only the loss is swapped and it never imports it."""
    monkeypatch.setitem(sys.modules, "trl.kernels.chunked_divergence", None)
    inputs, args, kwargs = _loss_args(False)
    with pytest.raises(ImportError):
        TRL_LOSS(*args, **kwargs)
    report = patch_trl()
    assert [name for name in report.patched if "divergence" in name.lower()] == [LOSS_NAME]
    loss, _, _ = trl_distill_trainer._chunked_divergence_loss(*args, **kwargs)
    loss.backward()
    assert torch.isfinite(inputs[1].grad).all()
    unpatch_trl()
    monkeypatch.undo()
    importlib.import_module("trl.kernels.chunked_divergence")  # TRL's module as it was


def test_trainer_jsd_different_widths(tmp_path):
    """TRL's DistillationTrainer (beta 0.5, temperature 0.9, widths 16 and 24) stock vs patched."""
    logs = compare_runs(tmp_path, truth="reference" if SERIES == "1.15" else "trl")
    assert_informative(logs, "loss", "grad_norm", "entropy")


@pytest.mark.slow
def test_trainer_reverse_kl_biases_caps(tmp_path):
    logs = compare_runs(tmp_path, truth="reference" if SERIES == "1.15" else "trl", beta=1.0, temperature=0.7,
                        student=dict(bias=True, final_logit_softcapping=4.0), teacher=dict(bias=True, logit_scale=0.5))
    assert_informative(logs, "loss", "grad_norm", "entropy")
