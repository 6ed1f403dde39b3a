"""What the batch-invariance tests share (tests/api/test_batch_invariance.py, tests/distill/...): laying a pool's
sequences out as one call's input and splitting a result back, and the one comparison: every sequence's values
bitwise equal across the calls it appears in. Its message says "differs", which the forced-off check
(tests/api/test_invariance_forced_off.py) reads as a failure on the numbers."""
from __future__ import annotations

import itertools

import torch


def lay_out(rows: list, packed: bool):
    """Per-sequence tensors (L_i, ...) as one call's input: (data, cu_seqlens, mask). Packed: (N, ...) rows and
    cu_seqlens, no mask; padded: (B, T, ...) rows with T one more than the longest (a padded position in every row)
    and the mask, no cu_seqlens."""
    if packed:
        return torch.cat(rows), torch.tensor([0, *itertools.accumulate(r.shape[0] for r in rows)]), None
    T = max(r.shape[0] for r in rows) + 1
    out = torch.zeros((len(rows), T, *rows[0].shape[1:]), dtype=rows[0].dtype)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for b, r in enumerate(rows):
        out[b, : r.shape[0]], mask[b, : r.shape[0]] = r, True
    return out, None, mask


def split_back(t, order, lengths, packed: bool) -> dict:
    """A call's per-token result split back into its sequences: {pool index: the sequence's rows} (``lengths``:
    the sequences' lengths in ``order``)."""
    if packed:
        return dict(zip(order, torch.split(t, list(lengths))))
    return {i: t[b, :n] for b, (i, n) in enumerate(zip(order, lengths))}


def assert_invariant(results: list, what: str):
    """Every sequence's values bitwise equal across the calls it appears in (results: per call, (its label, a
    list over outputs of {pool index: values}))."""
    first = {}
    for label, outputs in results:
        for k, per_seq in enumerate(outputs):
            for i, values in per_seq.items():
                label0, v0 = first.setdefault((k, i), (label, values))
                assert torch.equal(values, v0), (
                    f"{what}: output {k} of sequence {i} differs between arrangements {label0} and {label} by "
                    f"{(values.double() - v0.double()).abs().max().item():.3e}")
