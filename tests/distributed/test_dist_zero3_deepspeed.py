"""Real DeepSpeed ZeRO-3 on CPU (2 gloo ranks): TRL's fused forward with ``patch_trl()`` keeps our kernel and gives
the numbers of TRL's own kernel and of the unsharded model; a model whose own forward calls
``fused_linear_grpo_loss(..., gather_head=zero3_gather_head(lm_head.weight, lm_head.bias))`` gives the unsharded
loss and mean gradient, where ``deepspeed.zero.GatheredParameters`` as ``gather_head`` fails.

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

from tests.support.tiny_models import tiny_llama

WORLD, VOCAB, B, L = 2, 43, 2, 9
STEPS = ("patched", "trl")  # patch_trl(strict=True), then TRL's own kernel, on the same engine
HEAD_IMPLS = ("torch", "triton")  # HeadModel's loss: the recompute backward, the gradient computed in the forward
# gather_head=lambda: deepspeed.zero.GatheredParameters([w, b]) -> the error DeepSpeed 0.19.8 raises: in the model's
# forward (a fresh engine), and outside it under the caller's own GatheredParameters of the head
NAIVE = {"in_forward": "Cannot free a ZeRO-3 parameter while it is still active in submodules",
         "under_caller_gather": "Nested GatheredParameters contexts cannot overlap parameters"}


class HeadModel(torch.nn.Module):
    """A model whose own forward runs its backbone and our fused loss on ``lm_head``'s parameters (never calling
    ``lm_head``), the way a user's model under ZeRO-3 would; ``gather`` picks the ``gather_head``."""

    def __init__(self, gather: str = "zero3_gather_head", impl: str = "torch"):
        super().__init__()
        torch.manual_seed(1)
        self.embed, self.proj = torch.nn.Embedding(VOCAB, 16), torch.nn.Linear(16, 16)
        self.lm_head = torch.nn.Linear(16, VOCAB)
        torch.nn.init.normal_(self.lm_head.bias, std=0.5)
        self.gather, self.impl, self.head_status = gather, impl, None

    def forward(self, ids, advantages, mask):
        import grpo_kernels as gk

        hidden = torch.tanh(self.proj(self.embed(ids[:, :-1])))
        weight, bias = self.lm_head.weight, self.lm_head.bias
        self.head_status = getattr(weight, "ds_status", None)  # as ZeRO-3 hands the head to this forward
        gather_head = gk.zero3_gather_head(weight, bias) if self.gather == "zero3_gather_head" else \
            _naive_gather(weight, bias)
        loss, _ = gk.fused_linear_grpo_loss(hidden, weight, ids[:, 1:], advantages, mask=mask, bias=bias,
                                            loss_type="bnpo", entropy_coef=0.05, temperature=0.9, impl=self.impl,
                                            gather_head=gather_head)
        return loss


def _naive_gather(*params):
    import deepspeed

    return lambda: deepspeed.zero.GatheredParameters(list(params))


def head_batch(rank: int):
    g = torch.Generator().manual_seed(20 + rank)
    ids = torch.randint(0, VOCAB, (B + 1, L), generator=g)
    mask = torch.ones(B + 1, L - 1, dtype=torch.bool)
    mask[rank, : 3 + rank] = False
    return ids, torch.randn(B + 1, generator=g), mask, torch.randn(B + 1, L - 1, 16, generator=g)


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
    import grpo_kernels as gk

    weight = engine.module.lm_head.weight
    hidden = engine.module.model(input_ids=ids, use_cache=False).last_hidden_state[:, :-1]
    logp = gk.linear_token_logprobs(hidden, weight, ids[:, 1:], temperature=0.9, impl="torch",
                                    gather_head=gk.zero3_gather_head(weight))
    engine.backward(logp.sum())


def _head_model_steps(config, rank: int):
    """HeadModel under ZeRO-3: each impl's loss and full gradients and the head's status in the forward; a no-grad
    scoring outside the forward, alone and under the caller's own gather; the naive ``gather_head``'s errors."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    import grpo_kernels as gk

    ids, advantages, mask, hidden = head_batch(rank)
    engine, *_ = deepspeed.initialize(model=HeadModel(), config=config)
    results = {}
    for impl in HEAD_IMPLS:
        engine.module.impl = impl
        loss = engine(ids, advantages, mask)
        engine.backward(loss)
        results[impl] = {"loss": loss.detach(), "status": str(engine.module.head_status),
                         "grads": {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()}}
        engine.optimizer.zero_grad()
    # Outside the forward without gradients (e.g. reference log-probs): the helper gathers, then re-partitions; under
    # the caller's own gather it leaves the head to it.
    w, b = engine.module.lm_head.weight, engine.module.lm_head.bias
    score = lambda gather_head: gk.linear_token_logprobs(  # noqa: E731
        hidden, w, ids[:, 1:], bias=b, temperature=0.9, gather_head=gather_head)
    with torch.no_grad():
        results["no_grad"] = {"logp": score(gk.zero3_gather_head(w, b)), "numel_after": w.numel() + b.numel()}
        with deepspeed.zero.GatheredParameters([w, b]):
            results["no_grad_under_caller_gather"] = {"logp": score(gk.zero3_gather_head(w, b)),
                                                      "numel_after": w.numel() + b.numel()}
            results["naive_under_caller_gather"] = _error(lambda: score(_naive_gather(w, b)))
    naive, *_ = deepspeed.initialize(model=HeadModel("GatheredParameters"), config=config)
    results["naive_in_forward"] = _error(lambda: naive.backward(naive(ids, advantages, mask)))
    return results


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
    model = tiny_llama(vocab_size=VOCAB)
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
    results["head_model"] = _head_model_steps(config, rank)
    results["outside_forward"] = _error(lambda: _outside_forward(engine, ids))
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")


def _truth():
    """Per rank: log-probs and entropies of the unsharded model; the gradients' mean over ranks."""
    import trl.trainer.utils as trl_utils

    from grpo_kernels.integrations.trl import patch_trl, unpatch_trl

    values, grads = [], []
    model = tiny_llama(vocab_size=VOCAB)
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


