"""Triton kernels and their launchers. Nothing here imports Triton at import time: each kernel module creates or
imports its @triton.jit functions on first use, so TRITON_INTERPRET set before the first launch takes effect.

Modules that launch kernels on a GPU expose ``aot_configs(arch)`` for ``grpo_kernels.kernels.aot`` (tests/test_aot.py).
"""
