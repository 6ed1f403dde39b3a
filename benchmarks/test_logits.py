"""Logits path: GRPO loss from given (B, T, V) logits: forward + backward, backward, a padded batch and one long
row; and the no-grad forward (log-probs + entropy under ``torch.no_grad()``, no loss) (cases in ``harness.CASES``)."""
import pytest

from . import harness


@pytest.mark.bench_path("logits")
def test_logits_loss(benchmark, spec):
    variant, shape, provider, mode = spec
    harness.run(benchmark, "logits", variant, shape, provider, mode)
