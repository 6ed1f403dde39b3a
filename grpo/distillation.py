"""On-policy distillation in ``grpo.train`` (``--teacher PATH``): completions sampled from the student (the policy
being trained), every completion token scored against a frozen teacher with the fused two-head divergence
``grpo_kernels.fused_linear_distill_loss`` (neither model's B x T x V logits ever held).

- The teacher is a model folder (``save_pretrained``: a Hugging Face model folder, or the ``model/`` of a
  ``grpo.train`` checkpoint) or a ``grpo.train`` ``checkpoint-N`` folder itself (its ``model/`` is loaded). Its
  vocabulary must be the student's, id by id (the divergence compares the two next-token distributions id by id);
  its width, depth and architecture may differ.
- It is frozen: ``requires_grad_(False)``, eval mode, no dropout, run under ``no_grad``; it is no part of the policy
  module (``GRPOPolicy.distill`` is a plain attribute), so it is in no optimizer, no DDP bucket, no FSDP shard and no
  checkpoint. Under torchrun every rank loads its own full copy (it is not sharded). With autocast it is kept in the
  autocast dtype (it needs no fp32 master weights), like the reference model.
- Once per rollout (after sampling, like the reference pass) the teacher runs on every completion, packed where its
  attention supports it, and its final hidden states at the completion positions are kept: (B, T, H_teacher) in its
  compute dtype (``teacher_hidden_states``). Every optimizer step's micro-batches take their rows of them, so
  ``--num-iterations`` > 1 reuses one teacher pass.
- The loss of a micro-batch is ``--distill-coef * sum(D) / N``, D the per-token divergence over the completion
  tokens (``--distill-beta``: 0 forward KL(teacher || student), 1 reverse KL(student || teacher), between: the
  generalized JSD; both models' logits divided by ``--distill-temperature``), N the step's completion tokens (all
  ranks, averaged): so the step's distillation loss is the token mean over the whole step, whatever the cut into
  micro-batches. It is added to the GRPO loss, or alone with ``--distill-only`` (then no reference model is built and
  the GRPO loss is not computed; the rewards are still computed, for the log and the evaluation).
- Both heads score what the sampler can draw: the ids the sampler never draws (special tokens, ``--completion-chars``)
  get the same ``SUPPRESSED_LOGIT`` bias in the teacher's head as in the student's, so both distributions are over the
  same ids. Each model's own logit scale and soft cap (from its config) are applied to its own logits.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

import grpo_kernels as gk
from grpo_kernels.integrations.transformers import cast_to, get_lm_head

from .errors import UsageError
from .modeling import choose_attn_implementation, disable_dropout, load_pretrained, run_dtypes
from .packing import Packing, is_varlen, packed_micro_batches, packing_unsupported
from .policy import GRPOPolicy
from .rollout import Rollout
from .run_settings import weights_fingerprint
from .update import trim


def teacher_model_dir(path: str) -> str:
    """The model folder of ``--teacher PATH``: PATH itself, or a ``grpo.train`` checkpoint folder's ``model/``."""
    if os.path.isfile(os.path.join(path, "trainer_state.pt")) and os.path.isdir(os.path.join(path, "model")):
        return os.path.join(path, "model")
    return path


def check_vocabulary(teacher_lm, teacher_tokenizer, student_lm, student_tokenizer, path: str) -> None:
    """UsageError (one line) unless the teacher's output ids are the student's: the same number of them, and the
    same token for every id the tokenizers know."""
    v_teacher = teacher_lm.get_output_embeddings().weight.shape[0]
    v_student = student_lm.get_output_embeddings().weight.shape[0]
    if v_teacher != v_student:
        raise UsageError(f"--teacher {path!r}: its vocabulary has {v_teacher} ids, the student's {v_student}; "
                         "distillation compares the two models' next-token distributions id by id, so the teacher "
                         "must use the student's tokenizer")
    teacher_vocab, student_vocab = teacher_tokenizer.get_vocab(), student_tokenizer.get_vocab()
    if teacher_vocab != student_vocab:
        by_id = {i: t for t, i in student_vocab.items()}
        differ = sorted(i for t, i in teacher_vocab.items() if by_id.get(i) != t) + \
            sorted(set(by_id) - set(teacher_vocab.values()))
        first = differ[0]
        theirs = next((t for t, i in teacher_vocab.items() if i == first), None)
        raise UsageError(f"--teacher {path!r}: its tokenizer differs from the student's at {len(differ)} ids (id "
                         f"{first}: {theirs!r} for the teacher, {by_id.get(first)!r} for the student); distillation "
                         "compares the two models' next-token distributions id by id, so the teacher must use the "
                         "student's tokenizer")


@dataclass
class Teacher:
    """The frozen teacher of a run: ``policy`` (a ``GRPOPolicy`` around its model, used only for its hidden states
    and its head), ``packing`` (how its pass packs; None: padded rows), ``fingerprint`` (its weights as loaded, part
    of the run's identity: grpo/run_settings.py)."""

    policy: GRPOPolicy
    packing: Packing | None
    fingerprint: str

    @property
    def lm(self):
        return self.policy.lm


