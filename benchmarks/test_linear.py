"""Fused linear head: GRPO loss from hidden states and the lm_head: forward + backward, forward, backward, a frozen
head, and a padded batch (cases in ``harness.CASES``)."""
import pytest

from . import harness


@pytest.mark.bench_path("linear")
def test_linear_loss(benchmark, spec):
    variant, shape, provider, mode = spec
    harness.run(benchmark, "linear", variant, shape, provider, mode)
