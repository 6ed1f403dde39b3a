"""Ahead-of-time compilation of every GPU kernel config for sm_90 (H100/H200) and sm_80 (A100), without a GPU.

Uses ``tools.aot`` (Triton's compiler + the cuobjdump/ptxas shipped in its wheel) in a child
process with TRITON_INTERPRET=0, on the ``aot_launches()`` scenarios of every kernel module of grpo_kernels.kernels
(fused linear, logits, token loss, ...). Fails on compile errors, register spills (ptxas "spill stores/loads" or
local memory) and shared memory over the GPU's limit; checks that bf16/fp16 fused-linear configs use Hopper's
HGMMA on sm_90 (HMMA on sm_80) and that fp32 configs use no tensor-core MMA at all (input_precision="ieee", i.e.
no silent TF32). Prints registers / spills / shared memory per kernel (pytest -s). The default test compiles a subset
(each fused-linear kernel with its heaviest flags, in fp32 and bf16, plus all configs of the other modules:
~25 s cold on 2 busy cores); the ``slow`` one compiles everything (~190 kernels: 1.5-3.5 min cold on 2 busy
cores, seconds once Triton's cache is warm).
"""
from __future__ import annotations

import os
import pkgutil
import re

import pytest

pytest.importorskip("triton")

from tools import aot  # noqa: E402

if not os.path.exists(aot.tool_path("cuobjdump")):
    pytest.skip("Triton's wheel ships no cuobjdump here", allow_module_level=True)

ARCHS = (90, 80)


def _kernel_modules() -> list:
    """Every kernel module of grpo_kernels.kernels (those ending in ``_kernels``; they must have ``aot_launches``).

    Found by name, not imported here: importing one creates its kernels, which must happen in the child process
    that compiles them (this test session runs under the interpreter)."""
    import grpo_kernels.kernels as pkg
    return [f"{pkg.__name__}.{info.name}" for info in pkgutil.iter_modules(pkg.__path__)
            if info.name.endswith("_kernels")]


MODULES = _kernel_modules()
# Default subset: every config of the small kernels, and each fused-linear kernel with its heaviest flags.
FAST = (r"^(?!linear_|head_)|^head_(fold_bias|loss_grad_bf16_clipped_all_options)/"
        r"|^linear_fwd_(fp32|bf16)_bias/|^linear_fwd_fp32_nobias/linear_fwd_merge"
        r"|^linear_dlogits_(fp32|bf16)_bias_ent$|^linear_bwd_atomic_(fp32|bf16)_bias_ent_(hwb|h|w)$")


def expected_names(pattern: str = "") -> set:
    """(arch, name) of every config the modules declare (names only; computed in the child as well)."""
    import subprocess
    import sys
    code = ("import sys; from tools.aot import module_configs\n"
            "for m in sys.argv[2:]:\n"
            "    for a in (90, 80):\n"
            "        for c in module_configs(m, a):\n"
            "            print(a, c[0])\n")
    env = dict(os.environ, TRITON_INTERPRET="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    out = subprocess.run([sys.executable, "-c", code, "x", *MODULES], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    pairs = {(int(a), n) for a, n in zip(out[::2], out[1::2])}
    return {p for p in pairs if not pattern or re.search(pattern, p[1])}


def check(reports) -> None:
    table = "\n".join(r.line() for r in reports)
    print("\n" + table)
    errors = [r.line() for r in reports if r.error]
    assert not errors, "kernels that do not compile:\n" + "\n".join(errors)
    spills = [r.line() for r in reports if r.spills]
    assert not spills, "kernels that spill registers:\n" + "\n".join(spills)
    big = [r.line() for r in reports if r.shared_bytes > aot.MAX_SHARED[r.arch]]
    assert not big, "kernels over the shared-memory limit:\n" + "\n".join(big)
    for r in reports:
        if not r.name.startswith("linear_") or r.name.endswith("merge_kernel"):
            continue
        if "_fp32" in r.name:
            assert not (r.hgmma or r.hmma), f"fp32 dot lowered to tensor cores (TF32?): {r.line()}"
        elif r.arch == 90:
            assert r.hgmma, f"half-precision fused-linear kernel without HGMMA on sm_90: {r.line()}"
        else:
            assert r.hmma, f"half-precision fused-linear kernel without HMMA on sm_80: {r.line()}"


def test_aot_subset():
    reports = aot.report_module(MODULES, ARCHS, only=FAST)
    assert {(r.arch, r.name) for r in reports} == expected_names(FAST)
    assert any(r.name.startswith("linear_bwd_atomic_bf16") for r in reports)
    check(reports)


@pytest.mark.slow
def test_aot_every_config():
    reports = aot.report_module(MODULES, ARCHS)
    assert {(r.arch, r.name) for r in reports} == expected_names()
    check(reports)
