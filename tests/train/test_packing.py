"""The packed layout of ``grpo.train`` (grpo/packing.py), without a model: every sequence's tokens land exactly once,
at positions restarting at 0, and each completion token is read from the position that predicts it; micro-batches
are cut by the token budget (whole sequences, a long one alone) and split to a common count; micro-batch weights make
any cut give the loss and gradients of the whole mini-batch in one call, for every reduction (float64); a packed
micro-batch makes one host-to-device transfer (its index tensors) and reads nothing back."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_kernels as gk
from grpo.packing import (Packing, cut_micro_batches, host_to_device, layout_rows, micro_batch_share, pack_rows,
                          packed_micro_batches, sequence_lengths, split_to_count)
from grpo.rollout import Rollout
from grpo.update import _packed_micro_batches
from grpo_kernels.loss_types import LOSS_TABLE

from ..support.tolerances import assert_same_maths, grad_scale
from .packing_cases import COMPLETIONS, PROMPTS, ragged_rollout


def test_sequence_lengths_read_the_rollout():
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    assert rollout.sequence_lengths == (PROMPTS, COMPLETIONS)


def test_a_prompt_that_is_not_one_left_padded_block_is_refused():
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    mask = rollout.attention_mask.clone()
    mask[2, rollout.prompt_length - 2] = 0  # a hole inside row 2's prompt
    with pytest.raises(RuntimeError, match=r"rollout row 2 has a prompt that is not one contiguous left-padded"):
        sequence_lengths(mask, rollout.completion_mask, rollout.prompt_length)
    mask[2, :rollout.prompt_length] = 0
    with pytest.raises(RuntimeError, match=r"rollout row 2 has no prompt token"):
        sequence_lengths(mask, rollout.completion_mask, rollout.prompt_length)


@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one-row"])
def test_every_token_lands_once_at_its_position(one_row):
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    rows = [5, 0, 3, 1, 7]  # a mini-batch in shuffled order
    packed = pack_rows(rollout, rows, one_row)
    P = rollout.prompt_length
    ids, pos = packed.input_ids.reshape(-1), packed.position_ids.reshape(-1)
    if one_row:
        assert packed.input_ids.shape[0] == 1 and packed.positions == sum(PROMPTS[r] + COMPLETIONS[r] - 1 for r in rows)
        cu = packed.attention_kwargs["cu_seq_lens_q"]
        assert cu.tolist() == [0] + torch.tensor([PROMPTS[r] + COMPLETIONS[r] - 1 for r in rows]).cumsum(0).tolist()
    else:
        assert packed.input_ids.shape[1] == max(PROMPTS[r] + COMPLETIONS[r] - 1 for r in rows)
        assert packed.attention_kwargs == {}
    # each segment of restarting positions is one sequence's fed tokens (or the row-end filler)
    starts = [i for i in range(pos.numel()) if pos[i] == 0]
    segments = {}
    for k, s in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else pos.numel()
        row_end = (s // packed.input_ids.shape[1] + 1) * packed.input_ids.shape[1]
        end = min(end, row_end)
        assert pos[s:end].tolist() == list(range(end - s))
        segments[s] = ids[s:end].tolist()
    expected = []
    for r in rows:
        p, c = PROMPTS[r], COMPLETIONS[r]
        expected.append(rollout.input_ids[r, P - p:P + c - 1].tolist())
    found = [seq for seq in segments.values() if seq in expected]
    assert sorted(map(tuple, found)) == sorted(map(tuple, expected))  # each sequence exactly once, intact
    # the loss's tokens: sequence order, each read where its predecessor sits
    assert packed.cu_seqlens.tolist() == [0] + torch.tensor([COMPLETIONS[r] for r in rows]).cumsum(0).tolist()
    assert packed.rows.tolist() == rows
    for s, r in enumerate(rows):
        lo, hi = packed.cu_seqlens[s], packed.cu_seqlens[s + 1]
        assert packed.completion_ids[lo:hi].tolist() == rollout.completion_ids[r, :COMPLETIONS[r]].tolist()
        assert packed.completion_mask[lo:hi].tolist() == rollout.completion_mask[r, :COMPLETIONS[r]].tolist()
        predecessors = torch.cat([rollout.input_ids[r, P - 1:P], rollout.completion_ids[r, :COMPLETIONS[r] - 1]])
        assert ids[packed.token_index[lo:hi]].tolist() == predecessors.tolist()
    # gather: a (B, T) tensor's values for these tokens
    values = torch.arange(rollout.completion_ids.numel(), dtype=torch.float32).view_as(rollout.completion_ids)
    got = packed.gather(values)
    assert got.tolist() == torch.cat([values[r, :COMPLETIONS[r]] for r in rows]).tolist()


def test_rows_of_the_longest_length_hold_every_sequence_once():
    fed = [9, 1, 4, 12, 2, 6, 3, 3, 12, 1]
    row_of, offset_of, used = layout_rows(fed, one_row=False)
    capacity = max(fed)
    assert all(u <= capacity for u in used)
    for r in range(len(used)):
        spans = sorted((offset_of[i], offset_of[i] + fed[i]) for i in range(len(fed)) if row_of[i] == r)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] == used[r]
    assert sum(used) == sum(fed) and len(used) == -(-sum(fed) // capacity)  # first-fit decreasing fills them here


def test_micro_batches_cut_by_the_token_budget():
    fed = [5, 5, 5, 20, 3, 3, 3]
    assert cut_micro_batches(fed, 10, 100) == [[0, 1], [2], [3], [4, 5, 6]]  # the 20-token sequence alone
    assert cut_micro_batches(fed, None, 3) == [[0, 1, 2], [3, 4, 5], [6]]
    assert cut_micro_batches(fed, 12, 2) == [[0, 1], [2], [3], [4, 5], [6]]
    assert cut_micro_batches(fed, None, 100) == [list(range(7))]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        cut_micro_batches(fed, 0, 1)


def test_split_to_a_common_count_keeps_order_and_budget():
    fed = [5, 5, 5, 20, 3, 3, 3]
    parts = cut_micro_batches(fed, 10, 100)
    more = split_to_count(parts, fed, 6)
    assert len(more) == 6 and [i for p in more for i in p] == list(range(7))
    assert all(sum(fed[i] for i in p) <= 10 or len(p) == 1 for p in more)
    with pytest.raises(ValueError, match="cannot cut 7 sequences into 8 micro-batches"):
        split_to_count(parts, fed, 8)


def test_packed_micro_batches_cover_the_mini_batch():
    rollout = ragged_rollout(PROMPTS, COMPLETIONS)
    rows = [7, 6, 5, 4, 3, 2, 1, 0]
    micro = packed_micro_batches(rollout, rows, Packing(max_tokens=12), max_rows=3)
    assert [r for mb in micro for r in mb.rows.tolist()] == rows
    for mb in micro:
        fed = [PROMPTS[r] + COMPLETIONS[r] - 1 for r in mb.rows.tolist()]
        assert mb.num_sequences <= 3 and (sum(fed) <= 12 or mb.num_sequences == 1)


def _padded_loss(hidden, weight, ids, mask, adv, old, ref, loss_type, num_items=None):
    cfg = gk.GRPOLossConfig(loss_type=loss_type, beta=0.1, max_completion_length=12)
    return gk.fused_linear_grpo_loss(hidden, weight, ids, adv, mask=mask, old_logps=old, ref_logps=ref, config=cfg,
                                     num_items_in_batch=num_items, impl="torch")[0]


@pytest.mark.parametrize("loss_type", sorted(LOSS_TABLE))
def test_weighted_micro_batches_give_the_whole_mini_batch(loss_type):
    """sum_k share_k * loss(micro-batch k) == loss(all sequences in one call), and so are the gradients (float64):
    by sequence share (grpo, sapo, luspo, dr_grpo), scored-token share (bnpo), num_items_in_batch (dapo, cispo,
    vespo). Micro-batches of 3, 1 and 4 sequences, one with no scored token."""
    g = torch.Generator().manual_seed(3)
    B, T, H, V = 8, 12, 6, 11
    hidden = torch.randn(B, T, H, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.arange(T)[None, :] < torch.tensor(COMPLETIONS)[:, None]
    mask[1] = False  # a sequence with no scored token
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    old = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 - 2
    ref = torch.randn(B, T, generator=g, dtype=torch.float64) * 0.1 - 2
    reduction = LOSS_TABLE[loss_type].reduction
    num_items = mask.sum().double() if reduction == "num_items" else None
    whole = _padded_loss(hidden, weight, ids, mask, adv, old, ref, loss_type, num_items)
    (grad_whole,) = torch.autograd.grad(whole, hidden)
    total = 0.0
    for part in ([0, 1, 2], [3], [4, 5, 6, 7]):
        idx = torch.tensor(part)
        loss = _padded_loss(hidden[idx], weight, ids[idx], mask[idx], adv[idx], old[idx], ref[idx], loss_type,
                            num_items)
        total = total + loss * micro_batch_share(reduction, len(part), B, mask[idx].sum(), mask.sum())
    (grad_parts,) = torch.autograd.grad(total, hidden)
    # float64, the same sums split over micro-batches and recombined by their shares
    assert_same_maths(total, whole, torch.float64, f"{loss_type} loss")
    assert_same_maths(grad_parts, grad_whole, torch.float64, f"{loss_type} d hidden", scale=grad_scale(grad_whole))


# ------------------------------------------------------------------------------------------------- host transfers
class HostToDevice(TorchDispatchMode):
    """Counts host-to-device transfers: ``aten._to_copy`` / ``aten.copy_`` from a CPU tensor to another device (a
    dispatch mode sees them), and ``torch.tensor`` / ``torch.as_tensor`` / ``torch.asarray`` building a tensor on
    another device from host data (their copy runs below the dispatcher's Python modes: counted at the call). The
    ``meta`` device stands for "the device" on a CPU-only machine: a read back from it (``.item()``,
    ``.tolist()``) raises, so code that runs under this counter on meta tensors reads nothing back either."""

    BUILDERS = ("tensor", "as_tensor", "asarray")

    def __init__(self, monkeypatch):
        super().__init__()
        self.calls: list[str] = []
        for name in self.BUILDERS:
            monkeypatch.setattr(torch, name, self._builder(name, getattr(torch, name)))

    def _builder(self, name, build):
        def counted(data, *args, **kwargs):
            device = kwargs.get("device", args[1] if name == "as_tensor" and len(args) > 1 else None)
            on_device = isinstance(data, torch.Tensor) and device is not None and \
                data.device.type == torch.device(device).type
            if device is not None and torch.device(device).type != "cpu" and not on_device:
                self.calls.append(f"torch.{name}")
            return build(data, *args, **kwargs)
        return counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._to_copy.default and args[0].device.type == "cpu" and out.device.type != "cpu":
            self.calls.append("aten._to_copy")
        if func is torch.ops.aten.copy_.default and args[1].device.type == "cpu" and args[0].device.type != "cpu":
            self.calls.append("aten.copy_")
        return out


def _on_meta(rollout: Rollout) -> Rollout:
    """``rollout`` with its tensors on the meta device and its host-side lengths already read (as the trainer reads
    them once per rollout, before any micro-batch)."""
    lengths = rollout.sequence_lengths
    meta = Rollout(**{name: getattr(rollout, name).to("meta") if name in ("input_ids", "attention_mask",
                                                                          "completion_ids", "completion_mask")
                      else getattr(rollout, name) for name in rollout.__dataclass_fields__})
    meta.__dict__["sequence_lengths"] = lengths
    return meta


def test_the_transfer_counter_counts_index_tensors_built_on_the_device(monkeypatch):
    """The counter can fail: building a micro-batch's 7 index lists one ``torch.tensor(list, device=...)`` each (as
    pack_rows once did) counts 7; one moved buffer counts 1; host tensors and device-side fills count 0."""
    lists = [[5, 0, 3], [3, 3, 4], [9, 1, 2], [11, 3, 5], [0, 1, 0], [0, 0, 11], [14, 5]]
    with HostToDevice(monkeypatch) as counter:
        for values in lists:
            torch.tensor(values, dtype=torch.long, device="meta")
    assert counter.calls == ["torch.tensor"] * 7
    with HostToDevice(monkeypatch) as counter:
        torch.as_tensor([1, 2], device=torch.device("meta"))
        torch.tensor([1, 2]).to("meta")
        torch.zeros(3, device="meta").copy_(torch.ones(3))
        torch.tensor([1, 2]), torch.full((2,), 7, device="meta"), torch.as_tensor(torch.zeros(2, device="meta"),
                                                                                  device="meta")
    assert counter.calls == ["torch.as_tensor", "aten._to_copy", "aten.copy_"]


def test_host_to_device_keeps_the_lists():
    parts = host_to_device([[5, 0, 3], [], [2**40, -1]], torch.device("cpu"))
    assert [t.tolist() for t in parts] == [[5, 0, 3], [], [2**40, -1]] and all(t.dtype == torch.long for t in parts)


@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one-row"])
def test_a_packed_micro_batch_makes_one_host_to_device_transfer(one_row, monkeypatch):
    """Every micro-batch of a shuffled mini-batch cut by a token budget (grpo/packing.py's packed_micro_batches,
    and the optimizer step's micro-batches with advantages and reference log-probs, grpo/update.py): one transfer
    each, its index tensors, and no read back (the rollout on the meta device)."""
    rollout = _on_meta(ragged_rollout(PROMPTS, COMPLETIONS))
    rows = [7, 6, 5, 4, 3, 2, 1, 0]
    packing = Packing(max_tokens=12, one_row=one_row)
    with HostToDevice(monkeypatch) as counter:
        micro = packed_micro_batches(rollout, rows, packing, max_rows=3)
    assert len(micro) >= 4 and counter.calls == ["aten._to_copy"] * len(micro)
    extra = dict(advantages=torch.zeros(8, device="meta"), ref_logps=torch.zeros(8, 12, device="meta"),
                 old_logps=None)
    options = type("Options", (), dict(packing=packing, micro_batch_size=3))
    row_tensor = torch.tensor(rows).to("meta")
    with HostToDevice(monkeypatch) as counter:
        step = _packed_micro_batches(rollout, row_tensor, rows, extra, options, "token_mean")
    assert len(step) == len(micro) and counter.calls == ["aten._to_copy"] * len(micro)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned, non-blocking copy); "
                                                          "runs on machines with one")
@pytest.mark.parametrize("one_row", [False, True], ids=["rows", "one-row"])
def test_packed_micro_batches_on_cuda_equal_the_cpu_ones(one_row):
    """The pinned buffer's asynchronous copy delivers the same indices as the CPU layout."""
    rows = [5, 0, 3, 1, 7]
    cpu = pack_rows(ragged_rollout(PROMPTS, COMPLETIONS), rows, one_row)
    cuda = pack_rows(ragged_rollout(PROMPTS, COMPLETIONS, device="cuda"), rows, one_row)
    for name in ("input_ids", "position_ids", "token_index", "completion_ids", "completion_mask", "cu_seqlens",
                 "rows", "token_rows", "token_cols"):
        assert torch.equal(getattr(cuda, name).cpu(), getattr(cpu, name)), name
    assert cuda.attention_kwargs.keys() == cpu.attention_kwargs.keys()
    for key, value in cpu.attention_kwargs.items():
        other = cuda.attention_kwargs[key]
        assert torch.equal(other.cpu(), value) if isinstance(value, torch.Tensor) else other == value, key