def _head_model_truth():
    """Per rank: HeadModel's unsharded loss and no-grad log-probs (zero3_gather_head a no-op on plain tensors,
    the triton impl as well as torch); the gradients' mean over ranks."""
    import grpo_kernels as gk
    from tests.support.tolerances import assert_same_maths

    losses, logps, grads = [], [], []
    model = HeadModel()
    for rank in range(WORLD):
        ids, advantages, mask, hidden = head_batch(rank)
        per_impl = []
        for impl in ("torch", "triton"):
            model.impl = impl
            model.zero_grad()
            loss = model(ids, advantages, mask)
            loss.backward()
            per_impl.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert_same_maths(per_impl[1][0], per_impl[0][0], torch.float32, f"rank {rank}: triton vs torch loss")
        losses.append(per_impl[0][0])
        grads.append(per_impl[0][1])
        with torch.no_grad():
            logps.append(gk.linear_token_logprobs(hidden, model.lm_head.weight, ids[:, 1:], bias=model.lm_head.bias,
                                                  temperature=0.9))
    return losses, logps, {n: sum(g[n] for g in grads) / WORLD for n in grads[0]}


def test_zero3_real_deepspeed(tmp_path):
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: pip install -e '.[test]' (it pins "
                        "deepspeed) runs this test; tests/distributed/test_dist_zero3_emulated.py emulates ZeRO-3 "
                        "meanwhile")
    pytest.importorskip("trl")
    from tests.support.ranks import start_ranks
    from tests.support.tolerances import assert_same_maths

    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    start_ranks(WORLD, tmp_path, lambda r: [__file__, str(r), port, str(tmp_path)])
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    values, truth = _truth()
    head_losses, head_logps, head_truth = _head_model_truth()
    # fp32 model: ZeRO-3's reduction order vs the plain sum, the same maths (same_maths_slack, relative to
    # max(1, max |value|))
    for rank, res in enumerate(results):
        assert res["partitioned"], f"rank {rank}: lm_head.weight was not partitioned by ZeRO-3"
        for step in STEPS:
            got = res[step]
            assert_same_maths(got["log_probs"], values[rank][0], torch.float32, f"rank {rank}, {step}, log-probs")
            assert_same_maths(got["entropy"], values[rank][1], torch.float32, f"rank {rank}, {step}, entropy")
            assert set(got["grads"]) == set(truth)
            for name, g in truth.items():
                assert_same_maths(got["grads"][name], g, torch.float32, f"rank {rank}, {step}, d {name}")
        for name in truth:  # ours and TRL's kernel under the same engine
            assert_same_maths(res["patched"]["grads"][name], res["trl"]["grads"][name], torch.float32,
                              f"rank {rank}: ours vs TRL's kernel, d {name}")
        # Outside the model's forward the helpers refuse ZeRO-3, and for a reason: with the head gathered in the
        # forward and the backward, ZeRO-3 (0.19.8) still cannot take the head's full gradient (its partitioned
        # .grad does not match), since its hooks are armed only for parameters used inside the model's forward.
        assert res["get_lm_head"] and "DeepSpeed ZeRO-3" in res["get_lm_head"], res["get_lm_head"]
        assert res["get_lm_head"].startswith("ValueError") and "patch_trl()" in res["get_lm_head"]
        # ZeRO-3's gradient accumulation receives the full (V, H) head gradient where it expects the empty partition
        assert res["outside_forward"] and res["outside_forward"].startswith("RuntimeError") and \
            "size of tensor a (0)" in res["outside_forward"], res["outside_forward"]

        # A model whose own forward calls our loss with gather_head=zero3_gather_head(...): the unsharded loss and
        # mean gradient, on both backward paths and when the caller already holds a gather of the head.
        head = res["head_model"]
        for step in HEAD_IMPLS:
            got = head[step]
            assert_same_maths(got["loss"], head_losses[rank], torch.float32, f"rank {rank}, {step}, loss")
            assert set(got["grads"]) == set(head_truth)
            for name, g in head_truth.items():
                assert_same_maths(got["grads"][name], g, torch.float32, f"rank {rank}, {step}, d {name}")
            # DeepSpeed 0.19.8 gathers a parameter read in the engine's forward itself (an external parameter of
            # the running module) and keeps it for that module's backward, so zero3_gather_head has nothing to do
            # there; the naive GatheredParameters then re-partitions it on exit (below).
            assert got["status"] == "ZeroParamStatus.AVAILABLE", got["status"]
        assert_same_maths(head["no_grad"]["logp"], head_logps[rank], torch.float32, f"rank {rank}, no-grad log-probs")
        assert head["no_grad"]["numel_after"] == 0, "the head stayed gathered after zero3_gather_head's context"
        assert_same_maths(head["no_grad_under_caller_gather"]["logp"], head_logps[rank], torch.float32,
                          f"rank {rank}, no-grad log-probs under the caller's gather")
        assert head["no_grad_under_caller_gather"]["numel_after"] == VOCAB * 17, \
            "zero3_gather_head re-partitioned a head the caller still holds"
        for case, message in NAIVE.items():
            got = head[f"naive_{case}"]
            assert got and got.startswith("RuntimeError") and message in got, (case, got)


if __name__ == "__main__":
    worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
