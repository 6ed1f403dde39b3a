"""tests/hf: Liger-Kernel's own tests vendored under liger_upstream/ are not this suite's tests: they import Liger's
``test`` package and run in a subprocess with Liger's names bound to ours (tests/hf/test_liger_jsd.py)."""

collect_ignore = ["liger_upstream"]
