"""What the TRL trainer tests share (tests/hf/test_hf_trl.py, tests/hf/test_softcap_trl.py, tests/trl_versions/): the
tiny Llama and the word-level tokenizer of the tiny models, the rewards, the comparison of an unpatched and a patched run, and direct calls of
TRL's fused head function (ours or TRL's ``ChunkedLogProbFunction``), a training run without warnings, and the head
calls of a run, counted."""
from __future__ import annotations

import contextlib
import warnings

import torch

WORDS = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(40)]
# Logged values that measure wall time, not maths.
TIMING_KEYS = ("step_time", "train_runtime", "train_samples_per_second", "train_steps_per_second")


def save_tiny_lm(path, tied: bool = False, layers: int = 2):
    """The TRL trainer tests' tiny Llama + the word tokenizer, saved (TRL builds the reference model from the path).
    A large init makes the sampling distributions peaked enough that rewards vary inside a group."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def word_tokenizer():
    """A word-level tokenizer over WORDS (pad 0, eos 1, unk 2) that decodes back to space-separated words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words back with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def even_words(completions, **kwargs):
    """Rule-based reward: fraction of words with an even index."""
    return [sum(w[-1] in "02468" for w in c.split()) / max(len(c.split()), 1) for c in completions]


def short(completions, **kwargs):
    return [-0.1 * len(c.split()) for c in completions]


def assert_same_run(ref, out, truth, truth_patched: bool = True):
    """Runs ``(log_history, parameters, number of grpo_kernels head calls)``: TRL unpatched in fp32 (``ref``), patched in
    fp32 (``out``) and, in float64 (``truth``), patched or (``truth_patched=False``) TRL's own. The three-way rule on every logged number (timings aside) and
    every final parameter: the patched fp32 run within K times the unpatched fp32 run's distance to the float64 run,
    plus the fp32 ATOL. A few Adam steps amplify fp32 rounding differently on every CPU (Adam divides each gradient
    element by its running RMS, so a near-zero element's rounding moves its weight by a visible step); the middle term
    measures that amplification on this machine instead of a fixed tolerance (one fitted to another CPU failed
    here).
    """
    from .tolerances import assert_three_way

    (ref_logs, ref_params, ref_calls), (logs, params, calls), (t_logs, t_params, t_calls) = ref, out, truth
    assert ref_calls == 0 and calls > 0 and (t_calls > 0) == truth_patched, \
        "the patched runs must go through grpo_kernels, TRL's own must not"
    assert len(ref_logs) == len(logs) == len(t_logs)
    for step, (a, b, t) in enumerate(zip(ref_logs, logs, t_logs)):
        assert a.keys() == b.keys() == t.keys(), step
        for key in a:
            if key in TIMING_KEYS or not isinstance(a[key], (int, float)):
                continue
            assert_three_way(float(b[key]), float(a[key]), float(t[key]), torch.float32, f"step {step} {key}")
    for name, p in ref_params.items():
        assert_three_way(params[name], p, t_params[name], torch.float32, name)


def assert_informative(logs, *keys):
    """The compared metrics must not be trivially zero, or agreement proves nothing."""
    for key in keys:
        assert any(abs(entry.get(key, 0.0)) > 0 for entry in logs), f"{key} stayed 0: the case does not test it"


def head_inputs(dtype=torch.float32, n=23, hidden=16, vocab=45, seed=0):
    """(hidden, weight, bias, ids) for a direct call of TRL's fused head function; the first three need grads."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype).requires_grad_()
    b = torch.randn(vocab, generator=g).to(dtype).requires_grad_()
    return h, w, b, torch.randint(0, vocab, (n,), generator=g)


def run_head(fn, h, w, b, ids, **kw):
    """``fn.apply`` (TRL's ``ChunkedLogProbFunction`` or our ``TRLLogProbFunction``) with TRL's positional
    arguments, then backward of sum(logp) + 0.3 sum(entropy): (outputs, [d hidden, d weight, d bias])."""
    args = dict(temperature=0.8, chunk_size=32768, final_logit_softcapping=None, logit_scale=1.0,
                outputs=("log_probs", "entropy"))
    args.update(kw)
    for t in (h, w, b):
        t.grad = None
    logp, entropy, *rest = fn.apply(h, w, b, ids, *args.values())
    loss = logp.float().sum() + (0.3 * entropy.float().sum() if entropy is not None else 0)
    loss.backward()
    return [logp, entropy, *rest], [t.grad.clone() for t in (h, w, b)]


def head_truth(h, w, b, ids, temperature=0.8, final_logit_softcapping=None, logit_scale=1.0, dtype=torch.float64,
               entropy_weight: float = 0.3):
    """What ``run_head`` computes, by the reference on full logits in ``dtype`` (float64: the truth of the three-way
    rule) with TRL's order of the options: scale the logits, cap them, divide by the temperature. Returns
    ([logp, entropy], [d hidden, d weight, d bias]) of sum(logp) + entropy_weight sum(entropy) (``run_head``: 0.3,
    0 when the entropy is not asked for)."""
    from grpo_kernels.reference import logprobs_and_entropy

    leaves = [t.detach().to(dtype).requires_grad_(True) for t in (h, w, b)]
    x = (leaves[0] @ leaves[1].T + leaves[2]) * logit_scale
    logp, entropy = logprobs_and_entropy(x, ids, temperature, final_logit_softcapping)
    grads = torch.autograd.grad(logp.sum() + entropy_weight * entropy.sum(), leaves)
    return [logp.detach(), entropy.detach()], list(grads)


def assert_head_function_three_way(ours, theirs, truth, what=""):
    """``run_head`` results of ours against the float64 truth (``head_truth``), TRL's own function in fp32 the middle
    term: logp, entropy, then each gradient relative to its own largest value."""
    from .tolerances import assert_three_way, grad_scale

    (values, grads), (t_values, t_grads), (n_values, n_grads) = ours, truth, theirs
    for name, o, n, t in zip(("logp", "entropy"), values, n_values, t_values):
        assert_three_way(o, n, t, torch.float32, f"{what} {name}")
    for name, o, n, t in zip(("d hidden", "d weight", "d bias"), grads, n_grads, t_grads):
        assert_three_way(o, n, t, torch.float32, f"{what} {name}", scale=grad_scale(t))


def train_quietly(trainer):
    """``trainer.train()`` with the libraries' warnings silenced: these runs compare numbers, not messages (the tests
    of a warning catch it themselves)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()


@contextlib.contextmanager
def head_calls(patched: bool):
    """While entered: TRL patched (when ``patched``) and every call of ``grpo_kernels.linear_token_logprobs`` recorded
    (its keyword arguments, appended to the list this yields); on exit the function restored and TRL unpatched."""
    import grpo_kernels
    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    calls = []
    original = grpo_kernels.linear_token_logprobs

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return original(*args, **kwargs)

    grpo_kernels.linear_token_logprobs = spy
    try:
        if patched:
            patch_trl()
        yield calls
    finally:
        grpo_kernels.linear_token_logprobs = original
        unpatch_trl()
