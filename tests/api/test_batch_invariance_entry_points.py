"""``batch_invariant=True`` reaches every entry point (docs/api.md): the modules, ``explain()``, the Liger module's
three functions, ``patch_trl(batch_invariant=True)`` through TRL's own seam; each shown by the guarantee itself (a
sequence's numbers bitwise the same alone and in a batch) where the entry point computes, and by a clear error for a
bad value. The guarantee in depth: tests/api/test_batch_invariance.py."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels import liger
from grpo_kernels.config import GRPOLossConfig

V, H = 50, 8


def _rows(dtype=torch.float32, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, generator=g).to(dtype), torch.randn(n, V, generator=g).to(dtype) * 2,
            torch.randint(0, V, (n,), generator=g))


WEIGHT = (torch.randn(V, H, generator=torch.Generator().manual_seed(9)) / 2)


@pytest.fixture
def small_blocks(knobs):
    knobs(invariant_rows=4)  # blocks of 4 rows: the batches below cross their edges


def _alone_and_in_a_batch(fn):
    """fn(probe rows first?, other rows) -> a tensor whose first rows are the probe's: alone vs after 5 others."""
    probe, others = _rows(seed=1), _rows(seed=2, n=5)
    alone = fn(probe, None)
    batched = fn(probe, others)
    return alone, batched


@pytest.mark.parametrize("module", ["GRPOLoss", "FusedLinearGRPOLoss"])
def test_modules_take_the_option(module, small_blocks):
    m = getattr(gk, module)(batch_invariant=True, loss_type="dapo")
    assert m.config.batch_invariant and m.config.deterministic

    def grads(probe, others):
        rows = [probe] if others is None else [others, probe]
        idx = -probe[0].shape[0]
        x = torch.cat([r[0 if module == "FusedLinearGRPOLoss" else 1] for r in rows]).requires_grad_(True)
        ids = torch.cat([r[2] for r in rows])
        cu = torch.tensor([0] + ([] if others is None else [others[0].shape[0]]) + [x.shape[0]])
        adv = torch.ones(cu.numel() - 1)
        if module == "FusedLinearGRPOLoss":  # Liger's positional order: (hidden, weight, ids, mask, advantages)
            loss, _ = m(x, WEIGHT, ids, advantages=adv, cu_seqlens=cu, num_items_in_batch=12)
        else:
            loss, _ = m(x, ids, adv, cu_seqlens=cu, num_items_in_batch=12)
        loss.backward()
        return x.grad[idx:]

    alone, batched = _alone_and_in_a_batch(grads)
    assert torch.equal(alone, batched)


def test_explain_says_it():
    hidden, _, ids = _rows()
    text = gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids, batch_invariant=True)
    assert "batch-invariant" in text
    assert "batch-invariant" not in gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids)


@pytest.mark.parametrize("value", ["yes", 1, None])
def test_a_bad_value_names_the_option(value):
    with pytest.raises(ValueError, match="batch_invariant"):
        GRPOLossConfig(batch_invariant=value)
    with pytest.raises(ValueError, match="batch_invariant"):
        gk.patch_trl(batch_invariant=value)


def test_deterministic_false_is_refused_with_it():
    with pytest.raises(ValueError, match="batch_invariant=True needs deterministic=True"):
        GRPOLossConfig(batch_invariant=True, deterministic=False)


def test_liger_entry_points_take_the_option(small_blocks):
    module = liger.LigerFusedLinearGRPOLoss(batch_invariant=True, beta=0.0, use_ref_model=False)
    assert module.config.batch_invariant

    def logsoftmax(probe, others):  # (B, T + 1, V) logits, Liger's layout; the probe is batch row 0
        logits = probe[1][None] if others is None else torch.stack([probe[1], probe[1].flip(0)])
        ids = probe[2][None].expand(logits.shape[0], -1)
        return liger.fused_selective_log_softmax(logits, ids, temperature=0.9, batch_invariant=True)[0]

    alone, batched = _alone_and_in_a_batch(logsoftmax)
    assert torch.equal(alone, batched)

    def triton_loss(probe, others):
        logits = probe[1][None] if others is None else torch.stack([probe[1], probe[1].flip(0)])
        x = logits.clone().requires_grad_(True)
        ids = probe[2][None, 1:].expand(logits.shape[0], -1)
        adv = torch.ones(logits.shape[0])
        mask = torch.ones(ids.shape)
        per_token, _, _ = liger.triton_grpo_loss(x, None, None, ids, adv, mask, beta=0.0, reduce=False,
                                                 inplace=False, batch_invariant=True)
        per_token.sum().backward()
        return x.grad[0]

    alone, batched = _alone_and_in_a_batch(triton_loss)
    assert torch.equal(alone, batched)


