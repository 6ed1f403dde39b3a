"""patch_trl: TRL's GRPOTrainer gives the same numbers with and without grpo_kernels (offline, CPU, tiny models).

Each case trains a tiny locally built Llama twice from the same seed, once on TRL's own fused LM head and once
patched, and compares every logged per-step metric (loss, reward, kl, entropy, clip ratios, grad norm) and the
final parameters. fp32 (``bf16=False``): under bf16 autocast TRL rounds each logits tile to bf16 while grpo_kernels
accumulates in fp32, so the two agree only to bf16 precision there (``test_bf16_autocast_*`` checks which is closer
to the truth).
"""
import warnings

import pytest
import torch

pytest.importorskip("trl")
import trl  # noqa: E402
import trl.trainer.grpo_trainer as trl_grpo  # noqa: E402
import trl.trainer.utils as trl_utils  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.kernels import ChunkedLogProbFunction  # noqa: E402

import grpo_kernels  # noqa: E402
from grpo_kernels.integrations import trl as gk_trl  # noqa: E402
from grpo_kernels.integrations.trl import (  # noqa: E402
    SUPPORTED_TRL_VERSIONS, TRLLogProbFunction, is_trl_patched, patch_trl, unpatch_trl,
)

from ..support.tolerances import ATOL, assert_three_way, max_err  # noqa: E402
from ..support.trl_runs import (  # noqa: E402
    WORDS, assert_head_function_three_way, assert_informative, assert_same_run, even_words, head_calls, head_inputs,
    head_truth, run_head, short, train_quietly,
)

pytestmark = pytest.mark.usefixtures("unpatched_trl")


def _train(tiny_lm, tmp_path, patched: bool, dtype=torch.float32, **overrides):
    """Train a few steps with the model in ``dtype``; returns (log_history, parameters, number of grpo_kernels head
    calls)."""
    path, tokenizer = tiny_lm
    dataset = Dataset.from_dict({"prompt": ["w1 w2 w3", "w4 w5", "w6 w7 w8 w9", "w10", "w11 w12", "w13"] * 4})
    run = ("patched" if patched else "trl") + ("-float64" if dtype == torch.float64 else "")
    options = dict(output_dir=str(tmp_path / run), per_device_train_batch_size=4,
                   num_generations=4, max_completion_length=6, max_steps=4, learning_rate=3e-2, logging_steps=1,
                   report_to="none", use_cpu=True, bf16=False, seed=0, save_strategy="no", disable_tqdm=True,
                   model_init_kwargs={"dtype": dtype})
    options.update(overrides)
    with head_calls(patched) as calls:
        trainer = GRPOTrainer(model=path, reward_funcs=[even_words, short], args=GRPOConfig(**options),
                              train_dataset=dataset, processing_class=tokenizer)
        train_quietly(trainer)
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params, len(calls)


def _truth(tiny_lm, tmp_path, **cfg):
    """The ground truth of the three-way rule for a run: the patched run with the model in float64 (grpo_kernels
    computes in the inputs' precision). cast_lm_head_to_fp32 is a no-op on the fp32 runs and would round this one's
    head to fp32: left out here."""
    cfg = {k: v for k, v in cfg.items() if k != "cast_lm_head_to_fp32"}
    return _train(tiny_lm, tmp_path, True, torch.float64, **cfg)


def test_grpo_beta_ref_model_iterations_accumulation(tiny_lm, tmp_path):
    """grpo loss, KL to a reference model, 2 iterations per generation (ratio != 1: clipping), grad accumulation."""
    cfg = dict(loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05, gradient_accumulation_steps=2,
               per_device_train_batch_size=2)
    ref = _train(tiny_lm, tmp_path, False, **cfg)
    assert_informative(ref[0], "loss", "kl", "reward_std", "clip_ratio/region_mean", "grad_norm")
    assert_same_run(ref, _train(tiny_lm, tmp_path, True, **cfg), _truth(tiny_lm, tmp_path, **cfg))


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    dict(loss_type="dapo", top_entropy_quantile=0.5, mask_truncated_completions=True, entropy_coef=0.05,
         num_iterations=2),
    dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05, num_iterations=2, epsilon=0.02),
    dict(loss_type="dr_grpo", delta=1.5, off_policy_mask_threshold=0.0, num_iterations=2, temperature=0.7),
    dict(loss_type="cispo", num_iterations=2, use_bias_correction_kl=False, beta=0.02),
    dict(loss_type="sapo", num_iterations=2, scale_rewards="batch"),
], ids=["dapo-entropy-mask-bonus", "gspo-beta", "dr_grpo-delta-opsm-tau", "cispo-beta", "sapo"])
def test_more_trl_options(tiny_lm, tmp_path, cfg):
    ref = _train(tiny_lm, tmp_path, False, **cfg)
    assert_informative(ref[0], "loss", "grad_norm")
    assert_same_run(ref, _train(tiny_lm, tmp_path, True, **cfg), _truth(tiny_lm, tmp_path, **cfg))


