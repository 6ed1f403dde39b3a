"""The persistent logits kernel's rows in flight (docs/kernels.md, "Rows in flight"): the planner sizes its grid
from the device's L2 so the rows it keeps in flight fit with margin, and ``explain`` says so. Planned on meta
tensors, which plan as the sm_90 table's H100 / H200 (132 SMs, 50 MiB of L2)."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk
from grpo_kernels.explain import plan_call
from grpo_kernels.kernels import host
from grpo_kernels.kernels.logits_loss_kernels import L2_FRACTION, SMS_FLOOR, rows_in_flight

SM90 = host.GENERATIONS[90]


def _plan(V, dtype, N=16384):
    logits = torch.empty(1, N, V, dtype=dtype, device="meta", requires_grad=True)
    ids = torch.zeros(1, N, dtype=torch.long, device="meta")
    adv = torch.zeros(1, device="meta")
    return plan_call(gk.grpo_loss, logits, ids, adv, impl="triton")


@pytest.mark.parametrize("V,dtype", [(262144, torch.bfloat16), (151936, torch.float32)],
                         ids=["gemma-vocab-bf16", "qwen-vocab-fp32"])
def test_rows_in_flight_fit_l2_where_one_per_sm_would_not(V, dtype):
    """One row per SM would hold 69 MiB (Gemma's vocabulary in bf16) or 80 MiB (Qwen's in fp32) of a 50 MiB L2:
    the plan keeps fewer rows in flight, within L2_FRACTION of it, and at least SMS_FLOOR of the SMs busy."""
    plan = _plan(V, dtype)
    row = V * dtype.itemsize
    assert plan.path == "logits.fast"
    assert SM90.sms * row > SM90.l2_bytes  # the old grid would not fit
    assert plan.rows_in_flight * row <= L2_FRACTION * plan.l2_bytes and plan.l2_bytes == SM90.l2_bytes
    assert plan.rows_in_flight >= SMS_FLOOR * SM90.sms and plan.rows_in_flight < SM90.sms
    text = str(plan)
    assert f"rows in flight: {plan.rows_in_flight} x" in text and "within L2" in text
    assert "expected DRAM traffic" in text and "per row (the row read, its d logits written)" in text


def test_qwen_vocab_in_bf16_keeps_one_row_per_sm():
    """V = 151936 in bf16: 132 rows of 297 KiB (39 MiB) fit 80% of 50 MiB: the full grid stays."""
    plan = _plan(151936, torch.bfloat16)
    assert plan.rows_in_flight == SM90.sms


def test_a_row_too_large_for_l2_keeps_half_the_sms_and_says_so():
    """V = 262144 in fp32 (1 MiB a row): even SMS_FLOOR of the SMs overflow L2; the plan keeps them and states the
    second read from DRAM (3 V x 4 bytes a row)."""
    plan = _plan(262144, torch.float32)
    assert plan.rows_in_flight == int(SMS_FLOOR * SM90.sms)
    assert "the second sweep re-reads DRAM" in str(plan) and "the row read again" in str(plan)
    flight = rows_in_flight(16384, 262144, torch.float32, torch.device("meta"))
    assert not flight.fits and flight.dram_bytes_per_row == 3 * 262144 * 4


def test_the_kernel_is_launched_with_the_plan_s_grid(monkeypatch, plans, knobs):
    """The launcher's grid is the plan's rows in flight (under the interpreter, a knob caps them to 3)."""
    from grpo_kernels.kernels import logits_loss_kernels as lk
    grids = []
    real = lk.launch

    def spy(kernel, grid, *args, **kwargs):
        if kernel is lk.logits_loss_grad_in_forward:
            grids.append(grid)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(lk, "launch", spy)
    knobs(logits_programs=3)
    x = torch.randn(2, 5, 37, requires_grad=True)
    gk.grpo_loss(x, torch.randint(0, 37, (2, 5)), torch.randn(2), impl="triton")[0].backward()
    assert plans[-1].path == "logits.fast" and grids == [(plans[-1].rows_in_flight,)] and grids[0] == (3,)


def test_the_device_reports_its_own_l2_where_it_can():
    """On CUDA the L2 is the device's own report; elsewhere the table's conservative figure."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        assert host.l2_bytes(torch.device("cuda", 0)) == getattr(props, "L2_cache_size", SM90.l2_bytes)
    assert host.l2_bytes(torch.device("meta")) == SM90.l2_bytes


def test_explain_on_meta_counts_what_a_cuda_run_allocates():
    """The memory-light head's deterministic backward on bf16: a CUDA run forms d logits as cuBLAS fp32 logits plus
    the epilogue, 4 bytes an element; a plan on meta tensors counts those 4 bytes (it counted 2: the CPU route's)."""
    N, H, V = 4096, 1024, 32000
    hidden = torch.empty(N, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    weight = torch.empty(V, H, dtype=torch.bfloat16, device="meta", requires_grad=True)
    plan = plan_call(gk.linear_token_logprobs, hidden, weight, torch.zeros(N, dtype=torch.long, device="meta"))
    chunk = dict(plan.transient)["d logits chunk"]
    # the whole N x V d logits fits the default 1 GiB budget: one chunk of every row and column, 4 bytes each
    assert plan.path == "head.light" and plan.row_block == N and chunk == plan.chunk_bytes == N * V * 4
