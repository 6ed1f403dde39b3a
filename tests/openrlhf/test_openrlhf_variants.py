"""``grpo_kernels.openrlhf`` beyond the plain fp32 Llama (test_openrlhf_actor.py): bf16 weights and the default
``round_logits="model"``, an MoE actor's ``aux_loss``, a LoRA actor (PEFT, ``get_base_model()``), the calls handed
to OpenRLHF's own forward (warned once, OpenRLHF's exact results), argument errors, and patch / unpatch / report."""
from __future__ import annotations

import logging
import warnings

import pytest
import torch

from ..support.openrlhf_env import require_openrlhf
from ..support.tolerances import ATOL, assert_three_way, grad_scale, same_maths_slack

gk_openrlhf = require_openrlhf()
from openrlhf.models import Actor  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402

from grpo_kernels.integrations import openrlhf as integration  # noqa: E402

from ..support.openrlhf_actors import (CALLS, build_actor, float64_truth, make_batch, patched_forward,  # noqa: E402
                                       run_call)

pytestmark = pytest.mark.usefixtures("openrlhf_patched")  # tests/openrlhf/conftest.py


def test_bf16_default_rounds_logits_as_openrlhf(folder):
    """bf16 weights: OpenRLHF's lm_head output is bf16, cast to fp32 after; the default round_logits="model" rounds
    our fp32-accumulated logits to bf16 the same way. Both then agree with the float64 recipe (exact logits rounded
    to bf16 once) to the bf16 rule; without the rounding (round_logits=None) the log-probs move by bf16's rounding of
    the logits, which at most tokens exceeds the agreement of the rounded ones by far."""
    actor = build_actor(folder, dtype=torch.bfloat16)
    batch = make_batch(batch=4, seed=11)
    call = CALLS["policy"]
    ours = run_call(actor, patched_forward, batch, call)
    stock = run_call(actor, gk_openrlhf.stock_forward, batch, call)
    truth = float64_truth(actor, batch, call, ours, rounding="bf16")
    assert_three_way(ours.logp, stock.logp, truth[0], torch.bfloat16, "logp")
    assert_three_way(ours.entropy, stock.entropy, truth[1], torch.bfloat16, "entropy")
    assert_three_way(ours.d_hidden, stock.d_hidden, truth[2], torch.bfloat16, "d hidden", scale=grad_scale(truth[2]))
    gk_openrlhf.patch(round_logits=None)
    unrounded = run_call(actor, patched_forward, batch, call)
    read = batch.action_mask
    rounded_gap = (ours.logp - stock.logp)[read].abs().median().item()
    unrounded_gap = (unrounded.logp - stock.logp)[read].abs().median().item()
    # the same maths, sums in another order: most tokens (all whose logits no fp32 difference moves across a bf16
    # rounding boundary, the rare exception) agree to fp32 rounding, so the median does
    assert rounded_gap <= same_maths_slack(torch.float32) * max(1.0, stock.logp.abs().max().item())
    # bound: "clearly different": fp32 logits miss bf16's rounding (~2^-9 relative per logit) at almost every token
    assert unrounded_gap > 10 * max(rounded_gap, ATOL[torch.float32])


@pytest.mark.parametrize("name", ["policy", "sft", "dpo_reference"])
def test_moe_aux_loss(folder, name):
    """A Mixtral actor (OpenRLHF sets output_router_logits): the model's own forward still computes aux_loss from
    its routers, equal to OpenRLHF's (the same code on the same router logits); the log-probs pass the rule."""
    actor = build_actor(folder, kind="mixtral")
    assert actor.model.config.output_router_logits
    batch, call = make_batch(seed=2), CALLS[name]
    ours = run_call(actor, patched_forward, batch, call)
    stock = run_call(actor, gk_openrlhf.stock_forward, batch, call)
    assert "aux_loss" in ours.output and torch.equal(ours.output.aux_loss.detach(), stock.output.aux_loss.detach())
    assert type(ours.output) is type(stock.output)
    truth = float64_truth(actor, batch, call, ours)
    assert_three_way(ours.logp, stock.logp, truth[0], torch.float32, "logp")
    if call.grad:
        assert_three_way(ours.d_hidden, stock.d_hidden, truth[2], torch.float32, "d hidden",
                         scale=grad_scale(truth[2]))


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_lora_actor(folder, packing):
    """``lora_rank > 0``: OpenRLHF wraps the model in PEFT; the head is found through ``get_base_model()``, the
    adapters run inside the backbone, the frozen head gets no gradient, the adapters get theirs."""
    actor = build_actor(folder, packing=packing, lora_rank=4)
    batch, call = make_batch(seed=4), CALLS["policy"]
    for p in actor.parameters():
        p.grad = None
    ours = run_call(actor, patched_forward, batch, call)
    lora_grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    stock = run_call(actor, gk_openrlhf.stock_forward, batch, call)
    truth = float64_truth(actor, batch, call, ours)
    assert_three_way(ours.logp, stock.logp, truth[0], torch.float32, "logp")
    assert_three_way(ours.entropy, stock.entropy, truth[1], torch.float32, "entropy")
    assert_three_way(ours.d_hidden, stock.d_hidden, truth[2], torch.float32, "d hidden", scale=grad_scale(truth[2]))
    assert ours.d_weight is None and stock.d_weight is None  # the frozen head
    assert lora_grads and all("lora_" in n for n in lora_grads)


