"""What the DistillationTrainer tests share (tests/hf/test_trl_distill.py, tests/trl_versions/test_trl_distill_versions.py):
a tiny student and a wider teacher over the package's character tokenizer (``grpo.char_tokenizer``: no hub), TRL's
trainer run stock or patched with the calls of each side counted, and direct calls of TRL's two-head function and loss
with their float64 truth (``grpo_kernels.distill_reference``, the package's one definition of the maths).
"""
from __future__ import annotations

import contextlib
import functools
import importlib

import pytest
import torch

ALPHABET = "abcdefgh "
PROMPTS = ["ab", "cde", "fg h", "a", "bb h", "hh", "gca", "d e"]
# The two models: only the vocabulary is shared; the teacher is wider (H_t != H_s) and has its own seed.
STUDENT_WIDTH, TEACHER_WIDTH = 16, 24
TRAINER_MODULE, KERNEL_MODULE = "trl.trainer.distillation_trainer", "trl.kernels.chunked_divergence"


def char_tokenizer():
    import grpo

    return grpo.char_tokenizer(ALPHABET)


def tiny_model(tokenizer, hidden: int, seed: int, dtype=torch.float32, bias: bool = False, **config):
    """A seeded one-layer Llama of width ``hidden`` over ``tokenizer``'s vocabulary; ``bias``: an lm_head with a bias
    (Llama's has none); ``config``: extra config attributes TRL's trainer reads (``final_logit_softcapping``,
    ``logit_scale``; the model's own forward ignores them, the distillation loss applies them)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      initializer_range=0.2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      bos_token_id=tokenizer.bos_token_id, tie_word_embeddings=False, **config)
    model = LlamaForCausalLM(cfg)
    if bias:
        model.lm_head = torch.nn.Linear(hidden, len(tokenizer), bias=True)
        torch.nn.init.normal_(model.lm_head.weight, std=0.2)
        torch.nn.init.normal_(model.lm_head.bias, std=0.5)
    return model.to(dtype)


class CallCounter:
    """Counts, while entered, the calls that went to TRL's own distillation maths (its ``_chunked_divergence_loss``
    and ``ChunkedDivergenceFunction.apply`` where the series has it, wrapped where TRL looks them up *before*
    ``patch_trl`` runs, so the patch keeps the wrappers as the originals it hands calls back to) and to grpo_kernels'
    (``fused_linear_distill_loss``, ``linear_token_divergence``)."""

    def __init__(self):
        self.trl_loss = self.trl_function = self.loss = self.function = 0

    @property
    def trl(self) -> int:
        return self.trl_loss + self.trl_function

    def _counted(self, fn, name: str):
        @functools.wraps(fn)  # keeps TRL's signature (inspect follows __wrapped__)
        def counted(*args, **kwargs):
            setattr(self, name, getattr(self, name) + 1)
            return fn(*args, **kwargs)
        return counted

    @contextlib.contextmanager
    def counting(self):
        import grpo_kernels

        trainer = importlib.import_module(TRAINER_MODULE)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(trainer, "_chunked_divergence_loss", self._counted(trainer._chunked_divergence_loss, "trl_loss"))
            owner = trainer if hasattr(trainer, "ChunkedDivergenceFunction") else _kernel_module()
            if owner is not None and hasattr(owner, "ChunkedDivergenceFunction"):
                function = owner.ChunkedDivergenceFunction
                mp.setattr(owner, "ChunkedDivergenceFunction",
                           type("CountedChunkedDivergenceFunction", (), {
                               "apply": staticmethod(self._counted(function.apply, "trl_function"))}))
            for name, counter in (("fused_linear_distill_loss", "loss"), ("linear_token_divergence", "function")):
                mp.setattr(grpo_kernels, name, self._counted(getattr(grpo_kernels, name), counter))
            yield self


def _kernel_module():
    try:
        return importlib.import_module(KERNEL_MODULE)
    except ImportError:  # TRL 1.15 without Triton; none before 1.15
        return None


def reference_loss(student_hidden_states, teacher_hidden_states, student_lm_head_weight, teacher_lm_head_weight,
                   completion_mask, beta, *chunk_size, num_items_in_batch=None, student_lm_head_bias=None,
                   teacher_lm_head_bias=None, student_logit_scale=1.0, teacher_logit_scale=1.0,
                   student_final_logit_softcapping=None, teacher_final_logit_softcapping=None, temperature=1.0):
    """TRL's ``_chunked_divergence_loss`` (any series: 1.12-1.14's ``chunk_size`` ignored) by the reference on both
    models' full logits, mapped from TRL's arguments here and not by the integration under test: the float64 truth of
    the trainer runs."""
    from grpo_kernels.distill_config import DistillLossConfig
    from grpo_kernels.distill_reference import reference_distill_loss

    cfg = DistillLossConfig(beta=beta, temperature=temperature, student_logit_scale=student_logit_scale,
                            student_softcap=student_final_logit_softcapping, teacher_logit_scale=teacher_logit_scale,
                            teacher_softcap=teacher_final_logit_softcapping)
    loss, metrics = reference_distill_loss(student_hidden_states, student_lm_head_weight, teacher_hidden_states,
                                           teacher_lm_head_weight, completion_mask, student_lm_head_bias,
                                           teacher_lm_head_bias, num_items_in_batch, cfg)
    return loss, metrics["entropy_sum"], (completion_mask.reshape(-1) != 0).sum()


def train(tmp_path, patched: bool, dtype=torch.float32, student: dict | None = None, teacher: dict | None = None,
          reference: bool = False, **overrides):
    """TRL's DistillationTrainer for a few steps on a fresh student (width 16) and teacher (width 24) in ``dtype``
    (``student`` / ``teacher``: ``tiny_model`` keywords), ``patch_trl()``-ed or not; ``reference``: its loss replaced
    by ``reference_loss``. Returns (log_history, final student parameters, grpo_kernels calls, the
    ``CallCounter``)."""
    from trl import DistillationConfig, DistillationTrainer

    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    from .trl_runs import train_quietly

    tokenizer = char_tokenizer()
    run = ("patched" if patched else "trl") + ("-float64" if dtype == torch.float64 else "")
    options = dict(output_dir=str(tmp_path / run), per_device_train_batch_size=4, max_completion_length=6,
                   max_steps=3, learning_rate=3e-2, logging_steps=1, report_to="none", use_cpu=True, bf16=False,
                   seed=0, save_strategy="no", disable_tqdm=True, beta=0.5, temperature=0.9)
    options.update(overrides)
    counter = CallCounter()
    with counter.counting(), pytest.MonkeyPatch.context() as mp:
        if reference:
            mp.setattr(importlib.import_module(TRAINER_MODULE), "_chunked_divergence_loss", reference_loss)
        try:
            if patched:
                patch_trl()
            trainer = DistillationTrainer(
                model=tiny_model(tokenizer, STUDENT_WIDTH, 0, dtype, **(student or {})),
                teacher_model=tiny_model(tokenizer, TEACHER_WIDTH, 1, dtype, **(teacher or {})),
                args=DistillationConfig(**options), train_dataset=_dataset(), processing_class=tokenizer)
            train_quietly(trainer)
        finally:
            unpatch_trl()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer.state.log_history, params, counter.loss + counter.function, counter


def _dataset():
    from datasets import Dataset

    return Dataset.from_dict({"prompt": PROMPTS * 2})


def compare_runs(tmp_path, truth: str = "reference", **cfg):
    """Stock fp32, patched fp32 and a float64 truth: every logged metric and final parameter by the three-way rule
    (``assert_same_run``); stock went through TRL's maths only, the patched run through grpo_kernels' only. The
    truth: ``reference_loss`` in the trainer ("reference"; TRL 1.15 / 1.16's function computes in fp32 whatever its
    inputs) or stock TRL ("trl": 1.12-1.14's PyTorch chunks compute in the model's dtype); neither runs the
    integration under test. Returns the stock run's log history."""
    from .trl_runs import assert_same_run

    *ref, ref_counter = train(tmp_path, False, **cfg)
    *out, counter = train(tmp_path, True, **cfg)
    *t_run, t_counter = train(tmp_path, False, torch.float64, reference=truth == "reference", **cfg)
    assert ref_counter.trl_loss > 0 and ref_counter.loss == ref_counter.function == 0, "stock must be TRL's own"
    assert counter.trl == 0, "a patched call went to TRL's distillation maths"
    assert counter.loss > 0 and counter.function == 0, "the trainer's loss must be fused_linear_distill_loss"
    assert t_counter.loss == t_counter.function == 0
    assert_same_run(ref, out, t_run, truth_patched=False)
    return ref[0]


