"""patch_trl on soft-capped heads (``final_logit_softcapping``: Gemma 2, a Gemma 3 config that sets it): they run on
grpo_kernels with the cap, never on TRL's kernel, and give TRL's numbers.

- ``TRLLogProbFunction.apply(..., final_logit_softcapping=c, logit_scale=s)`` against TRL's own
  ``ChunkedLogProbFunction.apply`` with the same arguments (values and gradients), s in (1.0, 0.5): TRL's order is
  scale, cap, temperature, folded into our softcap c / s and temperature T / s.
- TRL's GRPOTrainer on a tiny random Gemma 2 and Gemma 3 trained twice from the same seed, unpatched and with
  ``patch_trl(strict=True)``: the same logged metrics and final parameters to fp32 rounding, every patched head call
  on grpo_kernels with the cap, and no fallback warning. The tiny models' raw logits are ~1, so the cases use small
  caps (1.0, 0.5) that bend them; the Gemma 3 case also sets a ``logit_scale`` (which TRL's head applies before the
  cap, in both runs; the model's own forward, used only for sampling, ignores it) to run the fold end to end.
Helpers (tokenizer words, rewards, run comparison) come from tests/support/trl_runs.py.
"""
import warnings

import pytest
import torch

pytest.importorskip("trl")
from datasets import Dataset  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels.integrations.trl import TRLLogProbFunction, patch_trl, unpatch_trl  # noqa: E402

from ..support.trl_runs import (  # noqa: E402
    WORDS, assert_head_function_three_way, assert_informative, assert_same_run, even_words, head_inputs, head_truth,
    run_head, short, word_tokenizer,
)

pytestmark = pytest.mark.usefixtures("unpatched_trl")

MODELS = {  # name -> (config class, model class, config overrides)
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(final_logit_softcapping=1.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(final_logit_softcapping=0.5, logit_scale=0.5)),
}


@pytest.mark.parametrize("impl", ["torch", "triton"])
@pytest.mark.parametrize("logit_scale", [1.0, 0.5])
def test_head_matches_trl_function_with_softcap(logit_scale, impl, monkeypatch):
    """Our drop-in against TRL's ChunkedLogProbFunction with a cap that bites (raw logits up to ~8, cap 3) and a
    temperature of 0.8: log-probs, entropies and the gradients of hidden, weight and bias."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", impl)
    patch_trl(strict=True)
    inputs = head_inputs()
    raw = inputs[0] @ inputs[1].T + inputs[2]
    assert logit_scale * raw.abs().max() > 1.5 * 3.0  # the cap's saturated part is in play
    kw = dict(final_logit_softcapping=3.0, logit_scale=logit_scale)
    calls = []
    original = grpo_kernels.linear_token_logprobs
    monkeypatch.setattr(grpo_kernels, "linear_token_logprobs",
                        lambda *a, **k: calls.append(k) or original(*a, **k))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a fallback to TRL's kernel would warn (or raise: strict)
        (lp, ent, *rest), grads = run_head(TRLLogProbFunction, *inputs, **kw)
    assert [(k["softcap"], k["temperature"]) for k in calls] == [(3.0 / logit_scale, 0.8 / logit_scale)]
    (lp_ref, ent_ref, *_), grads_ref = run_head(ChunkedLogProbFunction, *inputs, **kw)
    (lp_uncapped, *_), _ = run_head(ChunkedLogProbFunction, *inputs, logit_scale=logit_scale)
    assert (lp_ref - lp_uncapped).abs().max() > 0.1  # bound: not a tolerance: the cap changes the answer
    assert rest == [None, None, None] and lp.dtype == torch.float32
    # three-way: against the float64 truth (TRL's order: scale, cap, temperature), TRL's function in fp32 the
    # middle term
    assert_head_function_three_way(([lp, ent], grads), ([lp_ref, ent_ref], grads_ref), head_truth(*inputs, **kw),
                                   f"scale {logit_scale}")


def _save_tiny_gemma(path, name):
    """A saved tiny Gemma (tied head, as Gemma's) + the word-level tokenizer of tests/support/trl_runs.py."""
    import transformers

    config_cls, model_cls, overrides = MODELS[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(
        vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, max_position_embeddings=64, initializer_range=0.2, pad_token_id=0,
        eos_token_id=1, bos_token_id=None, **overrides)
    getattr(transformers, model_cls)(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def _train(model, tmp_path, patched: bool, dtype=torch.float32, **overrides):
    """Train a few steps (the model in ``dtype``); returns (log_history, parameters, the softcaps of grpo_kernels'
    head calls).

    Patched runs are strict (a call TRL's kernel would have to serve raises) and record every warning: those of
    grpo_kernels must be none."""
    path, tokenizer = model
    dataset = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10", "w11 w12", "w13"] * 4})
    run = ("patched" if patched else "trl") + ("-float64" if dtype == torch.float64 else "")
    options = dict(output_dir=str(tmp_path / run), per_device_train_batch_size=4,
                   num_generations=4, max_completion_length=6, max_steps=3, learning_rate=3e-2, logging_steps=1,
                   report_to="none", use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True,
                   model_init_kwargs={"dtype": dtype, "attn_implementation": "eager"})
    options.update(overrides)
    softcaps = []
    original = grpo_kernels.linear_token_logprobs

    def spy(*args, **kwargs):
        softcaps.append(kwargs.get("softcap"))
        return original(*args, **kwargs)

    grpo_kernels.linear_token_logprobs = spy
    try:
        if patched:
            patch_trl(strict=True)
        trainer = GRPOTrainer(model=path, reward_funcs=[even_words, short], args=GRPOConfig(**options),
                              train_dataset=dataset, processing_class=tokenizer)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        grpo_kernels.linear_token_logprobs = original
        unpatch_trl()
    ours = [str(w.message) for w in caught if "grpo_kernels" in str(w.message)]
    assert ours == [], ours
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params, softcaps


@pytest.fixture(scope="module", params=[
    "gemma2", pytest.param("gemma3", marks=pytest.mark.slow)])
def tiny_gemma(request, tmp_path_factory):
    return request.param, _save_tiny_gemma(tmp_path_factory.mktemp(f"tiny_{request.param}"), request.param)


def test_trl_trainer_on_soft_capped_gemma_matches_unpatched(tiny_gemma, tmp_path):
    """grpo loss with a KL to the reference model (its log-probs too go through the capped head) and 2 iterations
    per generation (ratio != 1: clipping)."""
    name, model = tiny_gemma
    _, _, overrides = MODELS[name]
    cfg = dict(loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05)
    ref_logs, ref_params, ref_caps = _train(model, tmp_path, False, **cfg)
    logs, params, caps = _train(model, tmp_path, True, **cfg)
    t_logs, t_params, t_caps = _train(model, tmp_path, True, torch.float64, **cfg)
    assert_informative(ref_logs, "loss", "kl", "reward_std", "grad_norm")
    expected_cap = overrides["final_logit_softcapping"] / overrides.get("logit_scale", 1.0)
    assert ref_caps == [] and len(caps) > 0 and set(caps) == {expected_cap}
    # three-way against the float64 patched run (TRL scales then caps in its tiles, we fold the scale into the cap:
    # Adam amplifies that rounding difference; a fixed atol of 1e-5, measured 4e-6 on one CPU, failed on another)
    assert_same_run((ref_logs, ref_params, 0), (logs, params, len(caps)), (t_logs, t_params, len(t_caps)))