def test_logits_calls_fall_back_once_with_a_warning(folder):
    """A call that returns the logits, and one with allgather_logits, run OpenRLHF's own forward: OpenRLHF's exact
    results, one warning per reason."""
    actor = build_actor(folder)
    batch = make_batch()
    integration._STATE["warned"].clear()
    with pytest.warns(UserWarning, match="returns the logits"):
        output = actor(batch.sequences, attention_mask=batch.attention_mask, return_output=True)
    stock = gk_openrlhf.stock_forward(actor, batch.sequences, attention_mask=batch.attention_mask, return_output=True)
    assert torch.equal(output.logits, stock.logits)  # the same code on the same values
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the second call is silent
        actor(batch.sequences, attention_mask=batch.attention_mask, return_output=True)
    with pytest.warns(UserWarning, match="allgather_logits"):
        logp = actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask, allgather_logits=True)
    assert torch.equal(logp, gk_openrlhf.stock_forward(actor, batch.sequences, batch.action_mask,
                                                       attention_mask=batch.attention_mask))


class _TableLM(torch.nn.Module):
    """A model without an lm_head (OpenRLHF's own actor test uses one): logits are a per-token table."""

    def __init__(self, vocab=11):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(0)))

    def forward(self, input_ids, attention_mask=None, position_ids=None, **_):
        return CausalLMOutputWithPast(logits=self.table[input_ids])


def test_model_without_lm_head_falls_back():
    actor = Actor(_TableLM(), temperature=0.5)
    actor.packing_samples = False
    ids = torch.randint(0, 11, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    integration._STATE["warned"].clear()
    with pytest.warns(UserWarning, match="has no lm_head"):
        logp, out = actor(ids, torch.ones(2, 5), attention_mask=mask, return_output=True, return_entropy=True)
    logp0, out0 = gk_openrlhf.stock_forward(actor, ids, torch.ones(2, 5), attention_mask=mask, return_output=True,
                                            return_entropy=True)
    assert torch.equal(logp, logp0) and torch.equal(out.entropy, out0.entropy)


def test_blockers_name_the_reason(folder):
    actor = build_actor(folder)
    mask = torch.ones(1, 2)
    assert "ring attention" in integration._call_blocker(actor, mask, False, False, object(), {})
    assert "vision-language" in integration._call_blocker(actor, mask, False, False, None, {"pixel_values": mask})
    assert integration._call_blocker(actor, mask, False, False, None, {}) is None
    actor.model.config.final_logit_softcapping = -1.0
    assert "final_logit_softcapping" in integration._call_blocker(actor, mask, False, False, None, {})


def test_argument_errors(folder):
    actor = build_actor(folder)
    batch = make_batch()
    with pytest.raises(ValueError, match="return_entropy=True needs return_output=True"):
        actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask, return_entropy=True)
    too_wide = torch.ones(batch.sequences.shape, dtype=torch.bool)
    with pytest.raises(ValueError, match="action_mask must have 1 to T - 1"):
        actor(batch.sequences, too_wide, attention_mask=batch.attention_mask)


