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
    # the probe's dict names its verdict; accept the likely spellings rather than guess one
    flag = next((info[k] for k in ("taken", "supported", "fp32_output", "ok") if k in info), None)
    verdict = "unknown (no verdict key in the probe's answer)" if flag is None else \
        "taken" if flag else "NOT taken (fallback)"
    return f"fp32-output GEMM path: {verdict}; " + ", ".join(f"{k}={v}" for k, v in info.items())


if __name__ == "__main__":
    print(describe())
    sys.exit(0)
