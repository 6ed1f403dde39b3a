"""The patched ``Actor.forward`` inside a real DeepSpeed ZeRO-3 engine on CPU (2 gloo ranks), as OpenRLHF's strategy
prepares an actor (``deepspeed.initialize(model=actor)``: the engine's forward is ``Actor.forward``): every parameter
partitioned, the head gathered for the fused call by ``zero3_gather_head`` (``lm_head`` itself ran on no row and
ZeRO-3 released it). Each rank runs a policy step (log-probs, entropy, ``engine.backward``, the full gradients read
with ``safe_get_full_grad``) and a no-grad reference pass, patched and then with OpenRLHF's own forward on the same
engine. Ground truth: an unsharded copy with OpenRLHF's own forward, the gradients' mean over ranks (DeepSpeed
averages data-parallel gradients). fp32: the same maths in another order (``same_maths_slack``)."""
from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest
import torch

if __name__ != "__main__":
    from ..support.openrlhf_env import require_openrlhf

    require_openrlhf()
WORLD = 2
STEPS = ("patched", "stock")


def _batch(rank):
    from tests.support.openrlhf_actors import make_batch

    return make_batch(seed=30 + rank)


def _policy_step(engine, batch):
    from deepspeed.utils import safe_get_full_grad

    logp, output = engine(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask,
                          return_output=True, return_entropy=True)
    entropy = output.entropy[:, -batch.action_mask.shape[1]:] * batch.action_mask
    loss = (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum() + 0.2 * entropy.sum()
    engine.backward(loss)
    grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}
    engine.optimizer.zero_grad()
    with torch.no_grad():
        reference = engine(batch.sequences, batch.action_mask, attention_mask=batch.attention_mask)
    return {"logp": logp.detach(), "entropy": entropy.detach(), "grads": grads, "reference": reference,
            "fused": output.logits is None}  # the served call builds no logits; OpenRLHF's builds them


def worker(rank: int, port: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - the module, by sys.modules: deepspeed.comm re-exports torch

    import grpo_kernels.openrlhf as gk_openrlhf
    from tests.support.openrlhf_actors import build_actor

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # gloo carries the collectives
    config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    deepspeed.init_distributed(dist_backend="gloo")
    actor = build_actor(Path(out_dir))
    engine, *_ = deepspeed.initialize(model=actor, config=config, model_parameters=actor.parameters())
    head = engine.module.model.lm_head.weight
    results = {"partitioned": head.numel() == 0 and len(tuple(head.ds_shape)) == 2}
    batch = _batch(rank)
    for step in STEPS:
        if step == "stock":
            gk_openrlhf.unpatch()
        results[step] = _policy_step(engine, batch)
    gk_openrlhf.patch()
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _truth(folder):
    """Per rank: OpenRLHF's own results on an unsharded copy; the gradients' mean over ranks."""
    import grpo_kernels.openrlhf as gk_openrlhf
    from tests.support.openrlhf_actors import build_actor

    actor = build_actor(folder)
    values, grads = [], []
    for rank in range(WORLD):
        batch = _batch(rank)
        actor.zero_grad(set_to_none=True)
        logp, output = gk_openrlhf.stock_forward(actor, batch.sequences, batch.action_mask,
                                                 attention_mask=batch.attention_mask, return_output=True,
                                                 return_entropy=True)
        entropy = output.entropy[:, -batch.action_mask.shape[1]:] * batch.action_mask
        ((logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum() + 0.2 * entropy.sum()).backward()
        values.append((logp.detach(), entropy.detach()))
        grads.append({n: p.grad.clone() for n, p in actor.named_parameters()})
    return values, {n: sum(g[n] for g in grads) / WORLD for n in grads[0]}


@pytest.mark.slow  # two DeepSpeed ranks: ~40 s on 2 cores
def test_zero3_engine(tmp_path):
    from ..support.openrlhf_actors import build_actor
    from ..support.ranks import start_ranks
    from ..support.tolerances import assert_same_maths

    build_actor(tmp_path)  # saves the tiny model once, before the ranks load it
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    from ..support.openrlhf_env import STUBS

    start_ranks(WORLD, tmp_path, lambda r: [__file__, str(r), port, str(tmp_path)],
                env=lambda r: {"PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), str(STUBS)])})
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    values, truth = _truth(tmp_path)
    for rank, res in enumerate(results):
        assert res["partitioned"], f"rank {rank}: lm_head.weight was not partitioned by ZeRO-3"
        for step in STEPS:
            got = res[step]
            assert_same_maths(got["logp"], values[rank][0], torch.float32, f"rank {rank}, {step}, log-probs")
            assert_same_maths(got["entropy"], values[rank][1], torch.float32, f"rank {rank}, {step}, entropy")
            assert_same_maths(got["reference"], values[rank][0], torch.float32, f"rank {rank}, {step}, reference")
            assert set(got["grads"]) == set(truth)
            for name, g in truth.items():
                assert_same_maths(got["grads"][name], g, torch.float32, f"rank {rank}, {step}, d {name}")
        assert res["patched"]["fused"] and not res["stock"]["fused"], f"rank {rank}: not the fused head"
        for name in truth:  # ours and OpenRLHF's forward under the same engine
            assert_same_maths(res["patched"]["grads"][name], res["stock"]["grads"][name], torch.float32,
                              f"rank {rank}: patched vs OpenRLHF, d {name}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