def test_patch_unpatch_and_report(caplog):
    original = integration._STATE["originals"][Actor]
    assert Actor.forward is integration.fused_actor_forward and gk_openrlhf.is_openrlhf_patched()
    gk_openrlhf.unpatch()
    assert Actor.forward is original and not gk_openrlhf.is_openrlhf_patched()
    gk_openrlhf.unpatch()  # a no-op
    with caplog.at_level(logging.INFO, logger="grpo_kernels"):
        report = gk_openrlhf.patch()
    assert report.newly_patched and report.patched == ("openrlhf.models.actor.Actor.forward",)
    assert [r.message for r in caplog.records if "grpo_kernels.openrlhf" in r.message][0].count("\n") == 0
    again = gk_openrlhf.patch(round_logits=None, batch_invariant=True)
    assert not again.newly_patched and again.round_logits is None and again.batch_invariant
    text = str(again)
    assert "already patched" in text and "ring attention" in text and "OpenRLHF " in text
    assert {r.runs_on for r in again.routes} == {"grpo_kernels", "OpenRLHF"}


def test_options_from_the_environment(monkeypatch):
    monkeypatch.setenv(integration.ROUND_LOGITS_ENV, "none")
    monkeypatch.setenv(integration.BATCH_INVARIANT_ENV, "1")
    report = gk_openrlhf.patch()
    assert report.round_logits is None and report.batch_invariant
    monkeypatch.setenv(integration.ROUND_LOGITS_ENV, "bfloat16")
    with pytest.raises(ValueError, match="round_logits must be one of"):
        gk_openrlhf.patch()
    with pytest.raises(ValueError, match="batch_invariant must be a bool"):
        gk_openrlhf.patch(round_logits="bf16", batch_invariant="yes")


def test_refuses_other_openrlhf_versions(monkeypatch):
    gk_openrlhf.unpatch()
    monkeypatch.setattr(integration, "_openrlhf_version", lambda: "0.12.0")
    with pytest.raises(RuntimeError, match="supports OpenRLHF 0.11.x, found 0.12.0; nothing was patched"):
        gk_openrlhf.patch()
    assert not gk_openrlhf.is_openrlhf_patched() and Actor.forward is not integration.fused_actor_forward


def test_patches_a_copy_of_the_actor_class():
    """``actor_class=``: a copy of OpenRLHF's actor module loaded under another name (OpenRLHF's own unit tests do
    that) is patched and unpatched like the real one."""
    copy = type("Actor", (torch.nn.Module,), {"forward": lambda self, *a, **k: "stock", "__module__": __name__})
    report = gk_openrlhf.patch(actor_class=copy)
    assert copy.forward is integration.fused_actor_forward and len(report.patched) == 2
    gk_openrlhf.unpatch()
    assert copy().forward() == "stock" and Actor.forward is not integration.fused_actor_forward


def test_ray_runtime_env():
    env = gk_openrlhf.ray_runtime_env({"env_vars": {"NCCL_DEBUG": "WARN"}})
    assert env == {"env_vars": {"NCCL_DEBUG": "WARN"}, "worker_process_setup_hook": "grpo_kernels.openrlhf.patch"}
    assert gk_openrlhf.ray_runtime_env(env) == env and gk_openrlhf.ray_runtime_env() == {
        "worker_process_setup_hook": gk_openrlhf.SETUP_HOOK}
    with pytest.raises(ValueError, match="already has worker_process_setup_hook"):
        gk_openrlhf.ray_runtime_env({"worker_process_setup_hook": "mine.setup"})
    with pytest.raises(SystemExit, match="usage: python -m grpo_kernels.openrlhf MODULE"):
        gk_openrlhf.main([])


