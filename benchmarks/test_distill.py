"""On-policy distillation: the two-head divergence loss from the student's and the teacher's hidden states and
lm_heads (TRL's ``_chunked_divergence_loss``), forward + backward for the generalized JSD and the reverse KL, and
the per-token divergence under no_grad (cases in ``harness.CASES``, providers in ``distill_providers.py``)."""
import pytest

from . import harness


@pytest.mark.bench_path("distill")
def test_distill_loss(benchmark, spec):
    variant, shape, provider, mode = spec
    harness.run(benchmark, "distill", variant, shape, provider, mode)
