"""The packed layout of ``grpo.train`` (grpo/packing.py), without a model: every sequence's tokens land exactly once,
at positions restarting at 0, and each completion token is read from the position that predicts it; micro-batches
are cut by the token budget (whole sequences, a long one alone) and split to a common count; micro-batch weights make
any cut give the loss and gradients of the whole mini-batch in one call, for every reduction (float64)."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo.packing import (Packing, cut_micro_batches, layout_rows, micro_batch_share, pack_rows,
                          packed_micro_batches, sequence_lengths, split_to_count)
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
