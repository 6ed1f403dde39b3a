"""``batch_invariant=True`` reaches every entry point (docs/api.md): the modules, ``explain()``, the Liger module's
three functions, ``patch_trl(batch_invariant=True)`` through TRL's own seam; each shown by the guarantee itself (a
sequence's numbers bitwise the same alone and in a batch, a loss the same padded or packed) where the entry point
computes and the option changes the numbers (each such test fails with the option forced off:
tests/api/test_invariance_forced_off.py), by the option seen on its way where the numbers are the same without it
(the Liger functions), and by a clear error for a bad value. The guarantee in depth:
tests/api/test_batch_invariance.py."""
from __future__ import annotations

import itertools

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


def _module_call(m, module: str, seqs, packed: bool):
    """(loss, d input of the last sequence) of the module on the sequences ``seqs`` (``_rows`` each: the hidden
    states or the logits by the module), packed with cu_seqlens or padded with a mask; advantages 1,
    num_items_in_batch given."""
    k = 0 if module == "FusedLinearGRPOLoss" else 1
    lengths = [s[2].shape[0] for s in seqs]
    if packed:
        x, ids = torch.cat([s[k] for s in seqs]), torch.cat([s[2] for s in seqs])
        mask, cu = None, torch.tensor([0, *itertools.accumulate(lengths)])
    else:
        T = max(lengths) + 1
        x, ids = torch.zeros(len(seqs), T, seqs[0][k].shape[-1]), torch.zeros(len(seqs), T, dtype=torch.long)
        mask, cu = torch.zeros(len(seqs), T), None
        for b, (s, n) in enumerate(zip(seqs, lengths)):
            x[b, :n], ids[b, :n], mask[b, :n] = s[k], s[2], 1.0
    x.requires_grad_(True)
    adv = torch.ones(len(seqs))
    if module == "FusedLinearGRPOLoss":  # Liger's positional order: (hidden, weight, ids, mask, advantages)
        loss, _ = m(x, WEIGHT, ids, mask, adv, cu_seqlens=cu, num_items_in_batch=12)
    else:
        loss, _ = m(x, ids, adv, mask, cu_seqlens=cu, num_items_in_batch=12)
    loss.backward()
    n = lengths[-1]
    return loss.detach(), (x.grad[-n:] if packed else x.grad[-1, :n])


@pytest.mark.parametrize("module", ["GRPOLoss", "FusedLinearGRPOLoss"])
def test_modules_take_the_option(module, small_blocks):
    """A module made with batch_invariant=True: a sequence's gradient is the same alone and after another sequence,
    padded or packed, for a sequence of one token and one of seven (the head's: alone the one-token sequence's GEMMs
    have one row, which the CPU BLAS computes with another kernel than a GEMM of more rows, so without the option
    they follow the batch; the logits loss's is per row by construction), and the loss of the same two sequences is
    the same padded or packed (the default sums follow the layout: what GRPOLoss fails on without the option)."""
    m = getattr(gk, module)(batch_invariant=True, loss_type="dapo")
    assert m.config.batch_invariant and m.config.deterministic
    other = _rows(seed=2, n=5)
    for n in (1, 7):
        probe = _rows(seed=1, n=n)
        _, alone = _module_call(m, module, [probe], packed=True)
        packed_loss, batched = _module_call(m, module, [other, probe], packed=True)
        padded_loss, padded = _module_call(m, module, [other, probe], packed=False)
        assert torch.equal(alone, batched), f"the {n}-token probe's gradient alone != after another sequence"
        assert torch.equal(batched, padded), f"the {n}-token probe's gradient packed != padded"
        assert torch.equal(packed_loss, padded_loss), \
            f"with the {n}-token probe: loss packed {packed_loss.item()!r} != padded {padded_loss.item()!r}"


def test_explain_says_it():
    hidden, _, ids = _rows()
    text = gk.explain(gk.linear_token_logprobs, hidden, WEIGHT, ids, batch_invariant=True)
    assert "batch-invariant" in text, "explain does not say batch-invariant: the option did not reach the plan"
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