@pytest.mark.interpreter
@pytest.mark.slow
def test_triton_kernels_in_trl(tiny_lm, tmp_path, monkeypatch):
    """The Triton fused-linear kernels (the CUDA default; TRITON_INTERPRET=1 on CPU, see conftest.py) inside TRL.
    SGD, not Adam: Adam's first step moves each weight by lr * sign(g), so at lr 3e-2 a gradient element within
    fp32 rounding of zero moves its weight by a whole step, and the second iteration's loss then measures which
    way that element's last bit fell (the interpreter's tl.dot and numpy's BLAS round differently), not the
    kernels' accuracy."""
    cfg = dict(loss_type="grpo", beta=0.1, num_iterations=2, epsilon=0.05, max_steps=2, optim="sgd")
    ref = _train(tiny_lm, tmp_path, False, **cfg)
    truth = _truth(tiny_lm, tmp_path, **cfg)  # the torch impl in float64
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    assert_same_run(ref, _train(tiny_lm, tmp_path, True, **cfg), truth)


@pytest.mark.slow
def test_tied_embeddings_fp32_head(tiny_lm_tied, tmp_path):
    """lm_head.weight is the input embedding: both gradients accumulate into one parameter."""
    cfg = dict(loss_type="bnpo", beta=0.05, num_iterations=2, cast_lm_head_to_fp32=True)
    ref = _train(tiny_lm_tied, tmp_path, False, **cfg)
    assert "lm_head.weight" not in ref[1]  # tied: one shared parameter
    assert_informative(ref[0], "loss", "kl", "grad_norm")
    assert_same_run(ref, _train(tiny_lm_tied, tmp_path, True, **cfg), _truth(tiny_lm_tied, tmp_path, **cfg))


def test_unsupported_version_changes_nothing(monkeypatch):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    before = (trl_utils._ChunkedLogProbFunction, trl_grpo.add_fused_lm_head)
    with pytest.raises(RuntimeError, match=r"supports TRL 1\.12\.x, 1\.13\.x, 1\.14\.x, 1\.15\.x, 1\.16\.x, found TRL "
                                           r"1\.17\.0; nothing was patched"):
        patch_trl()
    assert (trl_utils._ChunkedLogProbFunction, trl_grpo.add_fused_lm_head) == before
    assert not is_trl_patched()
    assert gk_trl.is_supported_trl_version("1.16.3.dev0") and not gk_trl.is_supported_trl_version("1.1.6")
    assert SUPPORTED_TRL_VERSIONS == ("1.12", "1.13", "1.14", "1.15", "1.16")  # each tested: tests/trl_versions/


def test_patch_is_idempotent_and_unpatch_restores():
    before = (trl_utils._ChunkedLogProbFunction, trl_grpo.add_fused_lm_head)
    patch_trl()
    patch_trl()
    assert trl_utils._ChunkedLogProbFunction is TRLLogProbFunction and is_trl_patched()
    assert trl_grpo.add_fused_lm_head is not before[1]
    unpatch_trl()
    assert trl_utils._ChunkedLogProbFunction is before[0] is ChunkedLogProbFunction
    assert trl_grpo.add_fused_lm_head is before[1] is trl_utils.add_fused_lm_head
    import importlib
    for name in ("rloo", "sft", "dpo", "kto"):  # every wrapped trainer module gets TRL's function back
        assert importlib.import_module(f"trl.trainer.{name}_trainer").add_fused_lm_head is trl_utils.add_fused_lm_head
    assert not is_trl_patched()
    unpatch_trl()  # no-op when not patched


