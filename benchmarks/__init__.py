"""pytest-benchmark suite of grpo-kernels against its peers (eager / compiled PyTorch, Liger-Kernel, TRL).

Run ``pytest benchmarks/ --benchmark-only`` (quick CPU set on a machine without CUDA, the GPU set on CUDA), then
``python -m benchmarks.report RESULTS.json`` for the markdown table and plots. Options: see ``conftest.py``.
"""
