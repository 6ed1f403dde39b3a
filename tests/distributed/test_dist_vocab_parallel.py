"""Vocab-parallel lm_head (``process_group=``) on CPU with gloo: 2 and 3 ranks against the unsharded call.

Each launch starts ``world`` plain processes running this file
(``python tests/distributed/test_dist_vocab_parallel.py MODE RANK WORLD STORE OUT``, tests/support/ranks.py), joined
through a file store, bounded by LAUNCH_TIMEOUT (a hang fails the test instead of blocking CI). A launch runs all its
cases and saves each rank's results; the tests compare them with the unsharded call made here: loss, metrics,
d hidden, the ranks' dW / dbias shards concatenated, logp and entropy. V = 23 is divisible by neither 2 nor 3. The
error launch gives one rank a bad shard / N / ids / argument and checks that every rank raises the same ValueError
(and that the group still works afterwards).
"""
from __future__ import annotations

import datetime
import os
import re
import socket
import sys
from pathlib import Path

import pytest
import torch

import grpo_kernels as gk
from tests.support.ranks import LAUNCH_TIMEOUT, REPO, start_ranks

try:
    from tests.support.tolerances import assert_same_maths, assert_three_way
except ImportError:  # run as a worker script: only the package is needed there
    assert_same_maths = assert_three_way = None

B, T, H, V = 4, 5, 8, 23
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

# name -> (kind, impl, dtype, bias, sharding, config overrides). sharding "rank_order": vocab_start derived from
# the lower ranks' sizes; "reversed": explicit vocab_start, rank 0 holding the last block.
CASES = {
    "grpo_beta_bias": ("loss", "torch", torch.float64, True, "rank_order", dict(loss_type="grpo", beta=0.04)),
    "dapo": ("loss", "torch", torch.float64, False, "rank_order", dict(loss_type="dapo")),
    "bnpo_entropy_bonus": ("loss", "torch", torch.float64, True, "rank_order",
                           dict(loss_type="bnpo", entropy_coef=0.05)),
    "gspo_sequence": ("loss", "torch", torch.float64, False, "reversed",
                      dict(loss_type="grpo", importance_sampling_level="sequence")),
    "vespo": ("loss", "torch", torch.float64, False, "rank_order", dict(loss_type="vespo")),
    "dr_grpo_top_entropy": ("loss", "torch", torch.float64, True, "rank_order",
                            dict(loss_type="dr_grpo", top_entropy_quantile=0.5)),
    "frozen_head_cispo": ("loss", "torch", torch.float64, True, "rank_order", dict(loss_type="cispo")),
    "all_masked": ("loss", "torch", torch.float64, True, "rank_order", dict(loss_type="grpo", beta=0.04)),
    "logprobs_bias": ("logprobs", "torch", torch.float64, True, "rank_order", {}),
    "logprobs_reversed": ("logprobs", "torch", torch.float64, False, "reversed", {}),
    # hidden_grad="partial": each rank's d hidden is its shard's part (their sum is the unsharded d hidden)
    "logprobs_partial_dh": ("logprobs", "torch", torch.float64, True, "reversed", dict(hidden_grad="partial")),
    "bf16_loss": ("loss", "torch", torch.bfloat16, True, "rank_order", dict(loss_type="bnpo", entropy_coef=0.05)),
    "triton_loss": ("loss", "triton", torch.float32, True, "rank_order",
                    dict(loss_type="grpo", beta=0.04, entropy_coef=0.05)),
    "triton_logprobs": ("logprobs", "triton", torch.float32, False, "rank_order", {}),
    # the vocab-parallel fast path (gradients in the forward, 6NHV / TP) and the light path beside it
    "triton_gspo_reversed": ("loss", "triton", torch.float32, False, "reversed",
                             dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04)),
    "frozen_head_triton_dapo": ("loss", "triton", torch.float32, True, "rank_order", dict(loss_type="dapo")),
    "triton_top_entropy_light": ("loss", "triton", torch.float32, True, "rank_order",
                                 dict(loss_type="bnpo", top_entropy_quantile=0.5)),
}
# Triton loss cases -> the path the planner must choose for them under process_group=
VOCAB_PARALLEL_PATHS = {"triton_loss": "head.fast_vocab_parallel", "triton_gspo_reversed": "head.fast_vocab_parallel",
                        "frozen_head_triton_dapo": "head.fast_vocab_parallel",
                        "triton_top_entropy_light": "head.light"}