@pytest.mark.parametrize("logit_scale", [1.0, 0.0625, 4.0])
def test_head_matches_trl_function(logit_scale):
    """Our drop-in against TRL's ChunkedLogProbFunction: values and gradients, incl. the folded logit scale."""
    patch_trl()
    inputs = head_inputs()
    (lp, ent, *rest), grads = run_head(TRLLogProbFunction, *inputs, logit_scale=logit_scale)
    (lp_ref, ent_ref, *_), grads_ref = run_head(ChunkedLogProbFunction, *inputs, logit_scale=logit_scale)
    assert rest == [None, None, None] and lp.dtype == torch.float32
    # three-way: against the float64 truth, TRL's function in fp32 the middle term
    assert_head_function_three_way(([lp, ent], grads), ([lp_ref, ent_ref], grads_ref),
                                   head_truth(*inputs, logit_scale=logit_scale), f"scale {logit_scale}")


def test_head_falls_back_to_trl():
    """A logit scale or soft cap that is not a finite number > 0 warns once and runs TRL's kernel (with every output
    set: here SFT's); empty batches fall back silently. ZeRO-3, valid soft caps and the extra outputs no longer fall
    back (tests/distributed/test_dist_zero3_emulated.py, tests/hf/test_softcap_trl.py, tests/hf/test_trl_outputs.py)."""
    patch_trl()
    inputs = head_inputs()
    cases = [
        (dict(final_logit_softcapping=-5.0), "final_logit_softcapping=-5.0"),
        (dict(logit_scale=-1.0), "logit_scale=-1.0"),
        # the same reason again, warned once already: silent now, still TRL's kernel, with SFT's outputs
        (dict(logit_scale=-1.0, outputs=("log_probs", "entropy", "is_top1")), None),
    ]
    for kw, warning in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out, grads = run_head(TRLLogProbFunction, *inputs, **kw)
        ref, grads_ref = run_head(ChunkedLogProbFunction, *inputs, **kw)
        messages = [str(w.message) for w in caught if "grpo_kernels" in str(w.message)]
        assert (messages == []) if warning is None else (len(messages) == 1 and warning in messages[0])
        for a, b in zip(out + grads, ref + grads_ref):
            assert (a is None and b is None) or torch.equal(a, b)
    empty = (inputs[0][:0].detach().requires_grad_(), inputs[1], inputs[2], inputs[3][:0])
    assert TRLLogProbFunction.apply(*empty, 1.0, 32768, None, 1.0, ("log_probs",))[0].shape == (0,)