def test_dpo_trainer_concatenated_forward(folder):
    """OpenRLHF's own ``DPOTrainer.concatenated_forward`` (chosen and rejected concatenated, ``return_logprobs``,
    ``_get_batch_logps`` over the answer tokens) and its ``DPOLoss``, on a trainer holding only what that method reads:
    the patched actor gives OpenRLHF's numbers (the same maths in another order) and gradient."""
    from types import SimpleNamespace

    from openrlhf.models import DPOLoss
    from openrlhf.trainer.dpo_trainer import DPOTrainer

    from ..support.tolerances import assert_same_maths

    trainer = object.__new__(DPOTrainer)
    trainer.strategy, trainer.tokenizer = SimpleNamespace(ring_attn_group=None), SimpleNamespace(pad_token_id=0)
    actor = build_actor(folder)
    chosen, rejected = make_batch(seed=21), make_batch(seed=22, completion=3)
    prompt_lens = [6, 6, 6]  # a list, as OpenRLHF's collate gives it (concatenated_inputs repeats it: list * 2)
    head = actor.model.get_output_embeddings().weight
    results = []
    for forward in ("patched", "stock"):
        if forward == "stock":
            gk_openrlhf.unpatch()
        with torch.no_grad():
            ref_chosen, ref_rejected, _, _ = trainer.concatenated_forward(
                actor, chosen.sequences, chosen.attention_mask, rejected.sequences, rejected.attention_mask,
                prompt_lens)
        actor.zero_grad(set_to_none=True)
        chosen_logps, rejected_logps, _, nll = trainer.concatenated_forward(
            actor, chosen.sequences, chosen.attention_mask, rejected.sequences, rejected.attention_mask, prompt_lens)
        loss, _, _ = DPOLoss(beta=0.1)(chosen_logps, rejected_logps, ref_chosen - 0.3, ref_rejected + 0.2)
        (loss + 0.1 * nll).backward()
        results.append((chosen_logps.detach(), rejected_logps.detach(), loss.detach(), head.grad.clone()))
    gk_openrlhf.patch()
    assert (results[0][0] < 0).all() and (results[0][1] < 0).all()  # every answer scored (no empty loss mask)
    for name, ours, stock in zip(("chosen", "rejected", "loss", "d lm_head.weight"), *results):
        scale = grad_scale(stock) if name.startswith("d ") else None
        assert_same_maths(ours, stock, torch.float32, name, scale=scale)


def test_model_inside_an_engine_wrapper(folder):
    """``actor.model`` wrapped as the ``.module`` of a DeepSpeed engine (OpenRLHF wraps the Actor itself, the ZeRO-3
    test's layout; a caller may hand an engine to ``Actor(engine)``): the head and backbone are found under
    ``.module``, the call goes through the wrapper. A wrapper class from the ``deepspeed`` package stands in for the
    engine here (no process group)."""
    actor = build_actor(folder)

    class Engine(torch.nn.Module):
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    Engine.__module__ = "deepspeed.runtime.engine"
    wrapped = Actor(Engine(actor.model), temperature=actor.temperature)
    wrapped.packing_samples = False
    assert integration._unwrap(wrapped.model) is actor.model
    batch, call = make_batch(seed=8), CALLS["policy"]
    ours = run_call(wrapped, patched_forward, batch, call)
    stock = run_call(wrapped, gk_openrlhf.stock_forward, batch, call)
    assert ours.output.logits is None  # served, not handed to OpenRLHF's forward
    truth = float64_truth(wrapped, batch, call, ours)
    assert_three_way(ours.logp, stock.logp, truth[0], torch.float32, "logp")
    assert_three_way(ours.d_hidden, stock.d_hidden, truth[2], torch.float32, "d hidden", scale=grad_scale(truth[2]))


def test_flash_attn_stand_in(tmp_path):
    """The test-only flash_attn stand-in (tests/openrlhf/stubs): unpad / pad round trip as OpenRLHF uses it, and its
    all_gather (forward and backward) on a one-rank gloo group."""
    import torch.distributed as dist
    from flash_attn.bert_padding import index_first_axis, pad_input, rearrange, unpad_input
    from flash_attn.utils.distributed import all_gather

    assert "stand-in" in __import__("flash_attn").__version__  # the stand-in, not a real flash-attn
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    x = torch.arange(8.0).reshape(2, 4, 1)
    rows, indices, cu_seqlens, longest, used = unpad_input(x, mask)
    assert rows.flatten().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0] and indices.tolist() == [1, 2, 3, 4, 5]
    assert cu_seqlens.tolist() == [0, 3, 5] and longest == 3 and used.tolist() == [3, 2]
    assert torch.equal(pad_input(rows, indices, 2, 4), x * mask.unsqueeze(-1))
    assert torch.equal(index_first_axis(rearrange(x, "b s ... -> (b s) ..."), indices), rows)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        y = torch.randn(3, 2, requires_grad=True)
        gathered = all_gather(y, dist.group.WORLD)
        (gathered * 2).sum().backward()
        assert torch.equal(gathered, y) and torch.equal(y.grad, torch.full_like(y, 2.0))
    finally:
        dist.destroy_process_group()