# ------------------------------------------------------------------------------------- direct calls of the seam

def head_inputs(n=13, student_width=8, teacher_width=12, vocab=37, bias=True, dtype=torch.float32, seed=0):
    """(student hidden, weight, bias, teacher hidden, weight, bias) for a direct call of TRL's
    ``ChunkedDivergenceFunction``: the student's three require grad, the teacher's too (it must get none)."""
    g = torch.Generator().manual_seed(seed)

    def t(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()

    sh, sw = t(n, student_width), t(vocab, student_width, scale=0.6)
    sb = t(vocab, scale=0.5) if bias else None
    th, tw = t(n, teacher_width), t(vocab, teacher_width, scale=0.6)
    tb = t(vocab, scale=0.5) if bias else None
    return sh, sw, sb, th, tw, tb


def upstream(n: int, seed: int = 1) -> torch.Tensor:
    """A non-uniform d loss / d divergence per token (a weighted sum, so each row's gradient is scaled on its own)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.25


def run_function(fn, tensors: tuple, options: tuple):
    """``fn.apply(*tensors, *options)`` (TRL's positional call), then the backward of ``sum(upstream * D)``:
    ((divergence, entropy), [d student hidden, d weight, d bias]); the teacher's grads must stay None."""
    for x in tensors:
        if x is not None:
            x.grad = None
    div, ent = fn.apply(*tensors, *options)
    (upstream(div.shape[0]).to(div.dtype) * div).sum().backward()
    assert all(x is None or x.grad is None for x in tensors[3:]), "the teacher got a gradient"
    assert not ent.requires_grad, "the entropy must carry no gradient (TRL's)"
    return (div.detach(), ent.detach()), [x.grad.clone() for x in tensors[:3] if x is not None]


def function_truth(tensors: tuple, options: tuple, dtype=torch.float64):
    """What ``run_function`` computes, by the reference on full logits in ``dtype`` (float64: the truth; fp32: the
    plain computation of the three-way rule's middle term)."""
    from grpo_kernels.distill_config import DistillLossConfig
    from grpo_kernels.distill_reference import reference_token_divergence

    beta, temperature, s_scale, s_cap, t_scale, t_cap = options
    cfg = DistillLossConfig(beta=beta, temperature=temperature, student_logit_scale=s_scale, student_softcap=s_cap,
                            teacher_logit_scale=t_scale, teacher_softcap=t_cap)
    leaves = [None if x is None else x.detach().to(dtype).requires_grad_(i < 3) for i, x in enumerate(tensors)]
    sh, sw, sb, th, tw, tb = leaves
    div, ent = reference_token_divergence(sh, sw, th, tw, sb, tb, config=cfg)
    grads = torch.autograd.grad((upstream(div.shape[0]).to(dtype) * div).sum(), [x for x in leaves[:3] if x is not None])
    return (div.detach(), ent.detach()), list(grads)


def assert_function_three_way(ours, theirs, truth, what: str = "", operations: int = 1024):
    """``run_function`` results: ours against the float64 truth, TRL's own function in fp32 the middle term; values
    relative to max(1, max |truth|), gradients to their own largest value. And TRL's own against the truth, so that
    the truth is TRL's maths (a reference wrong like ours would widen the middle term instead): each of TRL's values
    comes from at most ``operations`` rounded fp32 operations on values no larger than the scale (N (V + H) + V at
    these shapes: 13 (37 + 12) + 37 = 674 < 1024), so it is within gamma(operations) of exact, relative to that scale
    (Higham; measured here: 3.4e-6 against gamma(1024) = 6.1e-5)."""
    from .tolerances import assert_three_way, gamma, grad_scale, max_err

    (values, grads), (n_values, n_grads), (t_values, t_grads) = ours, theirs, truth
    for name, o, n, t in zip(("divergence", "entropy"), values, n_values, t_values):
        assert_three_way(o, n, t, torch.float32, f"{what} {name}")
        scale = max(t.abs().max().item() if t.numel() else 1.0, 1.0)
        assert max_err(n, t) <= gamma(operations) * scale, f"{what} {name}: TRL's own is not the truth's maths"
    for name, o, n, t in zip(("d student hidden", "d student weight", "d student bias"), grads, n_grads, t_grads):
        assert_three_way(o, n, t, torch.float32, f"{what} {name}", scale=grad_scale(t))
        assert max_err(n, t) <= gamma(operations) * grad_scale(t), f"{what} {name}: TRL's own is not the truth's"
