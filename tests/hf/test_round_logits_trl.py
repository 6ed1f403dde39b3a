"""patch_trl(round_logits=...): under bf16 autocast TRL's fused head computes its logits tiles in bf16 (rounded) before
its fp32 log-softmax; with round_logits="autocast" grpo_kernels rounds its fp32-accumulated logits to the autocast
dtype too, and the two then agree to fp32 rounding, where without the option they differ by bf16's.

Why exact inputs (``_dyadic_head``): with products and sums exact in fp32, TRL's bf16 GEMM and our fp32 tiles round
the same raw value; otherwise an fp32 difference in the order of a sum could move one logit across a bf16 rounding
boundary in one of them (a jump of one bf16 ulp, not an fp32 difference). Why no bias: TRL adds it to the bf16 tile
in bf16, a second rounding the recipe (one rounding of ``hidden @ weight.T + bias``) does not have."""

import pytest
import torch

pytest.importorskip("trl")
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

from grpo_kernels.integrations.trl import TRLLogProbFunction, patch_trl, rounding_for, unpatch_trl  # noqa: E402
from grpo_kernels.reference import logprobs_and_entropy  # noqa: E402

from ..support.tolerances import assert_three_way, max_err, same_maths_slack  # noqa: E402
from ..support.trl_runs import even_words, short, train_quietly  # noqa: E402

pytestmark = pytest.mark.usefixtures("unpatched_trl")
OUTPUTS = ("log_probs", "entropy")


def _dyadic_head(n=23, hidden=16, vocab=45, seed=0):
    """hidden multiples of 2^-5 in [-4, 4], weight multiples of 2^-6 in [-2, 2]: exact in bf16, each product a
    multiple of 2^-11 below 8, so ``hidden @ weight.T`` (|x| <= 128, 18 bits) is exact in fp32 in any order."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-128, 129, (n, hidden), generator=g).float() / 32
    w = torch.randint(-128, 129, (vocab, hidden), generator=g).float() / 64
    return h, w, torch.randint(0, vocab, (n,), generator=g)


def _call(fn, h, w, ids):
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        return fn.apply(h, w, None, ids, 0.8, 32768, None, 1.0, OUTPUTS)[:2]


def test_autocast_rounding_matches_trl_function():
    h, w, ids = _dyadic_head()
    # the truth of the recipe: the exact logits (float64) rounded to bf16 once, everything after in float64
    truth = logprobs_and_entropy(h.double() @ w.double().T, ids, 0.8, None, "bf16")
    theirs = _call(ChunkedLogProbFunction, h, w, ids)
    patch_trl(round_logits="autocast")
    ours = _call(TRLLogProbFunction, h, w, ids)
    patch_trl(round_logits=None)
    unrounded = _call(TRLLogProbFunction, h, w, ids)
    for name, o, t, tr, u in zip(("logp", "entropy"), ours, theirs, truth, unrounded):
        # three-way: ours against the float64 recipe, TRL's own function (the same recipe in fp32) the middle term
        assert_three_way(o, t, tr, torch.float32, name)
        slack = same_maths_slack(torch.float32) * max(1.0, tr.abs().max().item())
        assert max_err(o, t) <= slack, name  # the same maths, sums in another order
        # bound: "clearly different": fp32 logits miss bf16's rounding (|x| ~ 10: an ulp of 2^-4), far past the slack
        assert max_err(u, t) > 10 * slack, name


def test_rounding_for_follows_autocast_at_call_time():
    assert rounding_for("cpu", "autocast") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rounding_for("cpu", "autocast") == "bf16" and rounding_for("cpu", None) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert rounding_for("cpu", "autocast") == "fp16" and rounding_for("cpu", "bf16") == "bf16"
    with pytest.raises(ValueError, match="round_logits must be one of"):
        patch_trl(round_logits="bfloat16")
    report = patch_trl(round_logits="autocast")
    assert report.round_logits == "autocast" and "round_logits='autocast'" in str(report)
    unpatch_trl()


def _train_bf16(tiny_lm, tmp_path, monkeypatch, round_logits=None, patched=True):  # noqa: F811
    """Three GRPO steps with bf16=True (CPU autocast) and a reference model (beta > 0) at learning rate 0: the
    parameters never change, so every number depends on the head computation alone. Returns the per-token
    log-probs of every no-gradient head call (the reference model's, and any old-policy pass), concatenated."""
    path, tokenizer = tiny_lm
    from datasets import Dataset

    dataset = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10", "w11 w12", "w13"] * 4})
    args = GRPOConfig(output_dir=str(tmp_path / f"run-{patched}-{round_logits}"), per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=6, max_steps=3, learning_rate=0.0, logging_steps=1,
                      beta=0.1, report_to="none", use_cpu=True, bf16=True, seed=0, save_strategy="no",
                      disable_tqdm=True)
    fn = TRLLogProbFunction if patched else ChunkedLogProbFunction
    apply, recorded = fn.apply, []

    def spy(*a, **kw):
        out = apply(*a, **kw)
        if not torch.is_grad_enabled():
            recorded.append(out[0].detach().float().clone())
        return out

    monkeypatch.setattr(fn, "apply", spy)
    try:
        if patched:
            patch_trl(round_logits=round_logits)
        trainer = GRPOTrainer(model=path, reward_funcs=[even_words, short], args=args, train_dataset=dataset,
                              processing_class=tokenizer)
        train_quietly(trainer)
    finally:
        unpatch_trl()
        monkeypatch.undo()
    assert recorded, "no no-gradient head call: the case does not test the reference log-probs"
    return torch.cat(recorded)


def test_trainer_bf16_reference_logprobs_match_stock_trl(tiny_lm, tmp_path, monkeypatch):  # noqa: F811
    """GRPOTrainer with bf16=True: the reference log-probs of the patched trainer with round_logits="autocast" are
    stock TRL's to fp32 rounding, token by token; patched without the option they are not (bf16's rounding)."""
    stock = _train_bf16(tiny_lm, tmp_path, monkeypatch, patched=False)
    rounded = _train_bf16(tiny_lm, tmp_path, monkeypatch, "autocast")
    plain = _train_bf16(tiny_lm, tmp_path, monkeypatch, None)
    assert stock.shape == rounded.shape == plain.shape
    slack = same_maths_slack(torch.float32) * max(1.0, stock.abs().max().item())
    assert max_err(rounded, stock) <= slack  # the same maths, sums in another order
    # bound: "clearly different": without the rounding the log-probs miss bf16's rounding of the logits
    assert max_err(plain, stock) > 10 * slack
