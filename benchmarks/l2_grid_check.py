"""The persistent logits kernel's grid on a GPU (docs/kernels.md, "Rows in flight"): the planner's L2-sized rows in
flight against one row per SM, at Gemma's vocabulary in bf16 and Qwen's in fp32 (where one row per SM overflows an
H100 / H200's L2) and Qwen's in bf16 (where it fits: the same grid). One forward + backward of ``grpo_loss``'s fast
path, in place, per case; prints a markdown table (median of 5 after 2 warm-ups, CUDA events). Run by
``benchmarks/gpu_check.sh``; ``python -m benchmarks.l2_grid_check``."""
from __future__ import annotations

import statistics
import sys

import torch


def _time(fn, reps=5, warmup=2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> int:
    if not torch.cuda.is_available():
        print("l2_grid_check: no CUDA device; nothing measured")
        return 0
    import grpo_kernels as gk
    from grpo_kernels import _testing
    from grpo_kernels.explain import plan_call
    from grpo_kernels.kernels.common import l2_bytes, num_sms
    dev = torch.device("cuda")
    sms, l2 = num_sms(dev), l2_bytes(dev)
    print(f"GPU {torch.cuda.get_device_name()}: {sms} SMs, L2 {l2 / 2**20:.1f} MiB")
    print("| V | dtype | tokens | rows in flight (plan) | ms, plan | ms, one per SM | one per SM / plan | GB/s, plan "
          "(2 V bytes a row) |")
    print("|---|---|---|---|---|---|---|---|")
    for V, dtype, N in ((262144, torch.bfloat16, 8192), (151936, torch.float32, 8192), (151936, torch.bfloat16, 8192)):
        logits = torch.randn(1, N, V, device=dev).to(dtype)
        ids = torch.randint(0, V, (1, N), device=dev)
        adv = torch.randn(1, device=dev)
        plan = plan_call(gk.grpo_loss, logits.requires_grad_(True), ids, adv, impl="triton")

        def step():
            x = logits.detach().requires_grad_(True)
            loss, _ = gk.grpo_loss(x, ids, adv, impl="triton", inplace_backward=True)
            loss.backward()

        ms_plan = _time(step)
        with _testing.override(logits_programs=sms):
            ms_full = _time(step)
        gbps = 2 * N * V * logits.element_size() / (ms_plan * 1e-3) / 1e9
        print(f"| {V} | {str(dtype).split('.')[-1]} | {N} | {plan.rows_in_flight} | {ms_plan:.3f} | {ms_full:.3f} | "
              f"{ms_full / ms_plan:.2f} | {gbps:.0f} |")
        del logits
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
