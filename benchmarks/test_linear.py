"""Fused linear head: GRPO loss from hidden states and a trainable lm_head, forward / backward / both."""
import pytest

from . import harness


@pytest.mark.bench_path("linear")
def test_linear_loss(benchmark, spec):
    shape, provider, mode = spec
    harness.run(benchmark, "linear", shape, provider, mode)
