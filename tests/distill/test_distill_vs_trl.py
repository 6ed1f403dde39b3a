"""Our two distillation functions against TRL 1.16's own ``ChunkedDivergenceFunction`` and
``_chunked_divergence_loss`` (their CPU path: the tiles folded in torch) and the float64 reference, on every option:
beta 0, in between and 1, temperature, both scales and soft caps, biases, a teacher wider than the student, masks,
``num_items_in_batch``. The three-way rule: ours within K times TRL's fp32 error against float64, plus the floor.

The PyTorch path runs every case (CPU tensors, impl "auto"); the Triton paths under the interpreter run one case
each here, the others in the slow set.
"""
from __future__ import annotations

import pytest
import torch

from ..support.distill_cases import (CASE_IDS, CASES, assert_loss_three_way,
                                     assert_token_three_way, make_heads, ours_loss, ours_token, trl_loss, trl_token,
                                     truth_loss, truth_token)

F32, F64 = torch.float32, torch.float64
SLOW_TRITON = [c if c.id in ("jsd-0.7-all",) else pytest.param(c, marks=pytest.mark.slow) for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_token_divergence_matches_trl(case):
    """Per-token divergence, entropy and the student's gradients (hidden, weight, bias) of a weighted sum of the
    divergences, (B, T) tokens with two masked."""
    heads = make_heads(bias=case.bias, seed=1)
    ours = ours_token(heads, case.cfg)
    assert_token_three_way(ours, trl_token(heads, case.cfg), truth_token(heads, case.cfg), F32, case.id)


@pytest.mark.parametrize("num_items", [None, 13.0, "tensor"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_loss_matches_trl(case, num_items):
    """The loss (mean over valid tokens, or sum / num_items_in_batch), its gradients and the entropy sum / count TRL's
    trainer logs."""
    n = torch.tensor(11.0) if num_items == "tensor" else num_items
    heads = make_heads(bias=case.bias, seed=2)
    ours = ours_loss(heads, case.cfg, num_items_in_batch=n)
    assert_loss_three_way(ours, trl_loss(heads, case.cfg, n), truth_loss(heads, case.cfg, num_items_in_batch=n),
                          F32, f"{case.id} num_items {num_items}")


@pytest.mark.interpreter
@pytest.mark.usefixtures("poisoned_outputs")
@pytest.mark.parametrize("case", SLOW_TRITON, ids=CASE_IDS)
def test_triton_paths_match_trl(case, plans):
    """The loss on distill.fast and the per-token function on distill.light (Triton under the interpreter, whose
    16-column blocks V = 37 crosses) against TRL and float64."""
    heads = make_heads(bias=case.bias, seed=4)
    loss = ours_loss(heads, case.cfg, impl="triton")
    token = ours_token(heads, case.cfg, impl="triton")
    assert [p.path for p in plans] == ["distill.fast", "distill.light"]
    assert_loss_three_way(loss, trl_loss(heads, case.cfg), truth_loss(heads, case.cfg), F32, f"{case.id} fast")
    assert_token_three_way(token, trl_token(heads, case.cfg), truth_token(heads, case.cfg), F32, f"{case.id} light")


def test_trl_oracle_sees_a_wrong_gradient():
    """The rule fails a result whose gradient is off by a part in a thousand (the test can fail)."""
    case = CASES[2]
    heads = make_heads(seed=1)
    (div, ent), grads = ours_token(heads, case.cfg)
    wrong = ((div, ent), (grads[0] * 1.001,) + tuple(grads[1:]))
    with pytest.raises(AssertionError, match="d hidden"):
        assert_token_three_way(wrong, trl_token(heads, case.cfg), truth_token(heads, case.cfg), F32, case.id)
