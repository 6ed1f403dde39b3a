"""Packed vs padded losses on a long-tailed batch (docs/benchmarks.md, "Packed sequences"): forward + backward of
``grpo_loss`` (from logits) and ``fused_linear_grpo_loss`` (from hidden states), the padded (S, Tmax) call with its
mask against the packed (N,) call with ``cu_seqlens``, on the same tokens.

The batch: S sequences of lengths ``ceil(Tmax * u^3)``, u uniform on (0, 1] (seed 0): a few near Tmax, most short;
75% of the padded grid is padding in expectation (E[u^3] = 1/4; each benchmark checks >= 70%). CPU: S = 16,
Tmax = 256, V = 8000, H = 64, fp32; CUDA: S = 32, Tmax = 1024, V = 151936, H = 4096, bf16 (the benchmark shapes).
Each provider does its real work: the padded head compacts its valid rows (no padded FLOPs), the padded logits
call skips its padded rows in the kernels but reads a (S, Tmax, V) buffer; the packed calls see N tokens only."""
from __future__ import annotations

import math

import pytest
import torch

import grpo_kernels as gk

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
S, TMAX, V, H = (32, 1024, 151936, 4096) if CUDA else (16, 256, 8000, 64)
DTYPE = torch.bfloat16 if CUDA else torch.float32


def long_tailed_lengths(S: int, Tmax: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    u = 1.0 - torch.rand(S, generator=g, dtype=torch.float64)  # (0, 1]
    return torch.clamp(torch.ceil(Tmax * u ** 3), 1, Tmax).long()


def _batch():
    lengths = long_tailed_lengths(S, TMAX)
    g = torch.Generator().manual_seed(1)
    mask = torch.arange(TMAX).unsqueeze(0) < lengths.unsqueeze(1)
    cu = torch.zeros(S + 1, dtype=torch.int64)
    cu[1:] = torch.cumsum(lengths, 0)
    positions = mask.reshape(-1).nonzero().squeeze(1)
    ids = torch.randint(0, V, (S, TMAX), generator=g)
    adv = torch.randn(S, generator=g)
    old = -3 + 0.1 * torch.randn(S, TMAX, generator=g)
    return {k: v.to(DEV) for k, v in dict(mask=mask, cu=cu, positions=positions, ids=ids, adv=adv, old=old).items()}


BATCH = None


def batch():
    global BATCH
    if BATCH is None:
        BATCH = _batch()
    return BATCH


@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("loss", ["linear", "logits"])
def test_packed_vs_padded_loss(benchmark, loss, layout):
    b = batch()
    N = b["positions"].numel()
    assert 1.0 - N / (S * TMAX) >= 0.70, "the long-tailed batch must be >= 70% padding"
    g = torch.Generator(device=DEV).manual_seed(2)
    flat = lambda t: t.reshape(-1, *t.shape[2:]).index_select(0, b["positions"])  # noqa: E731
    weight = (torch.randn(V, H, device=DEV, generator=g) / math.sqrt(H)).to(DTYPE).requires_grad_(True)
    if loss == "linear":
        x = torch.randn((S, TMAX, H) if layout == "padded" else (N, H), device=DEV, generator=g).to(DTYPE)
    else:
        x = torch.randn((S, TMAX, V) if layout == "padded" else (N, V), device=DEV, generator=g).to(DTYPE)
    x.requires_grad_(True)
    kw = dict(config=gk.GRPOLossConfig(loss_type="grpo"))
    if layout == "padded":
        args, kw = (b["ids"], b["adv"], b["mask"]), dict(kw, old_logps=b["old"])
    else:
        args, kw = (flat(b["ids"]), b["adv"]), dict(kw, old_logps=flat(b["old"]), cu_seqlens=b["cu"])

    def step():
        x.grad = weight.grad = None
        if loss == "linear":
            out, _ = gk.fused_linear_grpo_loss(x, weight, *args, **kw)
        else:
            out, _ = gk.grpo_loss(x, *args, **kw)
        out.backward()
        if CUDA:
            torch.cuda.synchronize()

    benchmark.extra_info.update(tokens=N, padded_grid=S * TMAX, padding=1 - N / (S * TMAX), layout=layout)
    benchmark.pedantic(step, rounds=3 if not CUDA else 5, warmup_rounds=1)
