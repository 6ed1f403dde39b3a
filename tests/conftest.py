"""Test setup: Triton kernels run on the CPU interpreter unless a CUDA GPU is present.

TRITON_INTERPRET must be set before the first @triton.jit function is created (docs/DESIGN.md section 6); the package
creates its kernels lazily, so setting it here, before any test imports a kernel, is enough.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # DeepSpeed (test extra, for the ZeRO-3 test) logs a WARNING on stdout when it auto-detects no GPU, which it does
    # whenever transformers' save_pretrained imports it; naming the accelerator keeps subprocess outputs clean.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
torch.set_num_threads(min(2, torch.get_num_threads()))

try:  # property-based tests (tests/api/test_loss_properties.py): deterministic and bounded so that CI stays fast
    from hypothesis import HealthCheck, settings

    settings.register_profile("grpo-kernels", deadline=None, derandomize=True, database=None, max_examples=20,
                              print_blob=True, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.data_too_large])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "grpo-kernels"))
except ImportError:  # hypothesis is in the test extra; without it tests/api/test_loss_properties.py fails to import
    pass


def pytest_collection_modifyitems(config, items):
    """Without the interpreter (a CUDA machine), tests that run Triton kernels on CPU tensors are skipped: there
    tests/kernels/test_gpu_kernels.py runs the compiled kernels on the GPU instead."""
    import pytest

    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return
    skip = pytest.mark.skip(reason="runs Triton kernels on CPU tensors: needs TRITON_INTERPRET=1, set automatically "
                                   "on machines without CUDA; on CUDA machines tests/kernels/test_gpu_kernels.py "
                                   "covers the kernels")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("interpreter") or params.get("impl") == "triton":
            item.add_marker(skip)


import pytest  # noqa: E402


@pytest.fixture
def knobs():
    """``knobs(fast_path_min_rows=1, ...)`` sets the library's test-only knobs (grpo_kernels._testing) until the test
    ends."""
    import contextlib

    from grpo_kernels import _testing

    with contextlib.ExitStack() as stack:
        yield lambda **values: stack.enter_context(_testing.override(**values))


@pytest.fixture
def plans(monkeypatch):
    """The list of ``Plan`` objects the planner returns during the test (which path each call took)."""
    from grpo_kernels import planner

    seen = []
    for name in ("plan_head", "plan_logits", "plan_distill"):
        real = getattr(planner, name)
        monkeypatch.setattr(planner, name, lambda *a, _real=real, **k: seen.append(_real(*a, **k)) or seen[-1])
    return seen


@pytest.fixture
def fresh_dynamo():
    """Dynamo reset before and after the test, so that each test counts its own compiles (the compile tests use it on
    every test of the module)."""
    import torch._dynamo

    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def unpatched_trl():
    """TRL unpatched before and after the test (the hf layer's TRL tests use it on every test of the module)."""
    from grpo_kernels.integrations.trl import unpatch_trl

    unpatch_trl()
    yield
    unpatch_trl()


@pytest.fixture(scope="session")
def fault_runs(tmp_path_factory):
    """The fault tests' reference runs (tests/train/test_train_faults*.py): ``two``, a finished 2-step run
    (checkpoint-1, checkpoint-2); ``three``, the same run to 3 steps (what every resume from checkpoint-1 or -2 must
    reproduce). Made once per session; tests copy them before changing them."""
    from .support.train_runs import train_tiny

    base = tmp_path_factory.getbasetemp() / "fault-runs"
    if not (base / "three" / "run_summary.json").is_file():
        assert train_tiny(base / "two", 2) == 0
        assert train_tiny(base / "three", 3) == 0
    return base


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every buffer the kernel launchers allocate starts as NaN (GRPO_KERNELS_POISON=1): a row, block or chunk a
    kernel forgets shows up in the results. The kernel and path tests use it on every test of their modules."""
    from grpo_kernels import _checks

    monkeypatch.setenv(_checks.POISON_ENV, "1")
