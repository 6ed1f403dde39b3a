"""Triton kernels, one module per op holding its @triton.jit kernels and their launchers (docs/DESIGN.md section 5):

- ``logits_kernels``: log-prob / logsumexp / entropy vocab sweep over given logits and its d-logits backward;
- ``token_loss_kernels``: the per-token GRPO terms (ratio, clipping, KL, loss, its gradient, metrics);
- ``linear_forward_kernels`` / ``linear_backward_kernels``: the fused linear head (shared helpers and the tile
  table in ``linear_tiles``); ``linear_epilogue_kernels``: the row-sweep epilogues over cuBLAS fp32 logits chunks;
- ``fp32_gemm``: the fp32-output cuBLAS GEMMs and the one decision whether this torch has them;
- ``common``: the @triton.jit helpers every module shares (fast exp2, soft cap, the online logsumexp of every sweep);
- ``host``: the host-side helpers every launcher shares (cdiv, the GPU-generation table, launch arguments, layouts);
- ``scale_kernels``: the fast head's gradient hand-out (scale and cast in one pass, the scale read on the device).

Design, instruction budgets and how to read the AOT report: docs/kernels.md.

Kernels live at module level and these modules are imported lazily, by the autograd layer on the first launch, so
TRITON_INTERPRET set any time before then takes effect. Every launch goes through ``launch.launch``; every module
lists representative launches in ``aot_launches()``, from which ``tools/aot.py`` derives the signatures it
compiles ahead of time (no hand-written signatures).
"""
