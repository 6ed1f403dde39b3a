"""Logits path: GRPO loss from given (B, T, V) logits, forward / backward / both."""
import pytest

from . import harness


@pytest.mark.bench_path("logits")
def test_logits_loss(benchmark, spec):
    shape, provider, mode = spec
    harness.run(benchmark, "logits", shape, provider, mode)
