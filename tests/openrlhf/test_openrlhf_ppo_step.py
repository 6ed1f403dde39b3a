"""OpenRLHF 0.11.2's own PPO / GRPO training step, ``ActorPPOTrainer.training_step`` (trainer/ray/ppo_actor.py: the
actor's forward with ``return_entropy``, its ``PolicyLoss`` with clipping, the k3 KL loss against reference
log-probs, the entropy loss, ``strategy.backward``), on the patched actor against OpenRLHF's own forward: the same
metrics and the same gradient of every parameter, padded and packed.

The trainer object holds only what that method reads (a ``SimpleNamespace``: the actor, OpenRLHF's ``PolicyLoss``, the
arguments, a strategy whose ``backward`` is ``loss.backward()`` and whose optimizer step does nothing, so that both
variants see the same parameters). Importing ppo_actor imports ``openrlhf.trainer.ray.vllm_engine``, which imports
vLLM at load; vLLM is not installed here and the step never calls it, so a ``MagicMock`` stands in for that module
while ppo_actor is imported (as OpenRLHF's own ``tests/test_ppo_trainer.py`` does). The old and reference log-probs
come from the actor's own no-grad pass (``PolicyModelActor.forward``'s call, OpenRLHF's forward, once for both
variants: a count such as the clip ratio then cannot differ by a token at the clip boundary), perturbed so that the
ratio clips and the KL is not 0 (the no-grad pass patched: test_openrlhf_actor.py). fp32: two evaluations of the same maths, sums in another order (``same_maths_slack``)."""
from __future__ import annotations

import sys
from types import SimpleNamespace
from unittest.mock import MagicMock

import pytest
import torch

from ..support.openrlhf_env import require_openrlhf
from ..support.tolerances import assert_same_maths

gk_openrlhf = require_openrlhf()
from ..support.openrlhf_actors import build_actor, make_batch  # noqa: E402


@pytest.fixture(scope="module")
def ppo_actor():
    engine = "openrlhf.trainer.ray.vllm_engine"
    missing = engine not in sys.modules
    if missing:
        sys.modules[engine] = MagicMock()
    try:
        import openrlhf.trainer.ray.ppo_actor as module
    finally:
        if missing:
            del sys.modules[engine]
    return module


def _trainer(actor, module):
    from openrlhf.models import PolicyLoss

    args = SimpleNamespace(train=SimpleNamespace(dynamic_batch_enable=False),
                           algo=SimpleNamespace(kl=SimpleNamespace(use_loss=True, init_coef=0.05, estimator="k3",
                                                                   unbiased_gradient=False)),
                           actor=SimpleNamespace(entropy_coef=0.01, aux_loss_coef=0.0))
    strategy = SimpleNamespace(ring_attn_group=None, backward=lambda loss, model, optimizer: loss.backward(),
                               optimizer_step=lambda *a, **k: None, get_grad_norm=lambda model: 0.0)
    return SimpleNamespace(actor=actor, args=args, strategy=strategy, actor_loss_fn=PolicyLoss(0.2, 0.28),
                           aux_loss=False, actor_optim=None, actor_scheduler=SimpleNamespace(get_last_lr=lambda: [0.0]),
                           ema_model=None, replay_buffer=None)


def _experience(actor, batch, module):
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # PolicyModelActor.forward's call: the old log-probs
        old = gk_openrlhf.stock_forward(actor, batch.sequences, batch.action_mask, batch.attention_mask)
    shape = old.shape
    return module.Experience(sequences=batch.sequences, attention_mask=batch.attention_mask,
                             action_mask=batch.action_mask, action_log_probs=old + 0.3 * torch.randn(shape, generator=g),
                             base_action_log_probs=old - 0.2 * torch.randn(shape, generator=g).abs(),
                             advantages=torch.randn(shape[0], 1, generator=g).expand(shape).clone(), info={})


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_training_step_matches_openrlhf(tmp_path, ppo_actor, packing):
    actor = build_actor(tmp_path, packing=packing)
    batch = make_batch(batch=4, seed=17)
    runs = []
    experience = _experience(actor, batch, ppo_actor)
    for variant in ("patched", "stock"):
        if variant == "stock":
            gk_openrlhf.unpatch()
        try:
            experience.info.clear()
            actor.zero_grad(set_to_none=True)
            out = ppo_actor.ActorPPOTrainer.training_step(_trainer(actor, ppo_actor), experience, 1.0, 0, {})
        finally:
            gk_openrlhf.patch()
        grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        runs.append(({k: v.clone() if torch.is_tensor(v) else v for k, v in out["metrics"].items()}, grads))
    (ours, ours_grads), (stock, stock_grads) = runs
    names = ("policy_loss", "entropy_loss", "ppo_clip_ratio", "ppo_kl", "kl", "logprobs_diff")
    assert set(names) <= set(ours) and set(names) <= set(stock)
    assert stock["ppo_clip_ratio"] > 0 and stock["kl"] > 0  # the case clips and has a KL term
    for name in names:
        assert_same_maths(ours[name], stock[name], torch.float32, name)
    assert ours_grads.keys() == stock_grads.keys() and len(ours_grads) == len(list(actor.parameters()))
    for name, grad in stock_grads.items():
        assert_same_maths(ours_grads[name], grad, torch.float32, f"d {name}")
