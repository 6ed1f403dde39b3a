"""causal_lm_token_logprobs against the model's own logits, on tiny locally built transformers models (offline).

Ground truth: ``log_softmax(model(...).logits / tau)`` gathered at the next tokens, in float64 where the model
allows it, so the comparison tolerances are those of the fused path alone.
"""
import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM, GraniteConfig, GraniteForCausalLM,
    LlamaConfig, LlamaForCausalLM,
)

from grpo_kernels.integrations.transformers import causal_lm_token_logprobs, get_lm_head  # noqa: E402
from grpo_kernels.reference import logprobs_and_entropy  # noqa: E402

from ..support.tolerances import assert_same_maths, assert_three_way, grad_scale  # noqa: E402

VOCAB = 61  # not a power of two
SMALL = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, pad_token_id=0)


def _llama(tied: bool, bias: bool = False, dtype=torch.float64) -> LlamaForCausalLM:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    if bias:  # Llama has no head bias; a biased nn.Linear exercises the bias path of the kernel
        head = nn.Linear(16, VOCAB, bias=True)
        head.weight.data.copy_(model.lm_head.weight.data)
        nn.init.normal_(head.bias, std=0.5)
        model.lm_head = head
    return model.to(dtype).eval()


def _batch(batch=3, length=9, pad_left=(0, 2, 4), seed=1):
    """Left-padded prompts (TRL pads prompts on the left) plus one right-padded completion row."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row, n in enumerate(pad_left[:batch]):
        mask[row, :n] = 0
        ids[row, :n] = 0
    mask[-1, -2:] = 0  # completion right padding
    ids[-1, -2:] = 0
    return ids, mask


def _expected(model, ids, mask, keep, temperature=1.0):
    logits = model(input_ids=ids, attention_mask=mask).logits[:, -keep - 1:-1].double() / temperature
    logp_all = torch.log_softmax(logits, -1)
    logp = logp_all.gather(-1, ids[:, -keep:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy


def _no_logits(model):
    """Make the test fail if anything calls lm_head's forward: the helper must read its weight only."""
    def hook(*_):
        raise AssertionError("lm_head.forward was called: logits were materialized")
    return model.get_output_embeddings().register_forward_pre_hook(hook)


@pytest.mark.parametrize("tied,bias", [(False, False), (True, False), (False, True)], ids=["untied", "tied", "bias"])
@pytest.mark.parametrize("keep", [1, 4, None], ids=lambda k: f"keep{k}")
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=lambda t: f"tau{t}")
def test_matches_model_logits(tied, bias, keep, temperature):
    model = _llama(tied, bias)
    ids, mask = _batch()
    expected = _expected(model, ids, mask, keep or ids.shape[1] - 1, temperature)
    handle = _no_logits(model)
    with torch.no_grad():
        logp, entropy = causal_lm_token_logprobs(model, ids, mask, keep, temperature=temperature,
                                                 return_entropy=True)
    handle.remove()
    assert logp.shape == expected[0].shape and logp.dtype == torch.float64  # fp64 model: fp64 out
    # float64 on both sides, the same maths in another order (a real difference would be >> 1e-10)
    assert_same_maths(logp, expected[0], torch.float64, "log-probs")
    assert_same_maths(entropy, expected[1], torch.float64, "entropies")
    only_logp = causal_lm_token_logprobs(model, ids, mask, keep, temperature=temperature)
    assert_same_maths(only_logp, logp, torch.float64, "log-probs without the entropy")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gradients_match(tied):
    """d/d(params) of a weighted sum of log-probs and entropies, incl. the shared embedding/head when tied."""
    model = _llama(tied, dtype=torch.float32)
    ids, mask = _batch()
    keep = 5
    g = torch.Generator().manual_seed(3)
    w_logp, w_ent = torch.randn(3, keep, generator=g), torch.randn(3, keep, generator=g)

    def grads(fn):
        model.zero_grad()
        logp, entropy = fn()
        ((logp.float() * w_logp).sum() + (entropy.float() * w_ent).sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    assert causal_lm_token_logprobs(model, ids, mask, keep).dtype == torch.float32
    ref = grads(lambda: _expected(model, ids, mask, keep))
    out = grads(lambda: causal_lm_token_logprobs(model, ids, mask, keep, return_entropy=True))
    assert ref.keys() == out.keys() and "lm_head.weight" in out or tied
    # three-way: the truth from a float64 copy of the model, the middle term the fp32 model's own logits (ref)
    model, w_logp, w_ent = copy.deepcopy(model).double(), w_logp.double(), w_ent.double()
    truth = grads(lambda: _expected(model, ids, mask, keep))
    for name in ref:
        assert_three_way(out[name], ref[name], truth[name], torch.float32, name, scale=grad_scale(truth[name]))


@pytest.mark.interpreter
def test_triton_impl_matches_model():
    """impl="triton" (the CUDA default; the interpreter on CPU, see conftest.py), values and head gradient."""
    model = _llama(False, bias=True, dtype=torch.float32)
    ids, mask = _batch()
    logp, entropy = causal_lm_token_logprobs(model, ids, mask, 3, temperature=0.8, return_entropy=True,
                                             impl="triton")
    (logp.sum() + entropy.sum()).backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    exp_logp, exp_ent = _expected(model, ids, mask, 3, temperature=0.8)
    (exp_logp.sum() + exp_ent.sum()).backward()
    # three-way: the truth is the head in float64 on the same fp32 hidden states, the middle term the model's own
    # fp32 logits (exp_*: log-softmax of those logits)
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -4:-1].double()
    w64 = model.lm_head.weight.detach().double().requires_grad_(True)
    t_logp, t_ent = logprobs_and_entropy(hidden @ w64.T + model.lm_head.bias.detach().double(), ids[:, -3:], 0.8)
    (t_grad,) = torch.autograd.grad(t_logp.sum() + t_ent.sum(), w64)
    assert_three_way(logp, exp_logp, t_logp, torch.float32, "logp")
    assert_three_way(entropy, exp_ent, t_ent, torch.float32, "entropy")
    assert_three_way(grad, model.lm_head.weight.grad, t_grad, torch.float32, "d weight", scale=grad_scale(t_grad))


