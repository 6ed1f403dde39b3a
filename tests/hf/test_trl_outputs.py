"""patch_trl serves every output TRL 1.16's fused LM head computes: ``log_probs``, ``entropy``, ``log_sum_sq_probs``,
``mean_logits``, ``is_top1``, so that SFTTrainer, DPOTrainer and KTOTrainer run on grpo_kernels too.

1. ``TRLLogProbFunction`` against TRL's own ``ChunkedLogProbFunction`` on every ``outputs`` set (the 16 subsets of
   its optional outputs), fp32 and bf16, with a bias, a logit scale and a soft cap: the float outputs and the
   gradients by the three-way rule against the float64 reference (TRL's function the middle term), is_top1 exactly
   (against TRL and the reference). The inputs are integer-valued (``integer_head``), so that every logit is exact in
   both implementations whatever their matmuls' order (bf16 included) and exact ties occur: duplicate weight rows
   with the target at the first or at a later one of the tied columns, and ties the soft cap makes
   (``test_ties_after_the_soft_cap``). The torch impl (the CPU default) on every set; the Triton kernels, under the
   interpreter, on the sets the trainers ask for.
2. TRL's own SFTTrainer, DPOTrainer (with WPO weighting: all five outputs) and KTOTrainer on a tiny local Llama,
   stock against patched (``assert_same_run``: every logged metric, ``mean_token_accuracy``, ``entropy``,
   ``logits/chosen``, ``rewards/...``, the loss, and the final parameters within the three-way rule of a float64
   run; and, the roles swapped, TRL's stock metrics within the rule of that run too, so that an error of ours, in
   both patched runs, cannot pass), and no call left on TRL's kernel in the patched runs.
"""
from __future__ import annotations

import itertools
import warnings

import pytest
import torch

pytest.importorskip("trl")
from trl.kernels import ChunkedLogProbFunction  # noqa: E402
from trl.kernels.chunked_logprob import OPTIONAL_OUTPUTS  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels.integrations import trl as gk_trl  # noqa: E402
from grpo_kernels.integrations.trl import TRLLogProbFunction, patch_trl, unpatch_trl  # noqa: E402
from grpo_kernels.reference import token_extras  # noqa: E402

from ..support.tolerances import assert_three_way, grad_scale  # noqa: E402
from ..support.trl_runs import (  # noqa: E402
    TIMING_KEYS, WORDS, assert_informative, assert_same_run, head_truth, run_head, train_quietly, word_tokenizer,
)

pytestmark = pytest.mark.usefixtures("unpatched_trl")

N, H, V = 24, 16, 45
TIED = (4, 21, 33)  # duplicate weight rows (and bias): exactly tied columns
FLOATS = ("log_sum_sq_probs", "mean_logits")
SETS = [("log_probs", *c) for k in range(len(OPTIONAL_OUTPUTS) + 1)
        for c in itertools.combinations(OPTIONAL_OUTPUTS, k)]
# What the trainers ask for: SFT; DPO; DPO with WPO weights; KTO.
TRAINER_SETS = [("log_probs", "entropy", "is_top1"), ("log_probs", "entropy", "mean_logits", "is_top1"),
                ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs"),
                ("log_probs", "entropy", "mean_logits")]


def integer_head(dtype=torch.float32, seed: int = 0):
    """(hidden (N, H), weight (V, H), bias (V,), targets (N,)), the first three requiring grad: small integers and
    halves, exact in bf16 and with exact fp32 logits; the TIED columns hold the row maximum for the first 9 rows,
    whose targets cycle through them (only the first of them is top-1)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-2, 3, (N, H), generator=g).float()
    weight = torch.randint(-1, 2, (V, H), generator=g).float()
    bias = torch.randint(-2, 3, (V,), generator=g) * 0.5
    for col in TIED[1:]:
        weight[col], bias[col] = weight[TIED[0]], bias[TIED[0]]
    hidden[:9] = 2 * weight[TIED[0]] + torch.randint(-1, 2, (9, H), generator=g)
    ids = torch.randint(0, V, (N,), generator=g)
    ids[:9] = torch.tensor(TIED * 3)
    return (*(t.to(dtype).requires_grad_() for t in (hidden, weight, bias)), ids)


def _extras_truth(h, w, b, ids, temperature, softcap, logit_scale):
    """The extras in float64, TRL's transform: scale, cap, temperature."""
    x = (h.detach().double() @ w.detach().double().T + b.detach().double()) * logit_scale
    return dict(zip(gk_trl.EXTRA_OUTPUTS, token_extras(x, ids, temperature, softcap)))


