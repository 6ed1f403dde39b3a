"""Batch invariance under vocab-parallel (docs/numerics.md, "Batch invariance"): on 2 gloo ranks, each holding a
vocabulary shard, a sequence's log-probs, entropies and d hidden from ``linear_token_logprobs(batch_invariant=True)``
and its d hidden from ``fused_linear_grpo_loss(batch_invariant=True)`` are bitwise the same alone and inside batches
at other positions, on every rank (the shards' statistics are gathered and summed in rank order, never all-reduced
in the transport's order), on both impls. What holds is for a fixed world size: another split of the vocabulary is
another sum. Without the option the same comparisons fail (the heads' GEMMs and splits follow the batch: the ranks
inherit ``GRPO_KERNELS_TEST_FORCE_VARIANT=1`` in tests/api/test_invariance_forced_off.py).

The ranks are plain processes running this file (``python tests/distributed/test_dist_batch_invariance.py RANK
WORLD STORE OUT``, tests/support/ranks.py), bounded by LAUNCH_TIMEOUT."""
from __future__ import annotations

import datetime
import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
from tests.support.ranks import LAUNCH_TIMEOUT, start_ranks

H, V, WORLD = 8, 23, 2
LENGTHS = (3, 5, 2, 4)
ORDERS = ((0,), (1, 0), (2, 3, 0), (3, 2, 1, 0))  # sequence 0 alone and at other positions
IMPLS = ("torch", "triton") if os.environ.get("TRITON_INTERPRET", "0") == "1" else ("torch",)


def _pool(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(n, H, generator=g) for n in LENGTHS]
    ids = [torch.randint(0, V, (n,), generator=g) for n in LENGTHS]
    return hidden, ids, torch.randn(V, H, generator=g) / 2


def _calls(group, rank: int, world: int, impl: str) -> dict:
    """{(order, what): per-sequence values} of this rank's calls."""
    hidden, ids, weight = _pool()
    per = -(-V // world)
    shard = weight[rank * per:(rank + 1) * per]
    out = {}
    for order in ORDERS:
        lengths = [LENGTHS[i] for i in order]
        x = torch.cat([hidden[i] for i in order]).requires_grad_(True)
        y = torch.cat([ids[i] for i in order])
        logp, ent = gk.linear_token_logprobs(x, shard, y, return_entropy=True, impl=impl, process_group=group,
                                             batch_invariant=True)
        (logp * 0.7 + ent * 0.3).sum().backward()
        for what, t in (("logp", logp.detach()), ("entropy", ent.detach()), ("d hidden", x.grad)):
            out[(order, what)] = dict(zip(order, torch.split(t, lengths)))
        x = x.detach().requires_grad_(True)
        cu = torch.tensor([0] + list(itertools.accumulate(lengths)))
        adv = torch.tensor([1.0, -0.5, 2.0, -1.5])[list(order)]
        loss, _ = gk.fused_linear_grpo_loss(x, shard, y, adv, cu_seqlens=cu, num_items_in_batch=20, impl=impl,
                                            process_group=group, batch_invariant=True, loss_type="dapo")
        loss.backward()
        out[(order, "loss d hidden")] = dict(zip(order, torch.split(x.grad, lengths)))
    return out


def worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=LAUNCH_TIMEOUT))
    group = dist.new_group(list(range(world)))
    torch.save({impl: _calls(group, rank, world, impl) for impl in IMPLS}, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vp_invariance")
    start_ranks(WORLD, tmp, lambda r: [__file__, str(r), str(WORLD), str(tmp / "store"), str(tmp)])
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.parametrize("impl", IMPLS)
def test_vocab_parallel_rows_are_batch_invariant(rank_results, impl):
    whats = ("logp", "entropy", "d hidden", "loss d hidden")
    for what in whats:
        first = {}
        for rank, results in enumerate(rank_results):
            for order in ORDERS:
                for i, values in results[impl][(order, what)].items():
                    if i not in first:
                        first[i] = (rank, order, values)
                        continue
                    rank0, order0, v0 = first[i]
                    assert torch.equal(values, v0), (
                        f"{impl} {what} of sequence {i}: rank {rank} in {order} != rank {rank0} in {order0} by "
                        f"{(values - v0).abs().max().item():.3e}")


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
