"""``grpo.train`` reads its step metrics from the device once per step (docs/training.md, "Speed"): one ``tolist``
of one float64 stack (``grpo.distributed.read_scalars``), which under torchrun is also the one all-reduce that
averages them over the ranks.

Counted on CPU tensors by ``tests/support/host_transfers.py`` (on a CPU-only machine every tensor stands for a
device tensor, so the count is conservative), over whole training runs, per optimizer step and per rollout. Left
out of the count, each for its own reason:

- sampling (``Trainer.make_rollout``): the decoding loop's stop check and decoding the completions for the rewards;
- the no-grad passes (``rollout_logprobs``, reference and old policy) and the model's forward (``GRPOPolicy.forward``,
  with the loss): the loss's own documented read (docs/api.md, tests/api/test_host_syncs.py), transformers' packed-mask
  check, and the rollout's sequence lengths for packing, read once per rollout by its first packed pass;
- ``AdamW.step``: its step counters are host tensors (not ``capturable``), read on the host;
- evaluation, checkpoints and the end of the run (``_evaluate``, ``save``, ``param_checksums``, ``_summary``,
  ``_plot``): they read more, on their own steps.

What is left is the trainer's own code around the step: planning the packed micro-batches, weighting their losses,
clipping, the metrics and the log line."""
from __future__ import annotations

import functools

import pytest
import torch

from grpo import TrainConfig, train
from grpo import trainer as trainer_module
from grpo.distributed import DistEnv, read_scalars
from grpo.policy import GRPOPolicy

from ..support.host_transfers import counting_transfers, syncs
from ..support.train_runs import read_metrics

TINY = dict(prompts_per_step=2, num_generations=2, hidden_size=16, num_layers=1, num_heads=2, progress=False,
            device="cpu", eval_size=4, eval_every=2, save_steps=2)
LEFT_OUT = [(trainer_module.Trainer, name) for name in ("_evaluate", "save", "param_checksums", "_summary", "_plot")]
LEFT_OUT += [(trainer_module, "rollout_logprobs"), (GRPOPolicy, "forward"), (torch.optim.AdamW, "step")]


def _reads_per_phase(monkeypatch, cfg: TrainConfig) -> dict:
    """Run ``cfg``; the syncs the trainer's own code made, by ("step", n) and ("rollout", m) (each rollout: from
    its sampling to its first optimizer step)."""
    marks, stack, counter = [], [("setup", 0)], {"step": 0, "rollout": 0}
    records = []

    def mark():
        marks.append((len(records), stack[-1]))

    def wrap(owner, name, frame):
        """Run ``owner.name`` inside the stack frame ``frame()`` returns, marking where it starts and ends."""
        real = getattr(owner, name)

        @functools.wraps(real)
        def wrapped(*args, **kwargs):
            stack.append(frame())
            mark()
            try:
                return real(*args, **kwargs)
            finally:
                stack.pop()
                mark()
        monkeypatch.setattr(owner, name, wrapped)

    def left_out(owner, name):
        wrap(owner, name, lambda: ("left out", name))

    def starts(kind, owner, name, then_left_out: bool):
        def frame():
            counter[kind] += 1
            stack[0] = (kind, counter[kind])
            return ("left out", name) if then_left_out else stack[0]
        wrap(owner, name, frame)

    starts("rollout", trainer_module.Trainer, "make_rollout", then_left_out=True)
    starts("step", trainer_module, "optimizer_step_unread", then_left_out=False)
    for owner, name in LEFT_OUT:
        left_out(owner, name)
    with counting_transfers() as found:
        records = found
        train.train(cfg)
    by_phase: dict = {}
    bounds = marks + [(len(records), None)]
    for (start, label), (end, _) in zip(bounds, bounds[1:]):
        if label[0] in ("step", "rollout"):
            by_phase.setdefault(label, []).extend(syncs(records[start:end]))
    for kind in ("step", "rollout"):
        for n in range(1, counter[kind] + 1):
            by_phase.setdefault((kind, n), [])
    return by_phase