def test_patch_trl_makes_every_seam_call_batch_invariant(small_blocks, monkeypatch):
    pytest.importorskip("trl", reason="TRL is in the test extra")
    from trl.trainer import utils as trl_utils

    from ..support.trl_runs import run_head

    seen = []
    original = gk.linear_token_logprobs
    monkeypatch.setattr(gk, "linear_token_logprobs",
                        lambda *a, **k: seen.append(k.get("batch_invariant")) or original(*a, **k))
    report = gk.patch_trl(batch_invariant=True)
    try:
        assert report.batch_invariant and "batch_invariant=True" in str(report)
        fn = trl_utils._ChunkedLogProbFunction
        probe_h, _, probe_ids = _rows(seed=1)
        other_h, _, other_ids = _rows(seed=2, n=5)
        bias = torch.zeros(V)
        outs = []
        for h, ids in ((probe_h, probe_ids), (torch.cat([other_h, probe_h]), torch.cat([other_ids, probe_ids]))):
            h, w, b = (t.clone().requires_grad_(True) for t in (h, WEIGHT, bias))
            values, grads = run_head(fn, h, w, b, ids)
            outs.append((values[0][-7:], values[1][-7:], grads[0][-7:]))
        for a, b in zip(*outs):
            assert torch.equal(a, b)
        assert seen and all(seen)
    finally:
        gk.unpatch_trl()


@pytest.mark.parametrize("value", [0, -4, 2.0, True, "8"])
def test_a_bad_block_names_the_option(value):
    """invariant_block_rows: an int >= 1 on every entry point that takes it, else a ValueError naming it."""
    hidden, logits, ids = _rows()
    calls = [lambda: GRPOLossConfig(batch_invariant=True, invariant_block_rows=value),
             lambda: gk.token_logprobs(logits, ids, batch_invariant=True, invariant_block_rows=value),
             lambda: gk.linear_token_logprobs(hidden, WEIGHT, ids, batch_invariant=True, invariant_block_rows=value),
             lambda: gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids, batch_invariant=True,
                                invariant_block_rows=value),
             lambda: gk.patch_trl(batch_invariant=True, invariant_block_rows=value)]
    for call in calls:
        with pytest.raises(ValueError, match="invariant_block_rows must be None or an int number of rows >= 1"):
            call()


def test_a_block_without_batch_invariant_is_refused():
    """Never silently ignored: a block with batch_invariant=False raises, naming both options."""
    hidden, logits, ids = _rows()
    calls = [lambda: GRPOLossConfig(invariant_block_rows=8),
             lambda: gk.token_logprobs(logits, ids, invariant_block_rows=8),
             lambda: gk.linear_token_logprobs(hidden, WEIGHT, ids, invariant_block_rows=8),
             lambda: gk.patch_trl(invariant_block_rows=8)]
    for call in calls:
        with pytest.raises(ValueError, match="invariant_block_rows=8 sets the rows per block of batch_invariant=True"):
            call()


def test_explain_shows_the_chosen_block():
    hidden, _, ids = _rows()
    text = gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids, batch_invariant=True, invariant_block_rows=4)
    assert "every block has 4 rows" in text
    assert "every block has 256 rows" in gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids,
                                                    batch_invariant=True)


def test_patch_trl_passes_the_chosen_block_to_every_seam_call(monkeypatch, plans):
    pytest.importorskip("trl", reason="TRL is in the test extra")
    from trl.trainer import utils as trl_utils

    from ..support.trl_runs import run_head

    report = gk.patch_trl(batch_invariant=True, invariant_block_rows=4)
    try:
        assert report.invariant_block_rows == 4 and "invariant_block_rows=4" in str(report)
        h, _, ids = _rows(seed=1)
        h, w, b = (t.clone().requires_grad_(True) for t in (h, WEIGHT, torch.zeros(V)))
        run_head(trl_utils._ChunkedLogProbFunction, h, w, b, ids)
        assert plans and all(p.batch_invariant and p.chunk_rows == 4 for p in plans), [p.chunk_rows for p in plans]
    finally:
        gk.unpatch_trl()
    assert gk.integrations.trl._STATE["invariant_block_rows"] is None


def test_grpo_train_refuses_a_block_it_cannot_pass_on():
    """grpo.train's old / reference log-probs do not take the option yet: TrainConfig refuses it (no flag)."""
    from grpo import TrainConfig
    from grpo.errors import UsageError

    with pytest.raises(UsageError, match="invariant_block_rows is not supported by grpo.train yet"):
        TrainConfig(loss=GRPOLossConfig(batch_invariant=True, invariant_block_rows=64))
