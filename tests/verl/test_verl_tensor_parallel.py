"""verl's tensor-parallel convention at the seam, on 2 gloo ranks: Megatron's fused forward calls
``linear_cross_entropy(hidden, weight_shard, labels, temperature, "none", tp_group)``.

Each launch starts 2 plain processes running this file (``python tests/verl/test_verl_tensor_parallel.py RANK WORLD
STORE OUT``, tests/support/ranks.py) that import ``grpo_kernels.verl`` and call verl's name. Rank r holds the
contiguous vocabulary shard [r V / 2, (r + 1) V / 2) (V = 46: 23 ids each, a multiple of no tile); hidden is
Megatron's (N, 1, H) layout, labels (1, N) full-vocabulary ids. Checked against the unsharded call made here and float64
truth: every rank's log-probs and entropy are the whole vocabulary's; every rank's d hidden is its PARTIAL gradient,
the rows of d loss / d logits of its own ids times its own weight rows (verl's kernel's convention: no all-reduce),
whose sum over the ranks is the unsharded d hidden; d weight is the shard's rows of the unsharded one. With
Megatron's sequence parallelism (a gather of each rank's sequence chunk before the head, whose backward reduce-
scatters, emulated here as Megatron's ``gather_from_sequence_parallel_region`` does it) each rank ends with its chunk
of the full d hidden. Also: ``reduction="sum"``, the no-grad path, bf16. With megatron-core installed (.venv-verl has
0.16.1, which imports on CPU), verl's own Megatron entry point runs too: ``model_forward_fused.fused_output_processor``
(Megatron's output-processor hook; sequence_parallel off, since Megatron's sequence-parallel gather needs CUDA) with
Megatron's own tensor-parallel group from ``parallel_state`` on gloo, that module imported before grpo_kernels.verl
(so the name it bound at import is the one the patch must swap).
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

import pytest
import torch

from tests.support.ranks import LAUNCH_TIMEOUT, start_ranks
from tests.support.tolerances import assert_same_maths

try:
    from tests.support.tolerances import assert_three_way, grad_scale
    from tests.support.verl_env import require_verl
except ImportError:  # run as a worker script: only the package is needed there
    assert_three_way = grad_scale = require_verl = None

N, H, V, WORLD = 10, 8, 46, 2
TEMPERATURE = 0.7
CASES = {  # name -> (dtype, reduction, no_grad, sequence_parallel)
    "fp64": (torch.float64, "none", False, False),
    "fp64_sum": (torch.float64, "sum", False, False),
    "fp64_no_grad": (torch.float64, "none", True, False),
    "fp64_sequence_parallel": (torch.float64, "none", False, True),
    "bf16": (torch.bfloat16, "none", False, False),
    "fp64_megatron_output_processor": (torch.float64, "none", False, False),
}
MEGATRON_SKIP = ("needs megatron-core (scripts/setup_verl.sh installs 0.16.1 in .venv-verl) for verl's Megatron "
                 "fused forward")


def case_inputs(dtype, seed=0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, V, (1, N), generator=g)
    labels[0, :3] = torch.tensor([0, V // 2 - 1, V // 2])  # both sides of the shard boundary
    return {"hidden": torch.randn(N, 1, H, generator=g, dtype=torch.float64).to(dtype),
            "weight": (0.7 * torch.randn(V, H, generator=g, dtype=torch.float64)).to(dtype), "labels": labels,
            "g_logp": torch.randn(N, generator=g, dtype=torch.float64), "g_ent": torch.randn(N, generator=g,
                                                                                              dtype=torch.float64)}


def call(fn, x: dict, weight, reduction="none", group=None, no_grad=False, gather=None):
    """``fn(hidden, weight, labels, T, reduction, group)`` plus verl's backward; (logp, entropy, dh, dw)."""
    hidden = x["hidden"].clone().requires_grad_(not no_grad)
    weight = weight.clone().requires_grad_(not no_grad)
    with torch.set_grad_enabled(not no_grad):
        full = gather(hidden) if gather is not None else hidden
        logp, entropy = fn(full, weight, x["labels"], TEMPERATURE, reduction, group)
    if no_grad:
        return logp, entropy, None, None
    g_logp = x["g_logp"].sum() if reduction == "sum" else x["g_logp"]
    dh, dw = torch.autograd.grad((logp, entropy), (hidden, weight),
                                 (g_logp.to(logp.dtype), x["g_ent"].to(entropy.dtype)))
    return logp.detach(), entropy.detach(), dh, dw


