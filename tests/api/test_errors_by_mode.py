"""What bad input raises in each mode: the rows of docs/api.md's table ("What bad input raises") that a CPU can show.

- Argument checks (types, shapes, option names and values), read on the host: eager, a ``ValueError`` naming the
  argument; compiled, the same check runs while Dynamo traces the step: with ``fullgraph=False`` the call raises
  the ``ValueError``; with ``fullgraph=True`` Dynamo raises ``torch._dynamo.exc.Unsupported`` (a ``RuntimeError``)
  whose message quotes it (``raised exception ValueError('...')``).
- A float option that is symbolic under compile (the automatic dynamic after it changed, or ``dynamic=True``): the
  check runs on the traced value and stays as a guard of the graph, so a later bad value fails the guard, the step
  is traced again and the check raises as above, the message naming the argument without the value.
- Value checks (the tensors' values: ids in [0, V), is_ratio, num_items_in_batch, cu_seqlens): eager on CPU tensors
  a ``ValueError``, with or without ``GRPO_KERNELS_CHECK_VALUES=1``; compiled, a ``RuntimeError`` with the same
  message (the check is the graph's ``aten._assert_async``), the variable making no difference. Every entry point
  and both impls: tests/api/test_bad_input_compiled.py.
- GPU rows (a device-side assert, the variable's ``ValueError``): tests/kernels/test_gpu_errors.py, CUDA only; the
  child process it runs is run here once on the CPU.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

from ..support.error_modes import MODES, bad_ids_outcome

B, T, V = 2, 5, 16
ROOT = Path(__file__).resolve().parents[2]


def _inputs(T_=T):
    g = torch.Generator().manual_seed(T_)
    return (torch.randn(B, T_, V, generator=g), torch.randint(0, V, (B, T_), generator=g), torch.randn(B, generator=g),
            torch.randn(B, T_, generator=g) * 0.1 - 3.0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _raises_in_mode(mode, message):
    """The context manager a host check's failure satisfies in ``mode`` ("eager", "compiled" with fullgraph=True,
    "compiled-graph-breaks" with fullgraph=False)."""
    if mode == "compiled":
        return pytest.raises(torch._dynamo.exc.Unsupported, match=r"raised exception ValueError\(.*" + message)
    return pytest.raises(ValueError, match=message)


def _compiled(fn, mode, **kw):
    return fn if mode == "eager" else torch.compile(fn, fullgraph=mode == "compiled", backend="aot_eager", **kw)


@pytest.mark.parametrize("mode", MODES)
def test_an_argument_check_raises_the_value_error_or_quotes_it(mode):
    logits, ids, adv, ref = _inputs()

    def loss(logits, ids, adv, loss_type):
        return gk.grpo_loss(logits, ids, adv, loss_type=loss_type, impl="torch")[0]

    call = _compiled(loss, mode)
    assert torch.isfinite(call(logits, ids, adv, "grpo"))
    if mode == "compiled":  # a RuntimeError: what a caller catching RuntimeError sees
        assert issubclass(torch._dynamo.exc.Unsupported, RuntimeError)
    with _raises_in_mode(mode, r"ids must have shape \(2, 5\)"):
        call(logits, ids[:, :-1], adv, "grpo")
    with _raises_in_mode(mode, "loss_type must be one of"):
        call(logits, ids, adv, "nope")


# per bad value: the option, the value, the message's start
BAD_FLOATS = (("temperature", -1.0, "temperature must be > 0, got a value traced by torch.compile"),
              ("beta", -0.25, "beta must be >= 0, got a value traced by torch.compile"),
              ("epsilon_low", 1.5, r"epsilon_low must be in \[0, 1\) so that 1 - epsilon_low > 0, got a value traced"),
              # infinity: the finiteness check is a guard too (_checks.is_finite), not a comparison the compiler
              # folds to true (impl="torch" would then run with it)
              ("beta", float("inf"), "beta must be a finite number, got a value traced by torch.compile"))


# fullgraph=False with the automatic dynamic (~6 s) under -m slow: the same checks as with dynamic=True
@pytest.mark.parametrize("mode, dynamic", [
    pytest.param("compiled", None, id="compiled-automatic-dynamic"),
    pytest.param("compiled", True, id="compiled-dynamic=True"),
    pytest.param("compiled-graph-breaks", None, id="compiled-graph-breaks-automatic-dynamic", marks=pytest.mark.slow),
    pytest.param("compiled-graph-breaks", True, id="compiled-graph-breaks-dynamic=True")])
def test_a_symbolic_float_option_is_checked_by_a_guard(mode, dynamic):
    """The step is warmed up until its floats are symbolic (one call with dynamic=True, two with the automatic
    dynamic); each bad value then fails a guard and raises when traced, and a good value afterwards gives eager's
    loss (aot_eager: the same ops on the same values, exact). With fullgraph=True it reuses the graph (no compile);
    with fullgraph=False Dynamo, having failed to trace the step, runs the step's own frame eagerly from then on and
    compiles the functions it calls instead (PyTorch's "falling back to eager"), so compiles are not counted there."""
    logits, ids, adv, ref = _inputs()

    def loss(logits, ids, adv, ref, temperature, beta, epsilon_low):
        return gk.grpo_loss(logits, ids, adv, ref_logps=ref, impl="torch", temperature=temperature, beta=beta,
                            epsilon_low=epsilon_low)[0]

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)

    call = torch.compile(loss, fullgraph=mode == "compiled", dynamic=dynamic, backend=backend)
    good = [(0.7, 0.04, 0.2), (0.9, 0.05, 0.25)]
    for floats in good[:1 if dynamic else 2]:
        call(logits, ids, adv, ref, *floats)
    for name, value, message in BAD_FLOATS:
        floats = dict(zip(("temperature", "beta", "epsilon_low"), good[0]), **{name: value})
        with _raises_in_mode(mode, message):
            call(logits, ids, adv, ref, **floats)
        with pytest.raises(ValueError, match=message.split(", got")[0]):  # eager: the ValueError, the value shown
            loss(logits, ids, adv, ref, **floats)
    before = len(compiles)
    floats = (1.1, 0.06, 0.3)
    assert torch.equal(call(logits, ids, adv, ref, *floats), loss(logits, ids, adv, ref, *floats))
    if mode == "compiled":
        assert len(compiles) == before, "a good value after the bad ones recompiled: the floats were not symbolic"


@pytest.mark.parametrize("check_values", [False, True], ids=["default", "GRPO_KERNELS_CHECK_VALUES=1"])
@pytest.mark.parametrize("mode", MODES)
def test_a_value_check_on_cpu_tensors(mode, check_values, monkeypatch):
    monkeypatch.setenv("GRPO_KERNELS_CHECK_VALUES", "1" if check_values else "0")
    out = bad_ids_outcome("cpu", mode)
    assert out["raised"] is not None and "ids must lie in [0, V) = [0, 37)" in out["message"], out
    if mode == "eager":  # the verdict is read on the host at once (CPU) or by the variable's host read
        assert out["value_error"], out
    else:  # the graph's own assert: a RuntimeError, whatever the variable says
        assert out["runtime_error"] and not out["value_error"], out
    assert out["device_usable"]


def test_the_gpu_rows_child_process_runs():
    """tests/kernels/test_gpu_errors.py's child process, here on the CPU: its one JSON line is the in-process
    outcome."""
    env = dict(os.environ, GRPO_KERNELS_CHECK_VALUES="0", PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "tests.support.error_modes", "cpu", "eager"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == bad_ids_outcome("cpu", "eager")