ERROR_CASES = {  # name -> text every rank's message must contain
    "shard_gap": "must be contiguous and cover [0, V)",
    "short_shard_ids_out_of_range": "ids must lie in [0, V) = [0, 22)",
    "mismatched_n": "number of tokens N",
    "mismatched_ids": "ids must be the same on every rank, their checksums differ",
    "mismatched_mask": "mask",
    "bad_bias_on_one_rank": "invalid arguments on rank 1: bias must have shape",
    "vocab_start_on_some_ranks": "vocab_start must be given on every rank or on none",
    "hidden_grad_on_some_ranks": "whether hidden requires grad (1) or not (0)",
    "partial_hidden_grad_on_some_ranks": 'hidden_grad ("reduced": 0, "partial": 1) must be the same on every rank',
    "bad_hidden_grad_on_one_rank": "invalid arguments on rank 0: hidden_grad must be one of ('reduced', 'partial')",
}


def case_inputs(dtype, bias: bool, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    ids = torch.randint(0, V, (B, T), generator=g)
    ids[0, 0], ids[1, 1], ids[2, 2] = 0, V - 1, V // 2  # both ends of the vocabulary and a shard boundary
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[1, 3:] = False
    mask[3, 1:] = False
    out = {
        "hidden": hidden.to(dtype), "weight": weight.to(dtype), "ids": ids, "mask": mask,
        "bias": (torch.randn(V, generator=g, dtype=torch.float64) * 0.5).to(dtype) if bias else None,
        "advantages": torch.randn(B, generator=g, dtype=torch.float64).to(dtype),
        "old_logps": (-3.2 + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype),
        "ref_logps": (-3.2 + 0.15 * torch.randn(B, T, generator=g, dtype=torch.float64)).to(dtype),
        "grad_logp": torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype),
        "grad_entropy": torch.randn(B, T, generator=g, dtype=torch.float64).to(dtype),
    }
    return out


