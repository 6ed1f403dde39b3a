"""Real DeepSpeed ZeRO-3 on CPU (2 gloo ranks): TRL's fused forward with ``patch_trl()`` keeps our kernel and gives
the numbers of TRL's own kernel and of the unsharded model.

Each rank wraps the same tiny Llama (``add_fused_lm_head``) in ``deepspeed.initialize`` with ZeRO stage 3
(``DS_ACCELERATOR=cpu``, gloo; every parameter partitioned, ``stage3_param_persistence_threshold=0``), runs
``engine(..., fused_lm_head=True)`` on its own tokens and ``engine.backward``, then reads the full (reduced)
gradients with ``deepspeed.utils.safe_get_full_grad``. Ground truth: the mean over ranks of each rank's gradient
from an unsharded copy, as DeepSpeed averages data-parallel gradients. Runs when ``deepspeed`` is installed (the
``test`` extra pins it; it installs in seconds from its sdist, no op is compiled: DeepSpeed's CPU shared-memory
all-reduce op, built on first use, is switched off since gloo does the communication).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

WORLD, VOCAB, B, L = 2, 43, 2, 9
STEPS = ("patched", "trl")  # patch_trl(strict=True), then TRL's own kernel, on the same engine


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, initializer_range=0.2,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def rank_batch(rank: int):
    g = torch.Generator().manual_seed(10 + rank)
    ids = torch.randint(0, VOCAB, (B, L), generator=g)
    labels = ids.clone()
    labels[0, : 2 + rank] = -100
    return ids, labels


def scored(out):
    logp, ent = out.log_probs, out.entropy
    return (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum() + 0.2 * ent.sum()


def _error(call):
    try:
        call()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def _outside_forward(engine, ids):
    """The backbone, then our head with ``gather_head``, outside the model's forward (as ``causal_lm_token_logprobs``
    would run): evidence for refusing ZeRO-3 there. Run last, the engine may not survive it."""
    import deepspeed

    import grpo_kernels as gk

    weight = engine.module.lm_head.weight
    hidden = engine.module.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    logp = gk.linear_token_logprobs(hidden, weight, ids[:, 1:], temperature=0.9, impl="torch",
                                    gather_head=lambda: deepspeed.zero.GatheredParameters([weight]))
    engine.backward(logp.sum())


def worker(rank: int, port: str, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port, DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import deepspeed.comm.torch  # noqa: F401 - the module, by sys.modules: deepspeed.comm re-exports torch
    import trl.trainer.utils as trl_utils
    from deepspeed.utils import safe_get_full_grad
    from transformers.integrations import HfDeepSpeedConfig

    from grpo_kernels.integrations.transformers import get_lm_head
    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None  # no JIT-compiled shm op: gloo carries the collectives
    config = {"train_micro_batch_size_per_gpu": B, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
              "optimizer": {"type": "SGD", "params": {"lr": 0.0}}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**9, "wall_clock_breakdown": False}
    hf_ds_config = HfDeepSpeedConfig(config)  # noqa: F841 - alive: transformers' is_deepspeed_zero3_enabled()
    deepspeed.init_distributed(dist_backend="gloo")
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
    head = engine.module.lm_head.weight
    results = {"partitioned": head.numel() == 0 and tuple(head.ds_shape) == (VOCAB, 16)}
    ids, labels = rank_batch(rank)
    for step in STEPS:
        if step == "patched":
            patch_trl(strict=True)
        try:
            out = engine(input_ids=ids, labels=labels, fused_lm_head=True)
            loss = scored(out)
            engine.backward(loss)
        finally:
            unpatch_trl()
        results[step] = {"log_probs": out.log_probs.detach(), "entropy": out.entropy.detach(),
                         "grads": {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}}
        engine.optimizer.zero_grad()
    results["get_lm_head"] = _error(lambda: get_lm_head(engine.module))
    results["outside_forward"] = _error(lambda: _outside_forward(engine, ids))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _truth():
    """Per rank: log-probs and entropies of the unsharded model; the gradients' mean over ranks."""
    import trl.trainer.utils as trl_utils

    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    values, grads = [], []
    model = _tiny_llama()
    trl_utils.add_fused_lm_head(model, temperature=0.9, outputs=("log_probs", "entropy"))
    patch_trl(strict=True)
    try:
        for rank in range(WORLD):
            ids, labels = rank_batch(rank)
            model.zero_grad()
            out = model(input_ids=ids, labels=labels, fused_lm_head=True)
            scored(out).backward()
            values.append((out.log_probs.detach(), out.entropy.detach()))
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    finally:
        unpatch_trl()
    return values, {n: sum(g[n] for g in grads) / WORLD for n in grads[0]}


def test_zero3_real_deepspeed(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[test]' (it pins "
                        "deepspeed) runs this test; tests/test_sharded_head_zero3.py emulates ZeRO-3 meanwhile")
    pytest.importorskip("trl")
    from tests.test_vocab_parallel import start_ranks
    from tests.tolerances import ATOL

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    start_ranks(WORLD, tmp_path, lambda r: [__file__, str(r), port, str(tmp_path)])
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    values, truth = _truth()
    tol = dict(rtol=1e-4, atol=ATOL[torch.float32])  # fp32 model: ZeRO-3's reduction order vs the plain sum
    for rank, res in enumerate(results):
        assert res["partitioned"], f"rank {rank}: lm_head.weight was not partitioned by ZeRO-3"
        for step in STEPS:
            got = res[step]
            torch.testing.assert_close(got["log_probs"], values[rank][0], **tol)
            torch.testing.assert_close(got["entropy"], values[rank][1], **tol)
            assert set(got["grads"]) == set(truth)
            for name, g in truth.items():
                torch.testing.assert_close(got["grads"][name], g, **tol,
                                           msg=lambda m, n=name, s=step: f"rank {rank}, {s}, d {n}: {m}")
        for name in truth:  # ours and TRL's kernel under the same engine
            torch.testing.assert_close(res["patched"]["grads"][name], res["trl"]["grads"][name], **tol)
        # Outside the model's forward the helpers refuse ZeRO-3, and for a reason: with the head gathered in the
        # forward and the backward, ZeRO-3 (0.19.8) still cannot take the head's full gradient (its partitioned
        # .grad does not match), since its hooks are armed only for parameters used inside the model's forward.
        assert res["get_lm_head"] and "DeepSpeed ZeRO-3" in res["get_lm_head"], res["get_lm_head"]
        assert res["get_lm_head"].startswith("ValueError") and "patch_trl()" in res["get_lm_head"]
        assert res["outside_forward"] and res["outside_forward"].startswith("RuntimeError"), res["outside_forward"]


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