def _compare(outputs, dtype, temperature=0.8, softcap=None, logit_scale=1.0):
    """Ours against TRL's function on one outputs set: None where TRL gives None, TRL's dtypes, the three-way rule
    (TRL the middle term) for the fp32 outputs and for the gradients (in the inputs' dtype), is_top1 exactly."""
    h, w, b, ids = integer_head(dtype)
    kw = dict(temperature=temperature, final_logit_softcapping=softcap, logit_scale=logit_scale, outputs=outputs)
    (ours, grads), (theirs, grads_trl) = (run_head(fn, h, w, b, ids, **kw)
                                          for fn in (TRLLogProbFunction, ChunkedLogProbFunction))
    (logp, entropy), grads_truth = head_truth(h, w, b, ids, temperature, softcap, logit_scale,
                                              entropy_weight=0.3 if "entropy" in outputs else 0.0)
    truth = {"log_probs": logp, "entropy": entropy, **_extras_truth(h, w, b, ids, temperature, softcap, logit_scale)}
    what = f"{outputs} {dtype} cap={softcap} scale={logit_scale}"
    assert [o is None for o in ours] == [t is None for t in theirs], what
    assert [o.dtype for o in ours if o is not None] == [t.dtype for t in theirs if t is not None], what
    for name, o, t in zip(("log_probs", "entropy", *gk_trl.EXTRA_OUTPUTS), ours, theirs):
        if o is None:
            continue
        assert o.requires_grad == (name in ("log_probs", "entropy")), f"{what}: {name}'s requires_grad"
        if name == "is_top1":
            assert torch.equal(o, t) and torch.equal(o, truth[name]), f"{what}: is_top1"
        else:
            assert_three_way(o.detach(), t.detach(), truth[name], torch.float32, f"{what} {name}")
    for name, o, t, g in zip(("d hidden", "d weight", "d bias"), grads, grads_trl, grads_truth):
        assert o.dtype == t.dtype == dtype, what
        assert_three_way(o, t, g, dtype, f"{what} {name}", scale=grad_scale(g))
    return ours


@pytest.mark.parametrize("outputs", SETS, ids=["+".join(s[1:]) or "log_probs" for s in SETS])
def test_every_output_set_matches_trl(outputs):
    """Every outputs set TRL's function accepts, on the torch impl (the CPU default), fp32; bf16 on the sets the
    trainers ask for (the dtype changes the tiles, not which outputs are formed)."""
    for dtype in (torch.float32, torch.bfloat16) if set(outputs) in map(set, TRAINER_SETS) else (torch.float32,):
        ours = _compare(outputs, dtype)
        if "is_top1" in outputs:
            assert ours[4][:9].tolist() == [True, False, False] * 3  # the first of the tied columns wins


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logit_scale_and_soft_cap(dtype):
    """A logit scale and a soft cap folded into the kernels' temperature and cap, all five outputs (scale 0.5 and
    temperature 0.8: TRL's and our transformed logits are then the same numbers up to the cap's rounding)."""
    _compare(SETS[-1], dtype, softcap=8.0, logit_scale=0.5)
    _compare(SETS[-1], dtype, logit_scale=0.5)


def test_ties_after_the_soft_cap():
    """Logits far beyond the cap are all exactly the cap in fp32: the first of them is top-1, in TRL and here."""
    x = torch.zeros(3, H)
    x[:, 0] = 1.0
    w = torch.zeros(V, H)
    w[9, 0], w[3, 0], w[20, 0] = 40.0, 30.0, 50.0
    ids = torch.tensor([3, 9, 20])
    outputs = ("log_probs", "is_top1")
    for cap, expected in ((0.25, [True, False, False]), (None, [False, False, True])):
        ours = TRLLogProbFunction.apply(x, w, None, ids, 1.0, 32768, cap, 1.0, outputs)[4]
        theirs = ChunkedLogProbFunction.apply(x, w, None, ids, 1.0, 32768, cap, 1.0, outputs)[4]
        assert ours.tolist() == theirs.tolist() == expected, cap


