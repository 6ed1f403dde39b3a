"""TEST-ONLY stand-in for ``flash_attn.utils`` (see the package docstring)."""
