"""Test setup: Triton kernels run on the CPU interpreter unless a CUDA GPU is present.

TRITON_INTERPRET must be set before the first @triton.jit function is created (DESIGN.md section 4); the package
creates its kernels lazily, so setting it here, before any test imports a kernel, is enough.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(min(2, torch.get_num_threads()))
