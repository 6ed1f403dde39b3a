"""Ahead-of-time compilation of every GPU kernel config for sm_90 (H100/H200) and sm_80 (A100), without a GPU.

Uses ``tools.aot`` (Triton's compiler + the cuobjdump/ptxas shipped in its wheel) in a child
process with TRITON_INTERPRET=0, on the ``aot_launches()`` scenarios of every kernel module of grpo_kernels.kernels
(fused linear, logits, token loss, ...). Fails on compile errors, register spills (ptxas "spill stores/loads" or
local memory) and shared memory over the GPU's limit; checks that bf16/fp16 fused-linear configs use Hopper's
HGMMA on sm_90 (HMMA on sm_80) and that fp32 configs use no tensor-core MMA at all (input_precision="ieee", i.e.
no silent TF32), and that the half-precision logits kernels stream rows with 16-byte vector loads / stores
(``LDG.E.128`` / ``STG.E.128``, no 2-byte ``LDG.E.U16`` / ``STG.E.U16``). Prints registers / spills / shared
memory per kernel (pytest -s), and holds every half-precision row sweep to ``SWEEP_BUDGET`` SASS instructions per
element on sm_90 (docs/kernels.md: the issue-time estimate of a sweep at or below its memory floor). The default
test compiles a subset
(each fused-linear kernel with its heaviest flags, in fp32 and bf16, plus all configs of the other modules:
~25 s cold on 2 busy cores); the ``slow`` one compiles everything (~190 kernels: 1.5-3.5 min cold on 2 busy
cores, seconds once Triton's cache is warm).
"""
from __future__ import annotations

import dataclasses
import os
import pkgutil
import re

import pytest

pytest.importorskip("triton")

from tools import aot  # noqa: E402

if not os.path.exists(aot.tool_path("cuobjdump")):
    pytest.skip("Triton's wheel ships no cuobjdump here", allow_module_level=True)

ARCHS = (90, 80)
# SASS instructions per element and sweep loop of the bf16 row sweeps on sm_90 (docs/kernels.md, "Budgets").
SWEEP_BUDGET = 14
# The bf16 row-sweep configs the budget test compiles: the heaviest flag set of each sweep kernel.
SWEEPS = (r"^(logits_fwd_bf16|logits_bwd_bf16_entropy|logits_loss_bf16_clipped_all_options|logits_scale_bf16"
          r"|head_fold_bias/head_fold_kernel|head_dlogits_bf16_bias_ent"
          r"|head_loss_grad_bf16_clipped_all_options/head_loss_grad_kernel)$")


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
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def check_vector_widths(reports) -> None:
    """Half-precision logits kernels (they stream vocab rows) must move 16-byte vectors: ``LDG.E.128`` in every
    one, ``STG.E.128`` in those that write rows, and no 2-byte ``LDG.E.U16`` / ``STG.E.U16`` except one scalar load
    of the target logit and (in kernels writing d logits) one scalar store of the target's column. The ``_vodd``
    configs (V % 16 != 0 on aligned rows) keep a scalar tail but must still vectorize the main loop. On an H200 the
    2-byte version made the backward 3.4x slower."""
    logits = [r for r in reports if r.name.startswith("logits_") and ("_bf16" in r.name or "_fp16" in r.name)]
    assert logits, "no half-precision logits kernel compiled"
    for r in logits:
        assert r.ldg128 > 0, f"no 16-byte loads: {r.line()}"
        if r.name.endswith("_vodd"):
            continue
        writes_rows = r.name.startswith(("logits_bwd", "logits_loss", "logits_scale"))
        target = r.name.startswith(("logits_fwd", "logits_bwd", "logits_loss"))
        assert r.ldg16 <= (1 if target else 0), f"2-byte loads in a row sweep: {r.line()}"
        assert r.stg16 <= (1 if writes_rows and target else 0), f"2-byte stores in a row sweep: {r.line()}"
        if writes_rows:
            assert r.stg128 > 0, f"no 16-byte stores: {r.line()}"