def shard_bounds(world: int, sharding: str) -> list[tuple[int, int]]:
    """(start, size) per rank; V = 23 split as evenly as possible (12 + 11, 8 + 8 + 7)."""
    sizes = [V // world + (k < V % world) for k in range(world)]
    blocks = [(sum(sizes[:k]), sizes[k]) for k in range(world)]
    return blocks if sharding == "rank_order" else blocks[::-1]


def run_case(name: str, x: dict, weight, bias, group=None, vocab_start=None, impl=None):
    """One call plus its backward; returns the outputs and the gradients of hidden, weight and bias."""
    kind, case_impl, _, _, _, overrides = CASES[name]
    impl = impl or case_impl
    trainable = not name.startswith("frozen_head")  # a frozen head: gradients for hidden only
    if name == "all_masked":
        x = {**x, "mask": torch.zeros_like(x["mask"])}
    hidden = x["hidden"].clone().requires_grad_(True)
    weight = weight.clone().requires_grad_(trainable)
    bias = None if bias is None else bias.clone().requires_grad_(trainable)
    if kind == "loss":
        loss, metrics = gk.fused_linear_grpo_loss(
            hidden, weight, x["ids"], x["advantages"], x["mask"], bias=bias, old_logps=x["old_logps"],
            ref_logps=x["ref_logps"], impl=impl, process_group=group, vocab_start=vocab_start, **overrides)
        loss.backward()
        out = {"loss": loss.detach(), **{k: v.detach() for k, v in metrics.items()}}
    else:
        extra = overrides if group is not None else {}  # hidden_grad: the unsharded call has one d hidden
        logp, entropy = gk.linear_token_logprobs(hidden, weight, x["ids"], bias=bias, return_entropy=True,
                                                 impl=impl, mask=x["mask"], process_group=group,
                                                 vocab_start=vocab_start, **extra)
        ((logp * x["grad_logp"]).sum() + (entropy * x["grad_entropy"]).sum()).backward()
        with torch.no_grad():  # the no-grad path of each impl
            out_ng = gk.linear_token_logprobs(x["hidden"], weight, x["ids"], bias=bias, impl=impl,
                                              mask=x["mask"], process_group=group, vocab_start=vocab_start)
        out = {"logp": logp.detach(), "entropy": entropy.detach(), "logp_no_grad": out_ng}
    out.update(dh=hidden.grad, dw=weight.grad, db=None if bias is None else bias.grad)
    return out


# ------------------------------------------------------------------------------------------------ worker side

def _worker_cases(mode: str) -> list[str]:
    if mode == "errors":
        return list(ERROR_CASES)
    return [n for n, c in CASES.items() if c[1] == "torch" or INTERPRET]


def _run_error_case(name: str, rank: int, world: int, group):
    x = case_inputs(torch.float64, bias=True)
    bounds = shard_bounds(world, "rank_order")
    start, size = bounds[rank]
    weight, bias = x["weight"][start:start + size], x["bias"][start:start + size]
    hidden, ids, mask, vocab_start = x["hidden"], x["ids"], x["mask"], None
    kwargs = {}
    if name == "shard_gap":
        vocab_start = start + (rank == 1)
    elif name == "short_shard_ids_out_of_range":
        if rank == world - 1:
            weight, bias = weight[:-1], bias[:-1]
    elif name == "mismatched_n" and rank == 0:
        hidden, ids, mask = hidden[:-1], ids[:-1], mask[:-1]
    elif name == "mismatched_ids" and rank == 2:
        ids = ids.clone()
        ids[0, 1] = (ids[0, 1] + 1) % V
    elif name == "mismatched_mask" and rank == 1:
        mask = mask.clone()
        mask[0, 0] = False
    elif name == "bad_bias_on_one_rank" and rank == 1:
        bias = bias[:-1]
    elif name == "vocab_start_on_some_ranks" and rank == 0:
        vocab_start = 0
    elif name == "hidden_grad_on_some_ranks" and rank == 2:
        hidden = hidden.clone().requires_grad_(True)
    elif name == "partial_hidden_grad_on_some_ranks" and rank == 1:
        kwargs = dict(hidden_grad="partial")
    elif name == "bad_hidden_grad_on_one_rank" and rank == 0:
        kwargs = dict(hidden_grad="summed")
    if name in ("mismatched_n", "mismatched_mask"):
        kwargs = dict(advantages=x["advantages"][:hidden.shape[0]])
        gk.fused_linear_grpo_loss(hidden, weight, ids, mask=mask, bias=bias, impl="torch", process_group=group,
                                  vocab_start=vocab_start, **kwargs)
    else:
        gk.linear_token_logprobs(hidden, weight, ids, bias=bias, mask=mask, impl="torch", process_group=group,
                                 vocab_start=vocab_start, **kwargs)


class _MatmulFlops(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the FLOPs of mm / addmm calls (2 m n k each) made while active."""

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out, torch.ops.aten.addmm.default,
                    torch.ops.aten.addmm.out, torch.ops.aten.addmm_.default):
            a, b = (args[0], args[1]) if func in (torch.ops.aten.mm.default, torch.ops.aten.mm.out) else args[1:3]
            self.flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
        return func(*args, **kwargs)


class _plans_and_flops:
    """The planner's paths (recorded from planner.plan_head) and the matmul FLOPs of the calls made inside."""

    def __enter__(self):
        from grpo_kernels import planner
        self.seen, self.planner, self.real = {"paths": [], "flops": 0}, planner, planner.plan_head
        def record(*a, **k):
            plan = self.real(*a, **k)
            self.seen["paths"].append(plan.path)
            return plan
        planner.plan_head = record
        self.mode = _MatmulFlops().__enter__()
        return self.seen

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)
        self.planner.plan_head = self.real
        self.seen["flops"] = self.mode.flops


def worker(mode: str, rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=LAUNCH_TIMEOUT))
    group = dist.new_group(list(range(world)))  # a group other than WORLD, as a tensor-parallel group would be
    results = {}
    for name in _worker_cases(mode):
        if mode == "errors":
            try:
                _run_error_case(name, rank, world, group)
                results[name] = None
            except ValueError as error:
                results[name] = str(error)
            continue
        _, _, dtype, bias, sharding, _ = CASES[name]
        x = case_inputs(dtype, bias)
        start, size = shard_bounds(world, sharding)[rank]
        vocab_start = None if sharding == "rank_order" else start
        with _plans_and_flops() as seen:
            res = run_case(name, x, x["weight"][start:start + size],
                           None if x["bias"] is None else x["bias"][start:start + size], group, vocab_start)
        results[name] = {**res, "start": start, "size": size, "plan_paths": seen["paths"],
                         "matmul_flops": seen["flops"]}
    if mode == "errors":  # the group still works after the errors: one good call
        x = case_inputs(torch.float64, bias=False)
        start, size = shard_bounds(world, "rank_order")[rank]
        logp = gk.linear_token_logprobs(x["hidden"], x["weight"][start:start + size], x["ids"], impl="torch",
                                        process_group=group)
        results["after_errors"] = logp
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ pytest side


