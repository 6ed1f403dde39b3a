"""TEST-ONLY stand-in for the two pure-PyTorch modules of flash-attn that OpenRLHF 0.11.2 imports at module load
(``openrlhf/models/ring_attn_utils.py``: ``flash_attn.bert_padding`` and ``flash_attn.utils.distributed``).

flash-attn has no CPU build, so ``.venv-openrlhf`` (scripts/setup_openrlhf.sh) does not install it; the conftest of
tests/openrlhf/ puts this folder (tests/openrlhf/stubs) on sys.path so that OpenRLHF imports. It is never installed
with grpo_kernels and no package code imports it. The functions are written from flash-attn 2.8.3's documented
behaviour (padding helpers for packed sequences and an all-gather over a process group); none of flash-attn's CUDA
kernels is stood in for: ``import flash_attn.ops`` or ``flash_attn.flash_attn_interface`` fails here, as OpenRLHF's
``log_probs_from_logits`` expects (it catches that ImportError and takes its pure-PyTorch path).
"""
__version__ = "2.8.3+cpu-test-stand-in"
