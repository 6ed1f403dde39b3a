"""The batch-invariance tests' one comparison (tests/api/test_batch_invariance.py, tests/distill/...): every
sequence's values bitwise equal across the calls it appears in. Its message says "differs", which the forced-off
check (tests/api/test_invariance_forced_off.py) reads as a failure on the numbers."""
from __future__ import annotations

import torch


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
