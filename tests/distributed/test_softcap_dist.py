"""Soft-capped logits on the vocab-parallel head (``process_group=``), 2 gloo ranks on CPU, Triton kernels under
TRITON_INTERPRET=1: ``head.fast_vocab_parallel`` (gradients in the forward; the shards' (logp, lse, entropy) of the
capped logits combined per chunk) and the memory-light path per shard (``head.light``, deterministic and atomic;
``head.no_grad`` for log-probs without gradients), each equal to the unsharded Triton call to fp32 rounding and, by
the three-way rule of tests/support/tolerances.py, to the float64 ground truth of the unsharded PyTorch path, the
middle term being that path in fp32 (which applies the cap on its own: a kernel bug shared by the sharded and
unsharded Triton calls still fails).

Ranks are started by tests/support/ranks.py (``python tests/distributed/test_softcap_dist.py RANK WORLD STORE OUT``,
joined through a file store, bounded by LAUNCH_TIMEOUT); outputs are poisoned (GRPO_KERNELS_POISON=1).
"""
from __future__ import annotations

import datetime
import os
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk

WORLD = 2
B, T, H, V = 3, 5, 8, 23  # V = 12 + 11 over the two ranks
CAP, TEMPERATURE = 2.0, 0.8
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# name -> (kind, config overrides, the paths every rank's planner must choose, in call order)
CASES = {
    "fast_token": ("loss", dict(loss_type="grpo", beta=0.04, entropy_coef=0.05), ["head.fast_vocab_parallel"]),
    "fast_sequence_frozen": ("loss", dict(loss_type="dr_grpo", importance_sampling_level="sequence"),
                             ["head.fast_vocab_parallel"]),
    "light": ("loss", dict(loss_type="bnpo", entropy_coef=0.05, grad_in_forward=False), ["head.light"]),
    "light_atomic": ("loss", dict(loss_type="dapo", beta=0.04, grad_in_forward=False, deterministic=False),
                     ["head.light"]),
    "logprobs": ("logprobs", {}, ["head.light", "head.no_grad"]),
}


def case_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.8
    bias = torch.randn(V, generator=g, dtype=torch.float64) * 0.5
    bias[15] = float("-inf")  # a -inf raw logit on rank 1's shard: capped to -CAP
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, 0], ids[1, 1], ids[2, 2], ids[2, 0] = 0, V - 1, 12, 15  # both ends, the shard boundary, the -inf logit
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    return {"hidden": hidden, "weight": weight, "bias": bias, "ids": ids, "mask": mask,
            "advantages": torch.randn(B, generator=g, dtype=torch.float64),
            "old_logps": -2.5 + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64),
            "ref_logps": -2.5 + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64),
            "grad_logp": torch.randn(B, T, generator=g, dtype=torch.float64),
            "grad_entropy": torch.randn(B, T, generator=g, dtype=torch.float64)}


def run_case(name: str, x: dict, weight, bias, dtype, impl: str = "triton", group=None) -> dict:
    """One call with softcap=CAP and its backward: outputs and the gradients of hidden, weight and bias."""
    kind, options, _ = CASES[name]
    trainable = not name.endswith("_frozen")
    x = {k: v.to(dtype).clone() if v.is_floating_point() else v for k, v in x.items()}
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = weight.to(dtype).clone().requires_grad_(trainable)
    bias = bias.to(dtype).clone().requires_grad_(trainable)
    if kind == "loss":
        loss, metrics = gk.fused_linear_grpo_loss(
            hidden, weight, x["ids"], x["advantages"], x["mask"], bias=bias, old_logps=x["old_logps"],
            ref_logps=x["ref_logps"], impl=impl, process_group=group, temperature=TEMPERATURE, softcap=CAP, **options)
        loss.backward()
        out = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
    else:
        logp, entropy = gk.linear_token_logprobs(hidden, weight, x["ids"], bias=bias, temperature=TEMPERATURE,
                                                 return_entropy=True, impl=impl, mask=x["mask"], process_group=group,
                                                 softcap=CAP)
        ((logp * x["grad_logp"]).sum() + (entropy * x["grad_entropy"]).sum()).backward()
        with torch.no_grad():
            logp_ng, entropy_ng = gk.linear_token_logprobs(x["hidden"], weight, x["ids"], bias=bias,
                                                           temperature=TEMPERATURE, return_entropy=True, impl=impl,
                                                           mask=x["mask"], process_group=group, softcap=CAP)
        out = {"logp": logp.detach(), "entropy": entropy.detach(), "logp_no_grad": logp_ng,
               "entropy_no_grad": entropy_ng}
    out.update(dh=hidden.grad, dw=weight.grad, db=bias.grad)
    return out


def worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from grpo_kernels import planner

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=150))
    group = dist.new_group(list(range(world)))
    sizes = [V // world + (k < V % world) for k in range(world)]
    start, size = sum(sizes[:rank]), sizes[rank]
    x = case_inputs()
    paths, real = [], planner.plan_head

    def record(*args, **kwargs):
        plan = real(*args, **kwargs)
        paths.append(plan.path)
        return plan
    planner.plan_head = record
    results = {}
    for name in CASES:
        paths.clear()
        res = run_case(name, x, x["weight"][start:start + size], x["bias"][start:start + size], torch.float32,
                       group=group)
        results[name] = {**res, "start": start, "paths": list(paths)}
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    from tests.support.ranks import start_ranks
    tmp = tmp_path_factory.mktemp("softcap_vp")
    start_ranks(WORLD, tmp, lambda r: [__file__, str(r), str(WORLD), str(tmp / "store"), str(tmp)],
                lambda r: {"GRPO_KERNELS_POISON": "1"})
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.mark.skipif(not INTERPRET, reason="the Triton kernels run on CPU under TRITON_INTERPRET=1 (set without CUDA)")
@pytest.mark.parametrize("name", list(CASES))
def test_vocab_parallel_softcap_matches_unsharded(ranks, name, monkeypatch):
    """Every rank: the planner's path, loss / metrics / log-probs and the all-reduced d hidden equal to the
    unsharded call; the ranks' d weight / d bias shards, concatenated, equal to the unsharded gradients."""
    from ..support.tolerances import assert_three_way
    monkeypatch.setenv("GRPO_KERNELS_POISON", "1")
    x = case_inputs()
    expected = run_case(name, x, x["weight"], x["bias"], torch.float32)
    same_dtype = run_case(name, x, x["weight"], x["bias"], torch.float32, impl="torch")
    truth = run_case(name, x, x["weight"], x["bias"], torch.float64, impl="torch")

    def check(got, key, what):
        # the three-way rule twice: the unsharded Triton call as the middle term (sharding may not make the head much
        # less accurate), and the unsharded PyTorch call in fp32 (a kernel bug both Triton calls share still fails)
        scale = max(truth[key].abs().max().item(), 1.0 if key not in ("dh", "dw", "db") else 1e-6)
        assert_three_way(got, expected[key], truth[key], torch.float32, f"{what} (vs unsharded)", scale=scale)
        assert_three_way(got, same_dtype[key], truth[key], torch.float32, what, scale=scale)

    for r in range(WORLD):
        got = ranks[r][name]
        assert got["paths"] == CASES[name][2], got["paths"]
        for key, value in expected.items():
            if key in ("dw", "db") or value is None:
                assert key in ("dw", "db") or got[key] is None, key
                continue
            check(got[key], key, f"rank {r}, {key}")
    for key in ("dw", "db"):
        if expected[key] is None:  # frozen head
            assert all(ranks[r][name][key] is None for r in range(WORLD)), key
            continue
        check(torch.cat([ranks[r][name][key] for r in sorted(range(WORLD), key=lambda r: ranks[r][name]["start"])]),
              key, key)
    assert expected["dh"].abs().sum() > 0
    if name == "fast_token":  # the -inf raw logit of rank 1's shard is capped to -CAP: a finite loss and gradients
        assert torch.isfinite(expected["loss"]) and torch.isfinite(ranks[1][name]["dw"]).all()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])


def test_ranks_that_disagree_on_the_cap_get_one_error_with_the_numbers():
    """The validation table carries the cap (and the temperature) as float64 bits; a mismatch names the values the
    ranks were given, on every rank (the verdict is computed from the gathered table, the same everywhere)."""
    from grpo_kernels.distributed import vocab_parallel as vp

    def row(softcap, temperature=0.8):
        fields = dict.fromkeys(vp._FIELDS, 0)
        fields.update(ok=1, size=4, start=-1, n=6, n_valid=6, h=8, id_max=3, temperature=vp._to_bits(temperature),
                      softcap=vp._to_bits(softcap or 0.0))
        return [fields[f] for f in vp._FIELDS] + [0] * vp.MESSAGE_BYTES

    assert vp._verdict([row(30.0), row(30.0)], 2)[2] is None
    message = vp._verdict([row(30.0), row(None)], 2)[2]
    assert message.endswith("softcap must be the same on every rank, got [30.0, None] on ranks 0..1"), message
    message = vp._verdict([row(None, 0.7), row(None, 1.0)], 2)[2]
    assert "temperature must be the same on every rank, got [0.7, 1.0]" in message, message