def test_strict_refuses_an_invalid_cap_or_scale_at_setup_and_accepts_a_soft_cap():
    """patch_trl(strict=True) raises where GRPOTrainer adds the fused head, naming the option, for a cap or a scale
    that is not a finite number > 0; a valid soft cap (Gemma 2's 30) passes in silence: it runs on grpo_kernels."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(WORDS), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    config.final_logit_softcapping = 30.0
    model = LlamaForCausalLM(config)
    patch_trl(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trl_grpo.add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    for option, value in (("final_logit_softcapping", 0.0), ("logit_scale", 0.0)):
        config.final_logit_softcapping, config.logit_scale = 30.0, None
        setattr(config, option, value)
        model = LlamaForCausalLM(config)
        patch_trl(strict=True)
        with pytest.raises(ValueError, match=f"strict=True\\): {option}=0.0 is not supported"):
            trl_grpo.add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
        patch_trl(strict=False)
        with pytest.warns(UserWarning, match=f"{option}=0.0"):
            trl_grpo.add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))


def test_bf16_autocast_at_least_as_accurate_as_trl():
    """Under bf16 autocast both cast to bf16; TRL also rounds each logits tile to bf16, grpo_kernels does not."""
    patch_trl()
    h, w, b, ids = head_inputs()
    z = (h.double() @ w.double().T + b.double()) / 0.8
    with torch.no_grad():
        h16, w16, b16 = (t.bfloat16().double() for t in (h, w, b))
        z16 = (h16 @ w16.T + b16) / 0.8  # the exact logits of the bf16-cast inputs
        truth = torch.log_softmax(z16, -1).gather(-1, ids[:, None]).squeeze(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ours = TRLLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, ("log_probs",))[0]
            theirs = ChunkedLogProbFunction.apply(h, w, b, ids, 0.8, 32768, None, 1.0, ("log_probs",))[0]
        plain = torch.log_softmax((h16.float() @ w16.float().T + b16.float()) / 0.8, -1)  # fp32 on the bf16 operands
        plain = plain.gather(-1, ids[:, None]).squeeze(-1)
    assert ours.dtype == torch.float32 and z.shape[0] == ours.shape[0]
    # ours accumulates the bf16 operands in fp32: the three-way rule against the exact logits of those operands, the
    # middle term plain fp32 on them; and at least as accurate as TRL (which rounds each logits tile to bf16) up to
    # that fp32 floor
    assert_three_way(ours, plain, truth, torch.float32, "logp")
    assert max_err(ours, truth) <= max_err(theirs, truth) + ATOL[torch.float32]


def test_patch_returns_a_report_and_logs_one_line(caplog):
    with caplog.at_level("INFO", logger="grpo_kernels"):
        report = grpo_kernels.patch_trl()
    assert isinstance(report, gk_trl.TRLPatchReport) and report.newly_patched and not report.strict
    assert report.trl_version == trl.__version__
    trainers = [f"trl.trainer.{t}_trainer.add_fused_lm_head" for t in ("grpo", "rloo", "sft", "dpo", "kto")]
    assert report.patched[:6] == ("trl.trainer.utils._ChunkedLogProbFunction", *trainers)
    assert report.patched[6:8] == ("trl.experimental.async_grpo.async_grpo_trainer.add_fused_lm_head",  # padding-free
                                   # DistillationTrainer (tests/hf/test_trl_distill.py)
                                   "trl.trainer.distillation_trainer._chunked_divergence_loss")
    # where TRL looks ChunkedDivergenceFunction up: 1.16's trainer-module global, 1.15's kernel module
    assert len(report.patched) == 9 and report.patched[8].endswith(".ChunkedDivergenceFunction")
    assert [r.runs_on for r in report.kernel_calls] == ["grpo_kernels"] * 8
    assert any(r.calls.startswith("SFT/DPO/KTO") for r in report.kernel_calls)
    assert any("final_logit_softcapping" in r.calls for r in report.kernel_calls)
    assert any("soft cap not finite > 0" in r.calls and "warned once" in r.why for r in report.fallbacks)
    text = str(report).splitlines()
    assert text[0] == (f"grpo_kernels.patch_trl: TRL {trl.__version__} patched (strict=False); swapped: "
                       + ", ".join(report.patched))
    assert len(text) == 3 + len(report.routes) <= 16
    assert text[3].split()[:2] == ["GRPO/RLOO", "policy"] and "grpo_kernels" in text[3]
    records = [r for r in caplog.records if r.name == "grpo_kernels"]
    assert len(records) == 1 and records[0].levelname == "INFO" and "\n" not in records[0].getMessage()
    assert f"TRL {trl.__version__} patched" in records[0].getMessage()
    strict = grpo_kernels.patch_trl(strict=True)  # already patched: nothing swapped again, strict reported
    assert not strict.newly_patched and strict.strict and "ValueError at trainer setup" in str(strict)
    assert "already patched (strict=True)" in str(strict)


def test_patch_as_a_context_manager_restores_trl():
    before = (trl_utils._ChunkedLogProbFunction, trl_grpo.add_fused_lm_head)
    with grpo_kernels.patch_trl() as report:
        assert is_trl_patched() and trl_utils._ChunkedLogProbFunction is TRLLogProbFunction
        assert report.newly_patched
        with grpo_kernels.patch_trl() as inner:  # nested: the inner exit keeps the outer patch
            assert not inner.newly_patched
        assert is_trl_patched()
    assert not is_trl_patched()
    assert (trl_utils._ChunkedLogProbFunction, trl_grpo.add_fused_lm_head) == before