@pytest.mark.interpreter
@pytest.mark.parametrize("outputs", [pytest.param(s, marks=[] if i in (0, 2) else [pytest.mark.slow])
                                     for i, s in enumerate(TRAINER_SETS)], ids=["sft", "dpo", "dpo_wpo", "kto"])
def test_trainer_sets_on_the_triton_kernels(outputs, monkeypatch):
    """The Triton kernels (the CUDA default; TRITON_INTERPRET=1 on CPU): head.light with gradients, fp32; all five
    outputs in bf16 too; and the no-gradient fold (TRL's evaluation and reference passes). DPO's and KTO's sets are
    slow (each flag combination of the kernels is in tests/paths/test_head_extras.py already)."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    patch_trl()
    _compare(outputs, torch.float32)
    if len(outputs) == 5:
        _compare(outputs, torch.bfloat16, softcap=8.0, logit_scale=0.5)
        h, w, b, ids = (t.detach() if t.is_floating_point() else t for t in integer_head())
        with torch.no_grad():
            ours = TRLLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, outputs)
            theirs = ChunkedLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, outputs)
        extras = _extras_truth(h, w, b, ids, 0.8, None, 1.0)
        assert torch.equal(ours[4], theirs[4]) and torch.equal(ours[4], extras["is_top1"])
        for i, name in ((2, "log_sum_sq_probs"), (3, "mean_logits")):
            assert_three_way(ours[i], theirs[i], extras[name], torch.float32, f"no grad {name}")


def test_outputs_trl_ignores_or_does_not_know(monkeypatch):
    """A name TRL's function ignores is ignored here too; an output TRL computes and grpo_kernels does not (none in
    TRL 1.16; a later TRL may add one) runs TRL's own kernel, silently."""
    assert gk_trl._ROUTED_OUTPUTS == {"log_probs", *OPTIONAL_OUTPUTS}
    h, w, b, ids = integer_head()
    ours = TRLLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, ("log_probs", "unknown"))
    assert ours[1:] == (None, None, None, None)
    calls, real = [], ChunkedLogProbFunction.apply
    monkeypatch.setattr(ChunkedLogProbFunction, "apply", lambda *a: (calls.append(1), real(*a))[1])
    monkeypatch.setattr(gk_trl, "_ROUTED_OUTPUTS", frozenset({"log_probs", "entropy"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TRLLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, ("log_probs", "is_top1"))
    assert calls == [1]


# ------------------------------------------------------------------------------------------------ the trainers

@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    """A saved tiny Llama + word-level tokenizer, and greedy continuations of it: texts whose tokens the untrained
    model predicts (mean_token_accuracy is then far from 0 and 1: prompts are random words)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_llama_sft")
    tokenizer = word_tokenizer()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                         initializer_range=0.2, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    prompts = ["w1 w2", "w3", "w4 w5 w6", "w7", "w8 w9", "w10 w11 w12", "w13", "w14 w15"]
    greedy = []
    with torch.no_grad():
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids
            out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0, eos_token_id=None)
            greedy.append(tokenizer.decode(out[0, ids.shape[1]:]))
    return str(path), tokenizer, prompts, greedy


def _dataset(kind: str, prompts, greedy):
    from datasets import Dataset

    other = [" w20 w22", " w31", " w25 w27 w29", " w33 w35", " w36", " w21 w23", " w37 w39", " w24"]
    if kind == "sft":
        return Dataset.from_dict({"text": [p + " " + g for p, g in zip(prompts, greedy)]})
    if kind == "dpo":
        return Dataset.from_dict({"prompt": prompts, "chosen": [" " + g for g in greedy], "rejected": other})
    return Dataset.from_dict({"prompt": prompts, "completion": [" " + g if i % 2 else o for i, (g, o) in
                                                                enumerate(zip(greedy, other))],
                              "label": [bool(i % 2) for i in range(len(prompts))]})


def _train(kind: str, tiny_lm, tmp_path, monkeypatch, patched: bool, dtype=torch.float32):
    """Two steps of TRL's ``kind`` trainer with the model in ``dtype``: (log_history, parameters, number of
    grpo_kernels head calls, number of calls of TRL's own ChunkedLogProbFunction)."""
    from trl import DPOConfig, DPOTrainer, KTOConfig, KTOTrainer, SFTConfig, SFTTrainer

    path, tokenizer, prompts, greedy = tiny_lm
    run = f"{kind}-{'patched' if patched else 'trl'}-{str(dtype)[6:]}"
    options = dict(output_dir=str(tmp_path / run), per_device_train_batch_size=4, max_steps=2, learning_rate=3e-2,
                   logging_steps=1, report_to="none", use_cpu=True, bf16=False, seed=0, save_strategy="no",
                   disable_tqdm=True, model_init_kwargs={"dtype": dtype}, max_length=16)
    trainer_cls, config = {"sft": (SFTTrainer, SFTConfig(**options)),
                           "dpo": (DPOTrainer, DPOConfig(**options, use_weighting=True)),
                           "kto": (KTOTrainer, KTOConfig(**options))}[kind]
    ours, theirs = [], []
    real_ours, real_trl = grpo_kernels.linear_token_logprobs, ChunkedLogProbFunction.apply
    with monkeypatch.context() as m:
        m.setattr(grpo_kernels, "linear_token_logprobs", lambda *a, **k: (ours.append(1), real_ours(*a, **k))[1])
        m.setattr(ChunkedLogProbFunction, "apply", lambda *a: (theirs.append(1), real_trl(*a))[1])
        try:
            if patched:
                patch_trl(strict=True)
            trainer = trainer_cls(model=path, args=config, train_dataset=_dataset(kind, prompts, greedy),
                                  processing_class=tokenizer)
            train_quietly(trainer)
        finally:
            unpatch_trl()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params, len(ours), len(theirs)


@pytest.mark.parametrize("kind, informative", [
    ("sft", ("loss", "entropy", "mean_token_accuracy", "grad_norm")),
    ("dpo", ("loss", "entropy", "mean_token_accuracy", "logits/chosen", "logits/rejected", "rewards/margins",
             "logps/chosen")),
    ("kto", ("loss", "entropy", "logits/chosen", "logits/rejected", "kl", "rewards/margins")),
])
def test_trainer_stock_vs_patched(kind, informative, tiny_lm, tmp_path, monkeypatch):
    """TRL's own trainer, stock and patched (strict): the same logged metrics and parameters to fp32 rounding (the
    three-way rule against a float64 run), no call on TRL's kernel once patched, every call on grpo_kernels."""
    ref, out, truth = (_train(kind, tiny_lm, tmp_path, monkeypatch, patched, dtype)
                       for patched, dtype in ((False, torch.float32), (True, torch.float32), (True, torch.float64)))
    assert ref[3] > 0 and out[3] == 0 and truth[3] == 0, "TRL's kernel: every stock call, no patched one"
    assert_informative(ref[0], *informative)
    if "mean_token_accuracy" in informative:  # neither 0 nor 1: is_top1 is both True and False
        assert 0 < ref[0][0]["mean_token_accuracy"] < 1
    assert_same_run(ref[:3], out[:3], truth[:3])
    _assert_truth_of_trl_too(ref[0], out[0], truth[0])


def _assert_truth_of_trl_too(ref_logs, logs, truth_logs):
    """The three-way rule with the roles of the fp32 runs swapped, on every logged number: TRL's stock run within K
    times our fp32 run's distance to the float64 run, plus ATOL. The float64 run is made with grpo_kernels, so an
    error of ours would be in both patched runs and pass ``assert_same_run``; here it makes TRL's numbers miss."""
    for step, (a, b, t) in enumerate(zip(ref_logs, logs, truth_logs)):
        for key in a:
            if key not in TIMING_KEYS and isinstance(a[key], (int, float)):
                assert_three_way(float(a[key]), float(b[key]), float(t[key]), torch.float32, f"step {step} {key}")
