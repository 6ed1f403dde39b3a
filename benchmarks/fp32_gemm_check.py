"""One line: whether the fused head's logits GEMM writes fp32 directly (``mm`` with ``out_dtype=float32``) on this
CUDA device, or takes the fallback (bf16-rounded logits, slower blocks).

    python -m benchmarks.fp32_gemm_check

The decision is made once per device on a small real CUDA call
(``grpo_kernels.kernels.fp32_gemm.fp32_output_gemm_support``), so a fresh process reaches the one a benchmark run
made. ``benchmarks/gpu_check.sh`` prints this line before its summary.
"""
from __future__ import annotations

import sys


def describe(support=None, cuda: bool | None = None) -> str:
    """The line to print; ``support`` (the probe, a callable device -> dict) and ``cuda`` default to the real ones."""
    import torch

    if support is None:
        try:
            from grpo_kernels.kernels.fp32_gemm import fp32_output_gemm_support as support
        except ImportError as exc:
            return f"fp32-output GEMM path: unknown (grpo_kernels.kernels.fp32_gemm is not importable: {exc})"
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return "fp32-output GEMM path: not applicable (no CUDA device)"
    info = dict(support(torch.device("cuda")))
    if info.get("mm") is None and cuda is None:  # this process ran no fused-head GEMM yet: make the decision now
        from grpo_kernels.kernels.fp32_gemm import addmm_f32_, logits_f32
        a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
        logits_f32(a, a, torch.empty(64, 64, device="cuda"))
        addmm_f32_(torch.zeros(64, 64, device="cuda"), a, a)
        info = dict(support(torch.device("cuda")))
    # {"mm", "addmm": bool | None, "fallback": bool, "reason": str} (grpo_kernels.kernels.fp32_gemm)
    verdict = "not decided" if info.get("mm") is None else \
        "NOT taken (fallback)" if info.get("fallback") else "taken"
    return f"fp32-output GEMM path: {verdict}; " + ", ".join(f"{k}={v}" for k, v in info.items())


if __name__ == "__main__":
    print(describe())
    sys.exit(0)
