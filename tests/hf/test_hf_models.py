"""Which model families the fused head supports, on tiny random configs (docs/api.md "Models"): the head's
log-probs and entropies from ``causal_lm_token_logprobs`` (the path ``patch_trl`` and ``grpo.train`` take) equal the
model's own logits' log-softmax in float64, and so do their gradients. Soft-capped heads (Gemma 2, whose
``final_logit_softcapping`` defaults to 30, or a Gemma 3 config that sets it) are supported: the kernels apply the
cap. An invalid cap (not a finite number > 0) is refused with a line naming it.

Tolerances: every comparison is a float64 model against float64 autograd of the same maths, so the two sides differ
by float64 rounding of sums taken in another order: tests/support/tolerances.py's ``assert_same_maths`` (2 ATOL of
float64, relative to max(1, max |value|)), far below any real difference (a missing cap, a wrong fold or the wrong
order is off by more than 1e-3, asserted where it matters)."""
import math

import pytest
import torch

from grpo_kernels.integrations.transformers import causal_lm_token_logprobs, fold_logit_scale, get_lm_head

from ..support.tolerances import assert_same_maths, grad_scale

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {  # name -> (config class, model class, extra config)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}),  # final_logit_softcapping=30 by default
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}),  # no final soft-cap by default
    # Gemma 3 with a small cap that bites hard on logits of a few units
    "gemma3-softcap": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "final_logit_softcapping": 5.0}),
}
SOFT_CAPPED = ("gemma2", "gemma3-softcap")


def _model(name, **overrides):
    import transformers
    config_cls, model_cls, extra = FAMILIES[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **{**extra, **overrides})
    model = getattr(transformers, model_cls)(config).double().eval()
    cap = getattr(config.get_text_config(), "final_logit_softcapping", None)
    if cap is not None:
        # Raw logits of a random init are ~0.3, where cap * tanh(x / cap) is the identity to 1e-4: scale the head so
        # that they spread over [-2 cap, 2 cap], both the linear and the saturated part of the cap.
        with torch.no_grad():
            x = model(input_ids=torch.arange(1, 17)[None]).logits
            raw = cap * torch.atanh((x / cap).clamp(-0.999, 0.999))
            model.lm_head.weight.mul_(cap / raw.std())
    return model


def _ids():
    return torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))


def _model_logits(model, ids, temperature):
    """The model's own logits (its forward, cap included) of the last 5 tokens' predictions, over temperature."""
    return model(input_ids=ids).logits[:, -6:-1].double() / temperature


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_log_probs_equal_the_models_logits(name):
    model = _model(name)
    ids = _ids()
    logp, entropy = causal_lm_token_logprobs(model, ids, logits_to_keep=5, temperature=0.9, return_entropy=True,
                                             impl="torch")
    with torch.no_grad():
        logits = _model_logits(model, ids, 0.9)
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, -5:, None]).squeeze(-1)
    expected_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert_same_maths(logp.double(), expected, torch.float64, f"{name} log-probs")
    assert_same_maths(entropy.double(), expected_entropy, torch.float64, f"{name} entropies")
    cap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)
    assert (cap is not None) == (name in SOFT_CAPPED) and get_lm_head(model).softcap == cap
    if cap is not None:  # the case must exercise the cap: the raw logits go well past it
        raw = model.lm_head(model.model(input_ids=ids).last_hidden_state[:, -6:-1])
        # bound: not a tolerance: the raw logits past 1.5 c, the capped ones (logits * T, T = 0.9) below c
        assert raw.abs().max() > 1.5 * cap and logits.abs().max() * 0.9 < cap


@pytest.mark.parametrize("name", SOFT_CAPPED)
def test_soft_capped_family_gradients_equal_autograd_through_the_models_logits(name):
    """d(sum a * logp + b * entropy) w.r.t. the head weight and the embeddings (reached through the hidden states)
    equal autograd through the model's own capped logits, in float64: the cap's derivative is applied."""
    model = _model(name)
    ids = _ids()
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(2, 5, generator=g, dtype=torch.float64), torch.randn(2, 5, generator=g, dtype=torch.float64)
    params = [model.lm_head.weight, model.get_input_embeddings().weight]

    logp, entropy = causal_lm_token_logprobs(model, ids, logits_to_keep=5, temperature=0.7, return_entropy=True,
                                             impl="torch")
    ours = torch.autograd.grad((a * logp).sum() + (b * entropy).sum(), params)
    logits = _model_logits(model, ids, 0.7)
    logp_all = torch.log_softmax(logits, -1)
    expected = logp_all.gather(-1, ids[:, -5:, None]).squeeze(-1)
    expected_entropy = -(logp_all.exp() * logp_all).sum(-1)
    truth = torch.autograd.grad((a * expected).sum() + (b * expected_entropy).sum(), params)
    for got, want, what in zip(ours, truth, ("lm_head.weight", "embed_tokens.weight")):
        assert want.abs().max() > 1e-3, what  # bound: not a tolerance: an informative gradient, far above rounding
        assert_same_maths(got, want, torch.float64, what, scale=grad_scale(want))


def test_logit_scale_and_cap_fold_in_trls_order():
    """A model with both a logit scale s and a cap c scores c * tanh(s * x / c) / T (TRL's order: scale, cap,
    temperature), folded into the kernels' softcap c / s and temperature T / s; checked with s = 0.5 on a Gemma 2
    (whose forward has no scale: the expected values are built from its lm_head output)."""
    model = _model("gemma2")
    model.config.logit_scale = 0.5  # read by logit_scale_of, as TRL reads it
    assert fold_logit_scale(0.9, 0.5, 30.0) == (1.8, 60.0) and fold_logit_scale(0.9, 0.5, None) == (1.8, None)
    ids = _ids()
    logp, entropy = causal_lm_token_logprobs(model, ids, logits_to_keep=5, temperature=0.9, return_entropy=True,
                                             impl="torch")
    with torch.no_grad():
        x = model.lm_head(model.model(input_ids=ids).last_hidden_state[:, -6:-1])
    z = 30.0 * torch.tanh(0.5 * x / 30.0) / 0.9
    assert_same_maths(logp.double(), torch.log_softmax(z, -1).gather(-1, ids[:, -5:, None]).squeeze(-1),
                      torch.float64, "log-probs")
    assert_same_maths(entropy.double(), -(torch.softmax(z, -1) * torch.log_softmax(z, -1)).sum(-1), torch.float64,
                      "entropies")
    wrong_order = torch.log_softmax(0.5 * 30.0 * torch.tanh(x / 30.0) / 0.9, -1)  # cap then scale: not the same
    # bound: not a tolerance: the wrong order moves the log-probs by O(1e-2), far above float64 rounding
    assert (logp.double() - wrong_order.gather(-1, ids[:, -5:, None]).squeeze(-1)).abs().max() > 1e-3


@pytest.mark.parametrize("cap", [0.0, -30.0, math.nan, math.inf])
def test_invalid_soft_cap_is_refused_in_one_line(cap):
    model = _model("gemma2")
    model.config.final_logit_softcapping = cap
    with pytest.raises(ValueError, match=rf"^final_logit_softcapping={cap!r} \(Gemma2ForCausalLM\) is not supported "
                                         r"by the fused linear head: [^\n]*finite cap > 0[^\n]*$"):
        get_lm_head(model)
