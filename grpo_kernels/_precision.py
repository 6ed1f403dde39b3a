"""The TF32 rule for fp32 inputs: every matmul of this package follows torch's own fp32 matmul setting.

With torch's default (``torch.backends.cuda.matmul.fp32_precision`` / ``allow_tf32`` off, i.e.
``set_float32_matmul_precision("highest")``) fp32 inputs get IEEE fp32 everywhere: the Triton dots
(``input_precision="ieee"``) and the cuBLAS GEMMs alike. When the user enables TF32 for torch
(``allow_tf32 = True``, ``set_float32_matmul_precision("high")``, ``fp32_precision = "tf32"``), both switch to TF32,
as ``nn.Linear`` does. bf16 / fp16 inputs are unaffected (tensor-core dots, fp32 accumulation).
"""
from __future__ import annotations

import torch


def fp32_matmuls_use_tf32() -> bool:
    """Whether torch's fp32 CUDA matmuls currently use TF32.

    Read through the newer ``fp32_precision`` attribute where torch has it (reading the legacy ``allow_tf32`` raises
    once the two APIs were mixed); "none" inherits the global ``torch.backends.fp32_precision``.
    """
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # torch without the fp32_precision API
        return bool(matmul.allow_tf32)
    if precision == "none":
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"