def launch(world: int, mode: str, tmp: Path) -> list[dict]:
    """Run this file's worker on ``world`` ranks; return each rank's results."""
    start_ranks(world, tmp, lambda r: [__file__, mode, str(r), str(world), str(tmp / "store"), str(tmp)])
    return [torch.load(tmp / f"rank{r}.pt", weights_only=False) for r in range(world)]


@pytest.fixture(scope="module")
def sharded_results(tmp_path_factory):
    runs = {}

    def get(world: int, mode: str = "cases"):
        if (world, mode) not in runs:
            runs[world, mode] = launch(world, mode, tmp_path_factory.mktemp(f"vp_{mode}_{world}"))
        return runs[world, mode]
    return get


def _close(got, unsharded, truth, dtype, what):
    """float64: equal to the unsharded call to rounding. Lower precision: the three-way rule of
    docs/DESIGN.md section 6 against the float64 unsharded call, the middle term being the unsharded call in the
    same dtype and impl (the sharded head may not be much less accurate than the unsharded one)."""
    if dtype == torch.float64:
        # the same float64 sums split over the ranks (partial logsumexps and gradients all-reduced): the two within
        # tests/support/tolerances.py's same_maths_slack (2 ATOL of float64) of each other
        assert_same_maths(got, unsharded, dtype, what)
    else:
        assert_three_way(got, unsharded, truth, dtype, what)


def _params():
    for world in (2, 3):
        for name, case in CASES.items():
            marks = [pytest.mark.interpreter] if case[1] == "triton" else []
            yield pytest.param(world, name, id=f"{world}ranks-{name}", marks=marks)


@pytest.mark.parametrize("world,name", list(_params()))
def test_sharded_head_matches_unsharded(sharded_results, world, name):
    kind, impl, dtype, bias, sharding, _ = CASES[name]
    x = case_inputs(dtype, bias)
    expected = run_case(name, x, x["weight"], x["bias"])
    # ground truth: the same (rounded) inputs in float64
    x64 = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in x.items()}
    truth = expected if dtype == torch.float64 else run_case(name, x64, x64["weight"], x64["bias"], impl="torch")
    ranks = sharded_results(world)
    order = sorted(range(world), key=lambda r: ranks[r][name]["start"])
    partial_dh = CASES[name][5].get("hidden_grad") == "partial"
    for r in range(world):
        got = ranks[r][name]
        for key, value in expected.items():
            if key in ("dw", "db") or (key == "dh" and partial_dh):
                continue
            assert value is not None and got[key] is not None, key
            _close(got[key], value, truth[key], dtype, f"rank {r}, {key}")
    # the ranks' weight / bias gradient shards, laid out by vocab_start, are the unsharded gradients
    keys = ("dw", "db") if bias else ("dw",)
    for key in keys:
        if expected[key] is None:  # frozen head
            assert all(ranks[r][name][key] is None for r in range(world)), key
            continue
        _close(torch.cat([ranks[r][name][key] for r in order]), expected[key], truth[key], dtype, key)
    if partial_dh:  # each rank's part differs from the whole; their sum is the unsharded d hidden
        # bound: not a tolerance: a shard's part of d hidden is O(1) away from the whole (the other shards' share),
        # far above any rounding; this only tells a partial gradient from the reduced one
        assert all((ranks[r][name]["dh"] - expected["dh"]).abs().max() > 1e-3 for r in range(world))
        _close(sum(ranks[r][name]["dh"] for r in range(world)), expected["dh"], truth["dh"], dtype, "summed dh")
    if name == "all_masked":
        assert expected["loss"] == 0 and expected["dh"].abs().sum() == 0
    else:  # a test that can fail: the gradients compared are not all zero
        assert expected["dh"].abs().sum() > 0 and (expected["dw"] is None or expected["dw"].abs().sum() > 0)