def test_liger_entry_points_take_the_option(small_blocks, monkeypatch):
    """The option reaches the Liger module's config and, from the two functions, every ``token_logprobs`` call they
    make (a spy records it). Their numbers are the logits sweep's, which reduces each row alone: a probe row's
    log-probs and per-token loss gradient are the same alone and in a batch by construction, with the option off
    as with it on (both checked here; the shape where the sweep's numbers do follow the batch:
    tests/api/test_batch_invariance.py::test_a_token_alone_is_the_same_as_in_a_batch_on_the_torch_logits_path)."""
    module = liger.LigerFusedLinearGRPOLoss(batch_invariant=True, beta=0.0, use_ref_model=False)
    assert module.config.batch_invariant
    seen = []
    original = liger.token_logprobs
    monkeypatch.setattr(liger, "token_logprobs",
                        lambda *a, **k: seen.append(k.get("batch_invariant")) or original(*a, **k))
    for on in (False, True):
        def logsoftmax(probe, others):  # (B, T + 1, V) logits, Liger's layout; the probe is batch row 0
            logits = probe[1][None] if others is None else torch.stack([probe[1], probe[1].flip(0)])
            ids = probe[2][None].expand(logits.shape[0], -1)
            return liger.fused_selective_log_softmax(logits, ids, temperature=0.9, batch_invariant=on)[0]

        alone, batched = _alone_and_in_a_batch(logsoftmax)
        assert torch.equal(alone, batched), f"log-probs alone != in a batch (batch_invariant={on})"

        def triton_loss(probe, others):
            logits = probe[1][None] if others is None else torch.stack([probe[1], probe[1].flip(0)])
            x = logits.clone().requires_grad_(True)
            ids = probe[2][None, 1:].expand(logits.shape[0], -1)
            adv = torch.ones(logits.shape[0])
            mask = torch.ones(ids.shape)
            per_token, _, _ = liger.triton_grpo_loss(x, None, None, ids, adv, mask, beta=0.0, reduce=False,
                                                     inplace=False, batch_invariant=on)
            per_token.sum().backward()
            return x.grad[0]

        alone, batched = _alone_and_in_a_batch(triton_loss)
        assert torch.equal(alone, batched), f"d logits alone != in a batch (batch_invariant={on})"
    assert seen == [False] * 4 + [True] * 4, f"token_logprobs saw batch_invariant {seen}"


def test_patch_trl_makes_every_seam_call_batch_invariant(small_blocks, monkeypatch):
    """patch_trl(batch_invariant=True): TRL's _ChunkedLogProbFunction gives probes of 1, 2 and 3 tokens the same
    log-probs, entropies and d hidden alone and after five other rows (alone: GEMMs of 1 to 3 rows, which the CPU
    BLAS computes with other kernels than a GEMM of more rows, so that without the option they differ), and every
    call it makes takes the option."""
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
        other_h, _, other_ids = _rows(seed=2, n=5)
        bias = torch.zeros(V)
        for n in (1, 2, 3):
            probe_h, _, probe_ids = _rows(seed=1, n=n)
            outs = []
            for h, ids in ((probe_h, probe_ids), (torch.cat([other_h, probe_h]), torch.cat([other_ids, probe_ids]))):
                h, w, b = (t.clone().requires_grad_(True) for t in (h, WEIGHT, bias))
                values, grads = run_head(fn, h, w, b, ids)
                outs.append((values[0][-n:], values[1][-n:], grads[0][-n:]))
            for name, a, b in zip(("logp", "entropy", "d hidden"), *outs):
                assert torch.equal(a, b), f"{name}: the {n}-token probe's rows alone != after five others"
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
    assert "every block has 4 rows" in text, f"the chosen block did not reach the plan:\n{text}"
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
        assert plans and all(p.batch_invariant and p.chunk_rows == 4 for p in plans), \
            f"the chosen block did not reach the plan: {[(p.batch_invariant, p.chunk_rows) for p in plans]}"
    finally:
        gk.unpatch_trl()
    assert gk.integrations.trl._STATE["invariant_block_rows"] is None


def test_grpo_train_takes_the_chosen_block():
    """grpo.train takes the option (TrainConfig, --invariant-block-rows) and hands it to its old / reference log-probs
    too (tests/train/test_batch_invariant_training.py::test_the_chosen_block_reaches_every_log_prob_call)."""
    from grpo import TrainConfig

    assert TrainConfig(loss=GRPOLossConfig(batch_invariant=True, invariant_block_rows=64)).loss.invariant_block_rows == 64
