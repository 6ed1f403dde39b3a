"""grpo-kernels: fused Triton kernels for the GRPO loss, and a thin GRPO training loop."""
from pathlib import Path

from setuptools import find_packages, setup

README = Path(__file__).with_name("README.md")

setup(
    name="grpo-kernels",
    version="0.1.0",
    description="Fused Triton kernels for the GRPO loss (TRL semantics) and a thin GRPO training loop",
    long_description=README.read_text() if README.exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["grpo_kernels", "grpo_kernels.*", "grpo", "grpo.*"]),
    python_requires=">=3.10",
    # torch is deliberately unpinned: install the build you want first (CPU: pip install torch==2.13.0).
    install_requires=["torch>=2.4", "triton>=3.2; platform_system == 'Linux'", "numpy"],
    extras_require={
        "train": ["transformers>=4.56", "tokenizers", "matplotlib", "tqdm", "liger-kernel>=0.8.5"],
        "trl": ["trl>=1.12,<1.17", "transformers>=4.56"],  # 1.12-1.15: tests/trl_versions/
        # deepspeed: the ZeRO-3 test on CPU (installs from its sdist in seconds; no op is compiled)
        "test": ["pytest>=8", "pytest-benchmark>=5", "pytest-xdist>=3.6", "hypothesis>=6.100", "trl==1.16.0", "liger-kernel==0.8.5",
                 "transformers>=4.56", "matplotlib", "tqdm", "deepspeed==0.19.8"],
        "bench": ["pytest>=8", "pytest-benchmark>=5", "liger-kernel==0.8.5", "trl==1.16.0", "matplotlib"],
        "gpu": ["flash-attn>=2.6"],
    },
)