def check_sweep_budget(reports) -> None:
    """Every sweep loop of the sm_90 bf16 row-sweep kernels: at most SWEEP_BUDGET SASS instructions per element
    (fails, for example, on a per-block cross-warp reduction or a per-element 64-bit id compare). Configs with the
    soft cap on (``_softcap`` in the name) are printed but not held to it: the cap costs instructions of its own."""
    sweeps = [r for r in reports if r.arch == 90 and "bf16" in r.name and not r.name.endswith("_vodd")
              and "_softcap" not in r.name and r.per_element]
    for r in sweeps:
        over = [x for x in r.per_element if x > SWEEP_BUDGET]
        assert not over, f"row sweep over {SWEEP_BUDGET} SASS instructions per element: {r.line()}"


def test_sweep_loop_counting():
    """``aot.sweep_loops`` on a hand-written SASS listing: only innermost loops that load count, NOPs do not, a
    self-branch (the trailing trap) and a forward branch are no loops."""
    def ins(addr, text):
        return f"        /*{addr:04x}*/                   {text} ;\n"
    sass = "".join([ins(0x00, "MOV R1, c[0x0][0x28]"),
                    ins(0x10, "LDG.E.128 R4, desc[UR4][R2.64]"),          # outer loop body starts
                    ins(0x20, "FADD R5, R5, R6"),                          # inner loop 1: 0x20 .. 0x50
                    ins(0x30, "LDG.E.128 R8, desc[UR4][R2.64]"),
                    ins(0x40, "NOP"),
                    ins(0x50, "@P0 BRA 0x20"),
                    ins(0x60, "FMUL R5, R5, R6"),                          # inner loop 2 (no load): 0x60 .. 0x70
                    ins(0x70, "@!P1 BRA 0x60"),
                    ins(0x80, "@P2 BRA 0x10"),                             # outer loop
                    ins(0x90, "@P3 BRA 0xb0"),                             # forward branch
                    ins(0xa0, "EXIT"),
                    ins(0xb0, "BRA 0xb0")])                                # trap
    assert aot.sweep_loops(sass) == [3]
    assert aot.loop_elements({"BLOCK_V": 8192, "num_warps": 16}) == 16
    assert aot.loop_elements({"BLOCK_M": 128, "BLOCK_V": 128, "num_warps": 8}) == 0
    rep = aot.KernelReport("k", 90, 32, 0, 0, 0, 0, 0, 8, 3, False, False, loop_instructions=[176, 142],
                           loop_elements=16)
    assert rep.per_element == [11.0, 8.88]
    with pytest.raises(AssertionError, match="over 14"):
        check_sweep_budget([dataclasses.replace(rep, name="logits_bf16_x", loop_instructions=[240])])


def test_row_sweeps_within_instruction_budget():
    """The bf16 row sweeps on sm_90 (logits path and the fused head's epilogue): at most SWEEP_BUDGET SASS
    instructions per element per sweep loop, no spills, 16-byte vectors (seconds once Triton's cache holds them)."""
    mods = [m for m in MODULES if m.rsplit(".", 1)[1] in ("logits_kernels", "logits_loss_kernels",
                                                          "linear_epilogue_kernels")]
    reports = aot.report_module(mods, (90,), only=SWEEPS)
    assert len(reports) == 7 and all(r.per_element for r in reports), [r.line() for r in reports]
    assert {len(r.per_element) for r in reports if r.name.startswith(("logits_loss", "head_loss"))} == {2}
    check(reports)
    check_vector_widths(reports)
    check_sweep_budget(reports)


def test_logits_kernels_use_16_byte_vectors():
    """The vector-width check alone, on the logits-path kernels (seconds once Triton's cache holds them)."""
    mods = [m for m in MODULES if m.rsplit(".", 1)[1].startswith("logits_")]
    reports = aot.report_module(mods, ARCHS, only=r"_(bf16|fp16)")
    assert {r.name for r in reports} >= {"logits_fwd_bf16", "logits_bwd_bf16_entropy", "logits_loss_bf16_clipped_plain",
                                         "logits_scale_bf16", "logits_fwd_bf16_vodd"}
    check(reports)
    check_vector_widths(reports)


def test_aot_subset():
    reports = aot.report_module(MODULES, ARCHS, only=FAST)
    assert {(r.arch, r.name) for r in reports} == expected_names(FAST)
    assert any(r.name.startswith("linear_bwd_atomic_bf16") for r in reports)
    check(reports)
    check_vector_widths(reports)
    check_sweep_budget(reports)


@pytest.mark.slow
def test_aot_every_config():
    reports = aot.report_module(MODULES, ARCHS)
    assert {(r.arch, r.name) for r in reports} == expected_names()
    check(reports)