def test_one_metrics_read_per_step(monkeypatch, tmp_path):
    """The default layout (packed, the whole rollout one mini-batch in order): each optimizer step reads the device
    once, a tolist (the step's metrics with its rollout's statistics), and the rollout itself nothing beyond what is
    left out above. The count can fail: before the one read, each rollout read its six statistics one by one and
    each step the rows' order."""
    out = tmp_path / "run"
    reads = _reads_per_phase(monkeypatch, TrainConfig(output_dir=str(out), max_steps=4, **TINY))
    steps = {n: r for (kind, n), r in reads.items() if kind == "step"}
    rollouts = {n: r for (kind, n), r in reads.items() if kind == "rollout"}
    assert steps == {n: ["tolist"] for n in range(1, 5)}, reads
    assert rollouts == {n: [] for n in range(1, 5)}, reads
    records = [r for r in read_metrics(out) if "loss" in r]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and all("reward_mean" in r and "grad_norm" in r
                                                                 for r in records)


def test_a_shuffled_rollout_reads_its_order_once(monkeypatch, tmp_path):
    """Mini-batches of a shuffled rollout (two passes, two mini-batches each): still one read per step; the rows'
    order, which packing plans from, is read once per rollout for all its mini-batches (the second rollout is cut
    short by --max-steps: two of its four)."""
    cfg = TrainConfig(output_dir=str(tmp_path / "run"), max_steps=6, num_iterations=2, mini_batch_size=2, **TINY)
    reads = _reads_per_phase(monkeypatch, cfg)
    assert {n: r for (kind, n), r in reads.items() if kind == "step"} == {n: ["tolist"] for n in range(1, 7)}, reads
    assert {n: r for (kind, n), r in reads.items() if kind == "rollout"} == {1: ["tolist"], 2: ["tolist"]}, reads


def test_read_scalars_is_one_exact_read():
    """Every value as the float a read of its own gives (bitwise: float64 holds fp32, bf16 and integer counts
    exactly), keys in their order, Python numbers passed through, in one tolist."""
    g = torch.Generator().manual_seed(0)
    values = {"fp32": torch.randn((), generator=g), "number": 0.125, "bf16": torch.randn((), generator=g).bfloat16(),
              "count": torch.tensor(2**40 + 3), "mean": torch.randn(7, generator=g).mean(), "int": 3}
    with counting_transfers() as records:
        read = read_scalars(values)
    assert syncs(records) == ["tolist"]
    assert list(read) == list(values)
    assert read == {k: float(v) for k, v in values.items()}
    assert read_scalars({"a": 1, "b": 2.5}) == {"a": 1.0, "b": 2.5}


def test_read_scalars_averages_over_ranks_in_one_reduce(monkeypatch):
    """Under torchrun: the tensors and the Python numbers in one all-reduce (another rank's values stand in for
    gloo here), each value the float64 mean over the ranks, read once."""
    import grpo.distributed as distributed

    other = {"loss": 0.75, "steps": 5.0, "tokens": 12.0}
    reduced = []

    def all_reduce_sum(t, env):
        reduced.append(t.clone())
        t += torch.tensor([other[k] for k in ("loss", "tokens", "steps")], dtype=torch.float64)
        return t

    monkeypatch.setattr(distributed, "all_reduce_sum", all_reduce_sum)
    mine = {"loss": torch.tensor(0.3), "steps": 4, "tokens": torch.tensor(9)}
    with counting_transfers() as records:
        read = read_scalars(mine, DistEnv(rank=0, world_size=2))
    assert len(reduced) == 1 and syncs(records) == ["tolist"]
    assert list(read) == ["loss", "steps", "tokens"]
    assert read == {k: (float(v) + other[k]) / 2 for k, v in mine.items()}


@pytest.mark.parametrize("world_size", [1, 2])
def test_read_scalars_reads_nothing_without_tensors(world_size, monkeypatch):
    """Python numbers alone: nothing to read in one process (and under torchrun one reduce, read once)."""
    import grpo.distributed as distributed

    monkeypatch.setattr(distributed, "all_reduce_sum", lambda t, env: t.mul_(2))
    with counting_transfers() as records:
        read = read_scalars({"x": 1.5}, DistEnv(world_size=world_size))
    assert read == {"x": 1.5} and syncs(records) == ([] if world_size == 1 else ["tolist"])
