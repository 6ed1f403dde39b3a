"""patch_trl on TRL 1.12, 1.13 and 1.14 (each run with scripts/trl_version.sh, tests/support/trl_versions_env.py):
TRL's own GRPOTrainer and RLOOTrainer give the same numbers stock and patched, and patched nothing goes to TRL's
logits path.

Each case trains a tiny local Llama three times from one seed: stock TRL in fp32, patched in fp32, and stock TRL in
float64 (the truth of the three-way rule, TRL's own maths and so independent of ours; tests/support/trl_runs.py
``assert_same_run``: every logged metric and every final parameter). Stock runs call TRL's full-logits functions and
the model's ``lm_head`` over the completion; patched runs
call neither, and call ``grpo_kernels.linear_token_logprobs`` instead.
"""
import pytest
import torch

from ..support.trl_runs import save_tiny_lm
from ..support.trl_versions_env import LIGER_LAYERS_OFF, require_series, run_command, train

SERIES = require_series("1.12", "1.13", "1.14")

from ..support.trl_runs import assert_informative, assert_same_run  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    return save_tiny_lm(tmp_path_factory.mktemp("tiny_llama"))


def _compare(tiny_lm, tmp_path, trainer="grpo", **cfg):
    """Stock, patched and float64 runs; the patched run matches stock by the three-way rule and never touched the
    logits path, which the stock run did."""
    path, tokenizer = tiny_lm
    *ref, ref_counter = train(path, tokenizer, tmp_path, False, trainer, **cfg)
    *out, counter = train(path, tokenizer, tmp_path, True, trainer, **cfg)
    # the truth: TRL's own maths in float64 (full logits, independent of grpo_kernels; TRL 1.14's chunked function
    # keeps its logits tiles in fp32, so the float64 truth of a use_liger_kernel run is the full-logits one)
    *truth, _ = train(path, tokenizer, tmp_path, False, trainer, torch.float64, **{**cfg, "use_liger_kernel": False})
    assert_same_run(ref, out, truth, truth_patched=False)
    assert (counter.functions, counter.lm_head) == (0, 0), "a patched call went to TRL's logits path"
    return ref[0], ref_counter


def test_grpo_beta_iterations_accumulation(tiny_lm, tmp_path):
    """grpo loss, KL to a reference model (its log-probs patched too), 2 iterations (old log-probs, clipping),
    gradient accumulation, a temperature."""
    logs, stock = _compare(tiny_lm, tmp_path, loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05,
                           gradient_accumulation_steps=2, per_device_train_batch_size=2, temperature=0.7)
    assert_informative(logs, "loss", "kl", "reward_std", "clip_ratio/region_mean", "grad_norm", "entropy")
    assert stock.functions > 0 and stock.lm_head > 0  # the stock run is the logits path


def test_grpo_entropy_bonus_and_mask(tiny_lm, tmp_path):
    """dapo with the entropy bonus (the entropy carries a gradient), the high-entropy token mask and truncated
    completions masked: entropies are differentiable where TRL's are."""
    logs, _ = _compare(tiny_lm, tmp_path, loss_type="dapo", entropy_coef=0.05, top_entropy_quantile=0.5,
                       mask_truncated_completions=True, num_iterations=2)
    assert_informative(logs, "loss", "grad_norm", "entropy")


def test_rloo_beta_iterations(tiny_lm, tmp_path):
    logs, stock = _compare(tiny_lm, tmp_path, "rloo", beta=0.05, num_iterations=2, temperature=0.8)
    assert_informative(logs, "loss", "kl", "grad_norm", "entropy")
    assert stock.functions > 0


@pytest.mark.skipif(SERIES != "1.14", reason="TRL 1.14's chunked path (use_liger_kernel=True; before 1.14 that "
                    f"flag runs Liger's loss): runs under TRL 1.14: {run_command('1.14')}")
def test_grpo_use_liger_kernel_chunked_path(tiny_lm, tmp_path):
    """TRL 1.14 under use_liger_kernel=True: stock runs TRL's chunked function (no logits either), patched ours.
    Liger's own layer kernels stay off (``LIGER_LAYERS_OFF``)."""
    logs, stock = _compare(tiny_lm, tmp_path, loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05,
                           use_liger_kernel=True, liger_kernel_config=LIGER_LAYERS_OFF)
    assert_informative(logs, "loss", "kl", "grad_norm")
    assert (stock.functions, stock.lm_head) == (0, 0)  # TRL's own chunked path reads no logits either