def load_teacher(cfg, student_lm, student_tokenizer, device: torch.device, banned: list[int]) -> Teacher:
    """The teacher of ``cfg.teacher``, loaded, checked against the student, frozen and on ``device``."""
    path = teacher_model_dir(cfg.teacher)
    dtype, autocast = run_dtypes(cfg.dtype, cfg.autocast, device.type)
    attn = choose_attn_implementation(cfg.attn_implementation, device, autocast or dtype)
    lm, tokenizer = load_pretrained(path, dtype, attn, cfg.trust_remote_code, flag="--teacher")
    check_vocabulary(lm, tokenizer, student_lm, student_tokenizer, cfg.teacher)
    fingerprint = weights_fingerprint(lm)
    lm.requires_grad_(False).eval()
    disable_dropout(lm)
    if autocast is not None:  # frozen: no fp32 master weights needed
        lm.to(autocast)
    lm.to(device)
    try:
        policy = GRPOPolicy(lm, cfg.loss, cfg.impl, autocast or dtype, autocast, banned).eval()
    except UsageError as exc:
        raise UsageError(f"--teacher {cfg.teacher!r}: {exc}") from None
    packing = None
    if cfg.packing and packing_unsupported(lm) is None:
        # its forwards are no collective (it is not sharded): no micro-batch count to agree on across ranks
        packing = Packing(max_tokens=cfg.max_tokens_per_micro_batch, one_row=is_varlen(lm), env=None)
    return Teacher(policy, packing, fingerprint)


@torch.no_grad()
def teacher_hidden_states(teacher: Teacher, rollout: Rollout, micro_batch_size: int) -> torch.Tensor:
    """(B, T, H_teacher) the teacher's final hidden states that predict every completion token of the rollout (0
    past each row's mask), in micro-batches of at most ``micro_batch_size`` sequences, packed when it can."""
    policy = teacher.policy
    device = rollout.completion_ids.device
    width = policy.lm.get_output_embeddings().weight.shape[1]
    dtype = policy.compute_dtype or policy.lm.get_output_embeddings().weight.dtype
    out = torch.zeros(*rollout.completion_ids.shape, width, dtype=dtype, device=device)
    if teacher.packing is not None:
        for packed in packed_micro_batches(rollout, list(range(rollout.batch_size)), teacher.packing,
                                           micro_batch_size):
            out[packed.token_rows, packed.token_cols] = policy.packed_hidden(packed).to(dtype)
        return out
    for rows in torch.arange(rollout.batch_size, device=device).split(micro_batch_size):
        batch = trim(rollout.batch(rows))
        hidden = policy.completion_hidden(batch["input_ids"], batch["attention_mask"], batch["prompt_length"])
        out[rows, :hidden.shape[1]] = hidden.to(dtype)
    return out


def distill_config(cfg, student_lm, teacher_lm) -> gk.DistillLossConfig:
    """The divergence's options: the run's --distill-* values, each model's own logit scale and soft cap, and the
    loss options that say how (not what) to compute: round_logits, batch_invariant, deterministic, memory_budget,
    grad_in_forward."""
    s, t, loss = get_lm_head(student_lm, gather=False), get_lm_head(teacher_lm), cfg.loss
    return gk.DistillLossConfig(
        beta=float(cfg.distill_beta), temperature=float(cfg.distill_temperature),
        student_logit_scale=s.logit_scale, student_softcap=s.softcap, teacher_logit_scale=t.logit_scale,
        teacher_softcap=t.softcap, round_logits=loss.round_logits, batch_invariant=loss.batch_invariant,
        deterministic=loss.deterministic or loss.batch_invariant, grad_in_forward=loss.grad_in_forward,
        memory_budget=loss.memory_budget)


class DistillTerm:
    """The distillation term of ``GRPOPolicy.forward`` (``policy.distill``): ``coef`` times the two-head loss of a
    micro-batch's completion tokens against the teacher's head. ``only``: the run has no GRPO term."""

    def __init__(self, teacher: Teacher, config: gk.DistillLossConfig, coef: float, only: bool):
        self.teacher, self.config, self.coef, self.only = teacher, config, float(coef), only

    def loss(self, batch: dict, hidden, weight, bias, num_items, impl: str):
        """(coef x loss, {"distill/divergence", "distill/entropy"}) of a micro-batch (padded rows (B, T, H) or a
        packed one (N, H)), the student's ``hidden, weight, bias`` as its GRPO loss gets them, the teacher's hidden
        states from ``batch["teacher_hidden"]``; ``num_items``: the step's token count (None: this micro-batch's)."""
        teacher = self.teacher.policy
        t_weight, t_bias = teacher.head()
        t_hidden, t_weight, t_bias = cast_to(teacher.compute_dtype or t_weight.dtype, batch["teacher_hidden"],
                                             t_weight, t_bias)
        packed = batch.get("packed")
        mask = batch["completion_mask"] if packed is None else packed.completion_mask
        loss, metrics = gk.fused_linear_distill_loss(
            hidden, weight, t_hidden, t_weight, mask, student_bias=bias, teacher_bias=t_bias,
            num_items_in_batch=num_items, cu_seqlens=None if packed is None else packed.cu_seqlens,
            config=self.config, impl=impl)
        scaled = loss if self.coef == 1.0 else loss * self.coef
        return scaled, {"distill/divergence": metrics["divergence"], "distill/entropy": metrics["entropy"]}