@pytest.mark.skipif(not INTERPRET, reason="the Triton cases run on CPU under TRITON_INTERPRET=1 (set without CUDA)")
@pytest.mark.parametrize("world", [2, 3], ids=["2ranks", "3ranks"])
@pytest.mark.parametrize("name", list(VOCAB_PARALLEL_PATHS))
def test_vocab_parallel_fast_path_does_6nhv_per_rank(sharded_results, world, name):
    """The planner's path per rank, and the matmul FLOPs each rank actually did (a dispatch mode counting mm /
    addmm): the fast path 6 N H V_r in GEMMs (4 frozen: no dW GEMM), no recompute; the light path 8 N H V_r, of which
    the forward and the recompute (4) run as Triton tile dots the dispatch mode does not see."""
    ranks = sharded_results(world)
    n_valid = int(case_inputs(torch.float32, False)["mask"].sum())
    for r in range(world):
        got = ranks[r][name]
        assert got["plan_paths"] == [VOCAB_PARALLEL_PATHS[name]], got["plan_paths"]
        nhv = n_valid * H * got["size"]
        if VOCAB_PARALLEL_PATHS[name] == "head.fast_vocab_parallel":
            assert got["matmul_flops"] == (4 if name.startswith("frozen_head") else 6) * nhv, (got["matmul_flops"], nhv)
        else:  # light: forward and recompute are Triton tile dots (4NHV); its dW and dh are torch GEMMs (4NHV),
            # plus the target logits' deterministic row sums (vocab_parallel.add_rows_by_id): per block of r <= 256
            # rows a (r x r) @ (r x (H + 1)) GEMM (d weight and d bias columns; this case has a bias)
            from grpo_kernels.distributed.vocab_parallel import SUM_ROWS
            blocks = [min(SUM_ROWS, n_valid - b) for b in range(0, n_valid, SUM_ROWS)]
            sums = sum(2 * r * r * (H + 1) for r in blocks)
            assert got["matmul_flops"] == 4 * nhv + sums, (got["matmul_flops"], nhv, sums)


@pytest.mark.parametrize("name", list(ERROR_CASES))
def test_bad_shard_raises_on_every_rank(sharded_results, name):
    ranks = sharded_results(3, "errors")
    messages = [ranks[r][name] for r in range(3)]
    assert all(m is not None for m in messages), f"{name}: some rank did not raise: {messages}"
    assert len(set(messages)) == 1, f"{name}: ranks raised different errors: {messages}"
    assert messages[0].startswith("vocab-parallel lm_head over a process_group of 3 ranks: "), messages[0]
    assert ERROR_CASES[name] in messages[0], messages[0]
    x = case_inputs(torch.float64, bias=False)
    expected = gk.linear_token_logprobs(x["hidden"], x["weight"], x["ids"], impl="torch")
    for r in range(3):  # after the errors the group still works (float64: sums split over the ranks, as above)
        assert_same_maths(ranks[r]["after_errors"], expected, torch.float64, f"rank {r} after the errors")


def test_readme_example_runs_on_two_ranks(tmp_path):
    """docs/distributed.md's vocab-parallel example, as written, on 2 ranks with the environment torchrun would set."""
    text = (REPO / "docs" / "distributed.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Vocab-parallel head"):], re.S).group(1)
    script = tmp_path / "vocab_parallel_example.py"
    script.write_text(code)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    outputs = start_ranks(2, tmp_path, lambda r: [str(script)],
                          lambda r: dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)))
    lines = [re.search(r"rank \d: loss (\S+) weight.grad \((\d+), 64\) ref \(4, 16\)", out) for out in outputs]
    assert all(lines), outputs
    assert lines[0].group(1) == lines[1].group(1)  # the same loss on both ranks
    assert [int(m.group(2)) for m in lines] == [501, 500]  # V = 1001 split 501 + 500


def test_vocab_start_without_group_is_refused():
    x = case_inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="vocab_start is only meaningful with process_group"):
        gk.linear_token_logprobs(x["hidden"], x["weight"], x["ids"], vocab_start=0)
    with pytest.raises(ValueError, match="vocab_start is only meaningful with process_group"):
        gk.fused_linear_grpo_loss(x["hidden"], x["weight"], x["ids"], x["advantages"], vocab_start=0)


@pytest.mark.parametrize("value,match", [
    ("partial", 'hidden_grad="partial" is only meaningful with process_group'),
    ("sum", r"hidden_grad must be one of \('reduced', 'partial'\), got 'sum'"),
    (None, "hidden_grad must be one of"),
])
def test_hidden_grad_is_validated(value, match):
    x = case_inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match=match):
        gk.linear_token_logprobs(x["hidden"], x["weight"], x["ids"], hidden_grad=value)


def test_process_group_needs_initialized_distributed():
    x = case_inputs(torch.float32, bias=False)
    with pytest.raises(ValueError, match="process_group needs an initialized torch.distributed"):
        gk.linear_token_logprobs(x["hidden"], x["weight"], x["ids"], process_group=object())


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5])