# ------------------------------------------------------------------------------------------------ worker side

class _GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` (tensor_parallel_output_grad=True) on gloo: all-gather
    the ranks' sequence chunks along dim 0; the backward reduce-scatters (the sum over the ranks, this rank's rows)."""

    @staticmethod
    def forward(ctx, chunk, group):
        import torch.distributed as dist

        ctx.group, ctx.rank, ctx.rows = group, dist.get_rank(group), chunk.shape[0]
        parts = [torch.empty_like(chunk) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, chunk.contiguous(), group=group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        total = grad.clone()
        dist.all_reduce(total, group=ctx.group)
        return total[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows], None


def worker(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=LAUNCH_TIMEOUT))
    group = dist.new_group(list(range(world)))  # a group other than WORLD, as Megatron's tensor-parallel group
    megatron = _megatron(world)  # imports verl's Megatron forward before the patch, when megatron-core is there
    import grpo_kernels.verl  # (patches verl, as external_lib does in a worker)
    import verl.utils.kernel.linear_cross_entropy as seam

    ours = grpo_kernels.verl.linear_cross_entropy
    results = {"report_patched": grpo_kernels.verl.REPORT.patched,
               "megatron_bound_ours": megatron and megatron.linear_cross_entropy is ours}
    shard = slice(rank * V // world, (rank + 1) * V // world)
    for name, (dtype, reduction, no_grad, sequence_parallel) in CASES.items():
        x = case_inputs(dtype)
        if name == "fp64_megatron_output_processor":
            if megatron:
                results[name] = call(_output_processor(megatron), x, x["weight"][shard])
            continue
        gather = None
        if sequence_parallel:  # this rank's sequence chunk of hidden, gathered before the head
            rows = N // world
            x = {**x, "hidden": x["hidden"][rank * rows:(rank + 1) * rows]}
            gather = lambda h: _GatherFromSequenceParallel.apply(h, group)  # noqa: E731
        results[name] = call(seam.linear_cross_entropy, x, x["weight"][shard], reduction, group, no_grad, gather)
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def _megatron(world: int):
    """verl's Megatron fused-forward module with Megatron's tensor-parallel group set up on gloo (TP = world), or
    None without megatron-core."""
    try:
        from megatron.core import parallel_state
        import verl.models.mcore.model_forward_fused as fused
    except ImportError:
        return None
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    return fused


def _output_processor(fused):
    """``call``'s fn through verl's ``fused_output_processor`` (it takes the group from Megatron's parallel_state)."""
    from types import SimpleNamespace

    def fn(hidden, weight, labels, temperature, reduction, group):
        out = fused.fused_output_processor(hidden_states=hidden, output_layer=SimpleNamespace(weight=weight),
                                           output_weight=None, labels=labels,
                                           context=fused.FusedOutputProcessorContext(temperature=temperature),
                                           config=SimpleNamespace(sequence_parallel=False))
        return out.log_probs, out.entropy
    return fn


# ------------------------------------------------------------------------------------------------ pytest side

@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    require_verl()
    tmp = tmp_path_factory.mktemp("verl_tp")
    start_ranks(WORLD, tmp, lambda r: [__file__, str(r), str(WORLD), str(tmp / "store"), str(tmp)])
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def _unsharded(name):
    from grpo_kernels.integrations.verl import linear_cross_entropy

    dtype, reduction, no_grad, _ = CASES[name]
    return call(linear_cross_entropy, case_inputs(dtype), case_inputs(dtype)["weight"], reduction, None, no_grad)


def _partial_truth(x: dict, reduction: str):
    """float64: the unsharded d hidden split by vocabulary shard, (d loss / d z)[:, shard] @ W[shard] / T per rank,
    from full logits (the reference), and the full d hidden. With "sum" every token's log-prob gradient is the
    scalar one (``call``'s g_logp.sum())."""
    from grpo_kernels.reference import logprobs_and_entropy

    w = x["weight"].double()
    z = (x["hidden"].double().reshape(N, H) @ w.T).requires_grad_(True)
    logp, entropy = logprobs_and_entropy(z, x["labels"].reshape(-1), TEMPERATURE)
    g_logp = x["g_logp"].sum().expand(N) if reduction == "sum" else x["g_logp"]
    (dz,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * x["g_ent"]).sum(), z)
    parts = [dz[:, r * V // WORLD:(r + 1) * V // WORLD] @ w[r * V // WORLD:(r + 1) * V // WORLD] for r in range(WORLD)]
    return [p.reshape(N, 1, H) for p in parts], (dz @ w).reshape(N, 1, H)


def _close64(got, expected, what):
    """float64 sums split over 2 ranks and combined (logsumexp of the shards' logsumexps): the same maths in
    another grouping (tolerances.same_maths_slack)."""
    assert_same_maths(got, expected, torch.float64, what)


@pytest.mark.parametrize("name", [n for n in CASES if CASES[n][0] == torch.float64])
def test_every_rank_gets_the_whole_vocabularys_outputs_and_its_partial_d_hidden(ranks, name):
    if name not in ranks[0]:
        assert name == "fp64_megatron_output_processor"
        pytest.skip(MEGATRON_SKIP)
    _, reduction, no_grad, sequence_parallel = CASES[name]
    expected = _unsharded(name)
    partial, full = _partial_truth(case_inputs(torch.float64), reduction)
    for r in range(WORLD):
        logp, entropy, dh, dw = ranks[r][name]
        _close64(logp, expected[0], f"rank {r} log_probs")
        _close64(entropy, expected[1], f"rank {r} entropy")
        assert logp.shape == (() if reduction == "sum" else (N,)) and entropy.shape == (N,)
        if no_grad:
            assert dh is None and not logp.requires_grad
            continue
        shard = slice(r * V // WORLD, (r + 1) * V // WORLD)
        _close64(dw, expected[3][shard], f"rank {r} d weight (its shard's rows)")
        if sequence_parallel:  # Megatron's gather reduce-scatters the partials: this rank's rows of the full d hidden
            rows = slice(r * N // WORLD, (r + 1) * N // WORLD)
            _close64(dh, expected[2][rows], f"rank {r} d hidden after the sequence-parallel gather")
        else:
            _close64(dh, partial[r], f"rank {r} d hidden (its shard's part)")
            # bound: not a tolerance: the other shard's share of d hidden is O(1), far above rounding (partial, not
            # the reduced gradient)
            assert (dh - expected[2]).abs().max() > 1e-3
    if not no_grad and not sequence_parallel:
        _close64(sum(ranks[r][name][2] for r in range(WORLD)), expected[2], "d hidden summed over the ranks")
        _close64(expected[2], full, "unsharded d hidden against the float64 reference")


def test_megatron_name_bound_at_import_is_swapped(ranks):
    """model_forward_fused did ``from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy`` when it
    was imported, before grpo_kernels.verl: the patch swapped that name too (and says so)."""
    if ranks[0]["megatron_bound_ours"] is None:
        pytest.skip(MEGATRON_SKIP)
    for r in range(WORLD):
        assert ranks[r]["megatron_bound_ours"] is True
        assert "verl.models.mcore.model_forward_fused.linear_cross_entropy" in ranks[r]["report_patched"]
        assert ranks[r]["report_patched"][0] == "verl.utils.kernel.linear_cross_entropy.linear_cross_entropy"


def test_bf16_ranks_against_the_unsharded_call(ranks):
    """bf16: the three-way rule against float64 truth, the middle term the unsharded call in bf16 (the sharded head
    may not be much less accurate than the unsharded one); d hidden as the sum of the ranks' partials."""
    x = case_inputs(torch.bfloat16)
    expected = _unsharded("bf16")
    x64 = {**x, "hidden": x["hidden"].double(), "weight": x["weight"].double()}
    from grpo_kernels.integrations.verl import linear_cross_entropy

    truth = call(linear_cross_entropy, x64, x64["weight"])
    for r in range(WORLD):
        for k, what in ((0, "log_probs"), (1, "entropy")):
            assert_three_way(ranks[r]["bf16"][k], expected[k], truth[k], torch.bfloat16, f"rank {r} {what}")
        shard = slice(r * V // WORLD, (r + 1) * V // WORLD)
        assert_three_way(ranks[r]["bf16"][3], expected[3][shard], truth[3][shard], torch.bfloat16,
                         f"rank {r} d weight", scale=grad_scale(truth[3][shard]))
    summed = ranks[0]["bf16"][2].float() + ranks[1]["bf16"][2].float()
    assert_three_way(summed, expected[2], truth[2], torch.bfloat16, "d hidden summed over the ranks",
                     scale=grad_scale(truth[2]))


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
