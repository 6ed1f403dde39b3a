"""``grpo_kernels.openrlhf``'s ``Actor.forward`` against OpenRLHF 0.11.2's own, on Actors built as OpenRLHF builds
them (tests/support/openrlhf_actors.py: a tiny Llama saved here, loaded by ``openrlhf.models.Actor``), padded and
packed (``packing_samples``), for each call OpenRLHF's trainers make: the policy's training step (log-probs, entropy,
gradients), the old / reference log-probs (no grad), SFT's step and DPO's reference pass (``return_logprobs``).

The pass rule is the three-way one (tests/support/tolerances.py): ours against float64 ground truth within K times
OpenRLHF's own error in fp32 plus ATOL; the truth is computed from the hidden states the head received in that very
call (a forward hook on the backbone), so the backbone's own rounding is the same in all three. Gradients are those of
sum(a * logp + b * entropy) with respect to those hidden states and ``lm_head.weight``, relative to their largest
value. The bf16 test and the MoE, PEFT and fallback tests are in test_openrlhf_variants.py."""
from __future__ import annotations

import pytest
import torch

from ..support.openrlhf_env import require_openrlhf
from ..support.tolerances import assert_three_way, grad_scale

gk_openrlhf = require_openrlhf()
from ..support.openrlhf_actors import (CALLS, build_actor, float64_truth, make_batch, patched_forward,  # noqa: E402
                                       run_call)

pytestmark = pytest.mark.usefixtures("openrlhf_patched")  # tests/openrlhf/conftest.py


def check(actor, batch, call):
    ours = run_call(actor, patched_forward, batch, call)
    stock = run_call(actor, gk_openrlhf.stock_forward, batch, call)
    torch.testing.assert_close(ours.hidden, stock.hidden, rtol=0, atol=0)  # the same backbone call: equal inputs
    truth = float64_truth(actor, batch, call, ours)
    assert ours.logp.shape == stock.logp.shape and ours.logp.dtype == torch.float32
    assert_three_way(ours.logp, stock.logp, truth[0], torch.float32, f"{call.name} logp")
    if call.entropy:
        assert_three_way(ours.entropy, stock.entropy, truth[1], torch.float32, f"{call.name} entropy")
    if call.grad:
        assert_three_way(ours.d_hidden, stock.d_hidden, truth[2], torch.float32, f"{call.name} d hidden",
                         scale=grad_scale(truth[2]))
        assert_three_way(ours.d_weight, stock.d_weight, truth[3], torch.float32, f"{call.name} d lm_head.weight",
                         scale=grad_scale(truth[3]))
    return ours, stock


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("name", list(CALLS))
def test_call_matches_openrlhf(folder, packing, name):
    actor = build_actor(folder, packing=packing)
    batch = make_batch()
    ours, stock = check(actor, batch, CALLS[name])
    # the logits are never built: a served call hands back the model's output without them
    assert ours.output.logits is None and "logits" not in ours.output
    assert stock.output["logits"].shape[-1] == actor.model.config.vocab_size  # OpenRLHF's: every position's
    if CALLS[name].actions:  # where the action mask drops a token, both give exactly 0
        assert torch.equal(ours.logp[~batch.action_mask], torch.zeros_like(ours.logp[~batch.action_mask]))
        assert torch.equal(stock.logp[~batch.action_mask].abs(), torch.zeros_like(ours.logp[~batch.action_mask]))


def test_entropy_columns_outside_the_actions_hold_zero(folder):
    """output.entropy is (B, T - 1) like OpenRLHF's; the columns before the last A (OpenRLHF never reads them) and
    the action positions the mask drops hold 0, the others the entropy (checked above)."""
    actor = build_actor(folder)
    batch = make_batch()
    _, output = actor(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask, return_output=True,
                      return_entropy=True)
    actions = batch.action_mask.shape[1]
    assert output.entropy.shape == (batch.sequences.shape[0], batch.sequences.shape[1] - 1)
    assert torch.equal(output.entropy[:, :-actions], torch.zeros_like(output.entropy[:, :-actions]))
    dropped = output.entropy[:, -actions:][~batch.action_mask]
    assert torch.equal(dropped, torch.zeros_like(dropped))
    assert (output.entropy[:, -actions:][batch.action_mask] > 0).all()


@pytest.mark.parametrize("temperature", [1.0, 1.6])
def test_temperature(folder, temperature):
    """The actor's temperature divides the logits before the log-softmax and the entropy, as OpenRLHF's in-place
    division does (1.0: OpenRLHF skips the division)."""
    actor = build_actor(folder, temperature=temperature)
    batch = make_batch(seed=3)
    call = CALLS["policy"]
    ours = run_call(actor, patched_forward, batch, call)
    stock = run_call(actor, gk_openrlhf.stock_forward, batch, call)
    truth = float64_truth(actor, batch, call, ours, temperature=temperature)
    assert_three_way(ours.logp, stock.logp, truth[0], torch.float32, "logp")
    assert_three_way(ours.entropy, stock.entropy, truth[1], torch.float32, "entropy")


def test_gradient_reaches_every_parameter(folder):
    """A policy step's gradient reaches the same parameters as OpenRLHF's (every one of the tiny Llama's), none of them
    zero: the backbone's through d hidden (compared with the rule above), the head's directly."""
    actor = build_actor(folder)
    batch = make_batch(seed=5)
    grads = []
    for forward in (patched_forward, gk_openrlhf.stock_forward):
        actor.zero_grad(set_to_none=True)
        logp, output = forward(actor, batch.sequences, batch.action_mask, attention_mask=batch.attention_mask,
                               return_output=True, return_entropy=True)
        (logp.sum() - 0.1 * output.entropy[:, -batch.action_mask.shape[1]:].sum()).backward()
        grads.append({n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None})
    ours, stock = grads
    assert ours.keys() == stock.keys() and len(ours) == len(list(actor.parameters()))
    assert all(g.abs().max() > 0 for g in ours.values())


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_gradient_checkpointing(folder, packing):
    """OpenRLHF's ``--ds.gradient_checkpointing`` (``actor.gradient_checkpointing_enable()``): the backbone recomputes
    in the backward; the hidden states the head receives and the results are those of the rule above."""
    actor = build_actor(folder, packing=packing)
    actor.gradient_checkpointing_enable()
    actor.train()
    check(actor, make_batch(seed=9), CALLS["policy"])


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["policy", "old_or_reference"])
def test_triton_kernels(folder, monkeypatch, plans, name):
    """The Triton kernels (``GRPO_KERNELS_IMPL=triton``, the path CUDA tensors take; here under the interpreter) on
    the same calls: the rule above, padded (a slice of the hidden states, not contiguous) and packed alike."""
    monkeypatch.setenv("GRPO_KERNELS_IMPL", "triton")
    for packing in (False, True):
        plans.clear()
        check(build_actor(folder, packing=packing), make_batch(batch=2, seed=13), CALLS[name])
        # ours planned its head call (OpenRLHF's own forward plans nothing), on the Triton kernels
        assert plans and all(plan.impl == "triton" for plan in plans), [(p.path, p.impl) for p in plans]