def test_logit_scale_folds_into_temperature():
    """Cohere multiplies its logits by config.logit_scale; Granite divides them by config.logits_scaling."""
    torch.manual_seed(0)
    common = {k: v for k, v in SMALL.items() if k != "pad_token_id"}
    models = [
        CohereForCausalLM(CohereConfig(**common, logit_scale=0.5)),
        GraniteForCausalLM(GraniteConfig(**common, logits_scaling=4.0)),
    ]
    ids, mask = _batch()
    for model in models:
        model = model.double().eval()
        with torch.no_grad():
            logp, entropy = causal_lm_token_logprobs(model, ids, mask, 4, temperature=0.9, return_entropy=True)
            exp_logp, exp_ent = _expected(model, ids, mask, 4, temperature=0.9)
        # float64 models: the same maths in float64 on both sides (a wrong fold would be off by O(1))
        assert_same_maths(logp, exp_logp, torch.float64, type(model).__name__)
        assert_same_maths(entropy, exp_ent, torch.float64, type(model).__name__)


def test_autocast_bf16_close_to_model():
    """Under bf16 autocast the head runs in bf16 like the model's own; fp32 accumulation keeps it close."""
    model = _llama(False, dtype=torch.float32)
    ids, mask = _batch()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        logp = causal_lm_token_logprobs(model, ids, mask, 4)
        expected, _ = _expected(model, ids, mask, 4)
        hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -5:-1]
    assert logp.dtype == torch.float32
    # three-way, bf16: the truth is the head in float64 on the bf16 operands autocast gives it (hidden states and
    # weight rounded to bf16), the middle term the model's own bf16 logits (expected)
    bf16 = lambda t: t.to(torch.bfloat16).double()  # noqa: E731
    t_logp, _ = logprobs_and_entropy(bf16(hidden) @ bf16(model.lm_head.weight).T, ids[:, -4:])
    assert_three_way(logp, expected, t_logp, torch.bfloat16, "logp")


def test_refuses_an_invalid_softcap():
    """A cap that is not a finite number > 0 (valid caps run: tests/hf/test_hf_models.py)."""
    torch.manual_seed(0)
    cfg = Gemma2Config(**{k: v for k, v in SMALL.items() if k != "pad_token_id"}, head_dim=8,
                       final_logit_softcapping=0.0)
    model = Gemma2ForCausalLM(cfg)
    ids, mask = _batch()
    with pytest.raises(ValueError, match="final_logit_softcapping=0.0"):
        causal_lm_token_logprobs(model, ids, mask, 2)


def test_refuses_peft_lm_head_and_custom_head():
    model = _llama(False, dtype=torch.float32)

    class FakeLoraLinear(nn.Module):  # stands in for peft.tuners.lora.layer.Linear (peft is not a dependency)
        def __init__(self, base):
            super().__init__()
            self.base_layer = base

    FakeLoraLinear.__module__ = "peft.tuners.lora.layer"
    model.lm_head = FakeLoraLinear(model.lm_head)
    with pytest.raises(ValueError, match="PEFT adapter on lm_head"):
        get_lm_head(model)

    model.lm_head = nn.Sequential(nn.Linear(16, VOCAB))
    with pytest.raises(ValueError, match="lm_head must be a torch.nn.Linear"):
        get_lm_head(model)


def test_refuses_bad_arguments():
    model = _llama(False, dtype=torch.float32)
    ids, mask = _batch()
    for keep in (0, ids.shape[1], True, 2.0):
        with pytest.raises(ValueError, match="logits_to_keep"):
            causal_lm_token_logprobs(model, ids, mask, keep)
    with pytest.raises(ValueError, match="temperature"):
        causal_lm_token_logprobs(model, ids, mask, 2, temperature=0.0)
    with pytest.raises(ValueError, match="input_ids"):
        causal_lm_token_logprobs(model, ids[0], mask[0], 2)
    model.config.logit_scale = -1.0
    with pytest.raises(ValueError, match="logit scale"):
        causal_lm_token_logprobs(model, ids, mask, 2)
