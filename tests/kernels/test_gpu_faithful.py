"""What only a GPU shows (docs/api.md "Host syncs", docs/kernels.md "Rows in flight"): a training step's loss and
backward captured in a CUDA graph and replayed, and the logits fast path at Gemma's vocabulary (V = 262144) with
the rows in flight the planner sized from the device's L2. Skipped without CUDA; ``benchmarks/gpu_check.sh`` runs
this file."""
from __future__ import annotations

import pytest
import torch

import grpo_kernels as gk

from ..support.tolerances import assert_three_way, gamma, loss_truth_and_same_dtype

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs a CUDA GPU; runs in benchmarks/gpu_check.sh")]
DEV = "cuda"


def _rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-12)).item()


def _batch(B=8, T=96, H=256, V=4096, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), device=DEV, generator=g)
    mask = torch.arange(T, device=DEV).unsqueeze(0) < lengths.unsqueeze(1)
    return dict(x=torch.randn(B, T, H, device=DEV, generator=g), ids=torch.randint(0, V, (B, T), device=DEV,
                                                                                    generator=g),
                mask=mask, adv=torch.randn(B, device=DEV, generator=g),
                old=-3 + 0.2 * torch.randn(B, T, device=DEV, generator=g),
                ref=-3 + 0.2 * torch.randn(B, T, device=DEV, generator=g))


@pytest.mark.parametrize("config", [dict(loss_type="dapo", beta=0.04), dict(loss_type="grpo", entropy_coef=0.01),
                                    dict(loss_type="grpo", importance_sampling_level="sequence")],
                         ids=["dapo-kl", "grpo-entropy", "gspo"])
def test_a_training_step_is_captured_in_a_cuda_graph(config):
    """A body (Linear) + fused head with ``capturable=True``: forward and backward captured once, replayed on new
    data copied into the static inputs; loss, metrics and gradients equal an eager step on the same data."""
    torch.manual_seed(0)
    B, T, H, V = 8, 96, 256, 4096
    body = torch.nn.Linear(H, H, device=DEV)
    head = torch.nn.Parameter(torch.randn(V, H, device=DEV) / H ** 0.5)
    cfg = gk.GRPOLossConfig(capturable=True, **config)
    static = _batch(B, T, H, V, seed=0)

    def step():
        loss, metrics = gk.fused_linear_grpo_loss(body(static["x"]), head, static["ids"], static["adv"],
                                                  static["mask"], old_logps=static["old"], ref_logps=static["ref"],
                                                  config=cfg, impl="triton")
        loss.backward()
        return loss.detach(), {k: v.detach() for k, v in metrics.items()}

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compiles the kernels, probes cuBLAS, outside the capture
        for _ in range(3):
            for p in (*body.parameters(), head):
                p.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for p in (*body.parameters(), head):
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, metrics = step()
    for seed in (1, 2):
        fresh = _batch(B, T, H, V, seed=seed)
        for k in static:
            static[k].copy_(fresh[k])
        graph.replay()
        torch.cuda.synchronize()
        replayed = (loss.clone(), {k: v.clone() for k, v in metrics.items()},
                    [p.grad.clone() for p in (*body.parameters(), head)])
        for p in (*body.parameters(), head):
            p.grad = None
        e_loss, e_metrics = gk.fused_linear_grpo_loss(body(fresh["x"]), head, fresh["ids"], fresh["adv"],
                                                      fresh["mask"], old_logps=fresh["old"],
                                                      ref_logps=fresh["ref"], config=cfg.replace(capturable=False),
                                                      impl="triton")
        e_loss.backward()
        # bound: the same fp32 maths in another chunking (padded rows computed vs compacted): sums of at most
        #   n = B T terms in two orders differ by at most 2 gamma(n) times the sum of their magnitudes (a derived
        #   bound, with the magnitudes bounded by max(|value|, 1) here)
        tol = 2 * gamma(B * T)
        assert abs(replayed[0].item() - e_loss.item()) <= tol * max(abs(e_loss.item()), 1.0)
        for k in e_metrics:
            assert abs(replayed[1][k].item() - e_metrics[k].item()) <= tol * max(abs(e_metrics[k].item()), 1.0)
        for got, p in zip(replayed[2], (*body.parameters(), head)):
            assert _rel(got, p.grad) <= tol
        for p in (*body.parameters(), head):
            p.grad = None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_logits_fast_path_at_gemma_vocab(dtype, plans):
    """V = 262144 (Gemma), 1024 tokens, dapo with KL and an entropy bonus: the fast path's loss and d logits
    against the float64 reference on the GPU, and the plan keeps its rows in flight within L2."""
    V, B, T = 262144, 2, 512
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = (torch.randn(B, T, V, device=DEV, generator=g) * 2).to(dtype)
    ids = torch.randint(0, V, (B, T), device=DEV, generator=g)
    mask = torch.ones(B, T, dtype=torch.bool, device=DEV)
    mask[1, T // 3:] = False
    adv = torch.randn(B, device=DEV, generator=g)
    ref = -12 + torch.randn(B, T, device=DEV, generator=g)
    cfg = gk.GRPOLossConfig(loss_type="dapo", beta=0.04, entropy_coef=0.01, softcap=30.0)
    x = logits.clone().requires_grad_(True)
    loss, _ = gk.grpo_loss(x, ids, adv, mask, ref_logps=ref, config=cfg, impl="triton")
    loss.backward()
    plan = plans[-1]
    assert plan.path == "logits.fast" and plan.rows_in_flight * V * logits.element_size() <= plan.l2_bytes
    # three-way rule: against float64, within K x the error of plain PyTorch in the logits' dtype on the same inputs
    inputs = dict(logits=logits, ids=ids, advantages=adv, mask=mask, ref_logps=ref)
    loss64, grad64, loss_d, grad_d = loss_truth_and_same_dtype(inputs, cfg)
    assert_three_way(loss.detach(), loss_d, loss64, dtype, "loss")
    assert_three_way(x.grad, grad_d, grad64, dtype, "d logits", scale=grad64.abs().max().item())
