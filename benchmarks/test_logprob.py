"""Old / reference policy: per-token log-probs from hidden states and the lm_head under torch.no_grad(), every token
valid and a padded batch."""
import pytest

from . import harness


@pytest.mark.bench_path("logprob")
def test_logprob_nograd(benchmark, spec):
    variant, shape, provider, mode = spec
    harness.run(benchmark, "logprob", variant, shape, provider, mode)
