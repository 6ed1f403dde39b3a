"""Synced decoding under FSDP2, launched by tests/train/test_train_fsdp.py under torchrun (2 gloo ranks, short timeout).

Each rank samples its own prompts with the sharded policy (inside ``sharding.gathered``) while one rank's rows all
hit EOS at the first step and the other rank's never do: without lockstep decoding the finished rank leaves the
other blocked in a layer's all-gather (a gloo timeout). Every rank then repeats the same calls with an unsharded
copy of the model and the same seed, and writes to ``--out``.rank<N>.json whether its completions (sampled and
greedy) and its random stream after sampling are identical, and how many steps it decoded.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json

import torch
import torch.distributed as dist

import grpo_kernels as gk
from grpo import sharding
from grpo.distributed import DistEnv
from grpo.modeling import build_char_tokenizer, build_tiny_model, disable_dropout
from grpo.policy import GRPOPolicy
from grpo.rollout import sample_completions

MAX_NEW = 8


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--timeout-s", type=float, default=20.0)
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    tok = build_char_tokenizer("abcdefgh=")
    torch.manual_seed(0)
    lm = build_tiny_model(tok, hidden_size=32, num_layers=2, num_heads=2, initializer_range=0.2)
    disable_dropout(lm)
    lm.eval()
    plain = copy.deepcopy(lm)
    policy = GRPOPolicy(lm, gk.GRPOLossConfig(), "torch")
    sharding.shard(policy, DistEnv(rank=rank, world_size=world, device=torch.device("cpu")), None)
    g = torch.Generator().manual_seed(100 + rank)
    ids = torch.randint(4, len(tok), (2, 3), generator=g)
    mask = torch.ones_like(ids)
    every_id, no_id = list(range(len(tok))), [10 ** 6]
    cases = {"sampled": dict(greedy=False, eos=every_id if rank == 0 else no_id),   # rank 0 done after 1 step
             "greedy": dict(greedy=True, eos=no_id if rank == 0 else every_id)}     # rank 1 done after 1 step
    result = {"rank": rank}
    for name, case in cases.items():
        outs = []
        for model in (lm, plain):
            torch.manual_seed(7 + rank)
            with sharding.gathered(policy if model is lm else None):
                out, _ = sample_completions(model, ids, mask, repeats=2, max_new_tokens=MAX_NEW,
                                            eos_ids=case["eos"], pad_id=0, banned=None, greedy=case["greedy"])
            outs.append((out, torch.rand(4)))  # the random stream after sampling
        result[name] = {"steps": outs[0][0].shape[1], "same_tokens": torch.equal(outs[0][0], outs[1][0]),
                        "same_rng_after": torch.equal(outs[0][1], outs[1][1])}
    dist.barrier()
    with open(f"{args.out}.rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
