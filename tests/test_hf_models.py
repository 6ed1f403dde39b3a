"""Which model families the fused head supports today, on tiny random configs (docs/api.md "Models"): the head's
log-probs from ``causal_lm_token_logprobs`` (the path ``patch_trl`` and ``grpo.train`` take) equal the model's own
logits' log-softmax; a soft-capped head (Gemma 2, or any config with ``final_logit_softcapping`` set) is refused
with a line naming it."""
import pytest
import torch

from grpo_kernels.integrations.transformers import causal_lm_token_logprobs, get_lm_head

COMMON = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {  # name -> (config class, model class, extra config, supported by the fused head)
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, True),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, True),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, True),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}, True),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, True),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16}, False),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16}, True),  # no final soft-cap by default
}


def _model(name):
    import transformers
    config_cls, model_cls, extra, _ = FAMILIES[name]
    if not hasattr(transformers, model_cls):
        pytest.skip(f"transformers {transformers.__version__} has no {model_cls}")
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**COMMON, **extra)
    return getattr(transformers, model_cls)(config).double().eval()


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if f[3]])
def test_supported_family_log_probs_equal_the_models_logits(name):
    model = _model(name)
    ids = torch.randint(1, 97, (2, 9), generator=torch.Generator().manual_seed(1))
    logp, entropy = causal_lm_token_logprobs(model, ids, logits_to_keep=5, temperature=0.9, return_entropy=True,
                                             impl="torch")
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, -6:-1].double() / 0.9
    expected = torch.log_softmax(logits, -1).gather(-1, ids[:, -5:, None]).squeeze(-1)
    expected_entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    torch.testing.assert_close(logp.double(), expected, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(entropy.double(), expected_entropy, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", [n for n, f in FAMILIES.items() if not f[3]])
def test_soft_capped_family_is_refused_in_one_line(name):
    model = _model(name)
    assert model.config.get_text_config().final_logit_softcapping is not None
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        get_lm_head(model)
