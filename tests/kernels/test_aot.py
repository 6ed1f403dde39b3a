"""Ahead-of-time compilation of every GPU kernel config for sm_90 (H100/H200) and sm_80 (A100), without a GPU.

Uses ``tools.aot`` (Triton's compiler + the cuobjdump/ptxas shipped in its wheel) in a child
process with TRITON_INTERPRET=0, on the ``aot_launches()`` scenarios of every kernel module of grpo_kernels.kernels
(fused linear, logits, token loss, ...), recorded as a CUDA run launches them (GPU routes; fp32 under torch's IEEE and
TF32 matmul precisions). Fails on compile errors, register spills (ptxas "spill stores/loads" or local memory) and
shared memory over the GPU's limit; checks that bf16/fp16 fused-linear configs use Hopper's HGMMA on sm_90 (HMMA on
sm_80), that IEEE fp32 configs use no tensor-core MMA at all (input_precision="ieee", i.e. no silent TF32) and TF32
ones do (``_tf32``), and that the half-precision logits kernels stream rows with 16-byte vector loads / stores
(``LDG.E.128`` / ``STG.E.128``, no 2-byte ``LDG.E.U16`` / ``STG.E.U16``). Prints registers / spills / shared
memory per kernel (pytest -s), and holds every half-precision row sweep to ``SWEEP_BUDGET`` SASS instructions per
element on sm_90 (docs/kernels.md: the issue-time estimate of a sweep at or below its memory floor).

The compiler is the child's Triton: this environment's (CI: 3.9), or the one ``GRPO_AOT_PYTHON`` names (CI's slow
step runs this file again with ``.venv-triton36/bin/python``, the GPU image's Triton 3.6: scripts/setup_aot36.sh).
The default tests compile a subset (each fused-linear kernel with its heaviest flags, in fp32, TF32 and bf16, plus
all configs of the other modules but the head epilogue's); the ``slow`` one compiles everything (every config of
both architectures: docs/kernels.md's variant list, whose counts tests/project/test_docs_figures.py checks; times in
docs/kernels.md, seconds once Triton's cache is warm).
"""
from __future__ import annotations

import dataclasses
import functools
import os
import re

import pytest

pytest.importorskip("triton")

from tools import aot  # noqa: E402

if not os.path.exists(aot.tool_path("cuobjdump")):
    pytest.skip("Triton's wheel ships no cuobjdump here", allow_module_level=True)

ARCHS = (90, 80)
# SASS instructions per element and sweep loop of the bf16 row sweeps on sm_90 (docs/kernels.md, "Budgets").
SWEEP_BUDGET = aot.SWEEP_BUDGET
# The bf16 row-sweep configs the budget test compiles: the heaviest flag set of each sweep kernel.
SWEEPS = (r"^(logits_fwd_bf16|logits_bwd_bf16_entropy|logits_loss_bf16_clipped_all_options|logits_scale_bf16"
          r"|head_fold_bias/head_fold_kernel|head_dlogits_bf16_bias_ent"
          r"|head_loss_grad_bf16_clipped_all_options/head_loss_grad_kernel)$")


MODULES = aot.kernel_modules()
# Default subset: every config of the small kernels, and each fused-linear kernel with its heaviest flags.
FAST = (r"^(?!linear_|head_|distill_)|^head_(fold_bias|loss_grad_bf16_clipped_all_options|dlogits_light_bf16_bias_ent)/"
        r"|^distill_row_jsd_bf16/|^distill_tile_fwd_jsd_bf16/"
        r"|^head_fold_bias_extras/|^linear_fwd_(fp32|bf16)_bias_extras/"
        r"|^linear_fwd_(fp32|bf16)_bias/|^linear_fwd_fp32_nobias/linear_fwd_merge|^linear_fwd_fp32_bias_tf32/"
        r"|^linear_dlogits_fp32_bias_ent(_tf32)?/|^linear_bwd_atomic_(fp32|bf16)_bias_ent_(hwb|h|w)$"
        r"|^linear_bwd_atomic_fp32_bias_ent_hwb_tf32$")


def expected_names(pattern: str = "") -> set:
    """(arch, name) of every config the modules declare (names only; computed in the child as well)."""
    return {p for p in _declared_names() if not pattern or re.search(pattern, p[1])}


@functools.lru_cache(maxsize=None)
def _declared_names() -> frozenset:
    return frozenset((arch, name) for arch, _, name in aot.declared_configs(MODULES, ARCHS))


def check(reports) -> None:
    table = "\n".join(r.line() for r in reports)
    print(f"\nTriton {', '.join(sorted({r.triton for r in reports}))} ({aot.child_python()})\n" + table)
    errors = [r.line() for r in reports if r.error]
    assert not errors, "kernels that do not compile:\n" + "\n".join(errors)
    spills = [r.line() for r in reports if r.spills]
    assert not spills, "kernels that spill registers:\n" + "\n".join(spills)
    big = [r.line() for r in reports if r.shared_bytes > aot.MAX_SHARED[r.arch]]
    assert not big, "kernels over the shared-memory limit:\n" + "\n".join(big)
    for r in reports:
        if not r.name.startswith("linear_") or r.name.endswith("merge_kernel"):
            continue
        if "_fp32" in r.name and "_tf32" in r.name:
            # TF32 (torch's fp32 matmul precision "high"): tensor cores, HGMMA or HMMA on sm_90 (wgmma needs
            # BLOCK_M >= 64), HMMA on sm_80
            assert r.hgmma or r.hmma, f"TF32 dot without tensor-core MMA: {r.line()}"
            assert r.arch == 90 or r.hmma, f"TF32 dot without HMMA on sm_80: {r.line()}"
        elif "_fp32" in r.name:
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


def check_distill_vectors(reports) -> None:
    """The two-head epilogues (``distill_kernels``) stream both rows with 16-byte loads (``LDG.E.128``) and those that
    write the student's d logits store 16-byte vectors (``STG.E.128``); their 2-byte accesses are the masked tails'
    (the vocabulary width is not specialized: a new V does not recompile)."""
    for r in (r for r in reports if r.name.startswith("distill_")):
        assert r.ldg128 > 0, f"no 16-byte loads: {r.line()}"
        if ("_row_" in r.name and "_nograd" not in r.name) or "_tile_bwd_" in r.name:
            assert r.stg128 > 0, f"no 16-byte stores: {r.line()}"


def check_sweep_budget(reports) -> None:
    """Every sweep loop of the sm_90 bf16 row-sweep kernels: at most SWEEP_BUDGET SASS instructions per element
    (fails, for example, on a per-block cross-warp reduction or a per-element 64-bit id compare). Configs with the
    soft cap on (``_softcap`` in the name) are printed but not held to it: the cap costs instructions of its own."""
    # Why not the two-head sweeps (``distill_``): each element reads two rows and the JSD's exponentials and logs
    # (docs/kernels.md, "Distillation epilogue", their measured figures); the budget is a one-row sweep's.
    sweeps = [r for r in reports if r.arch == 90 and "bf16" in r.name and not r.name.endswith("_vodd")
              and "_softcap" not in r.name and not r.name.startswith("distill_") and r.per_element]
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


def test_recording_takes_a_gpu_runs_routes():
    """Launches are recorded as a CUDA run makes them (``launch.recording``; no compile here): the light backward of
    bf16 / fp16 forms d logits by cuBLAS + ``head_dlogits_kernel``, fp32 by the tile kernel; fp32 tile dots follow
    torch's fp32 matmul precision (TF32 under ``tf32=True``, IEEE otherwise) and half ones are native; torch's own
    setting is restored after each recording. The interpreter's routes (small tiles, bf16 dots upcast) never show."""
    import torch

    from grpo_kernels.config import LogitTransform
    from grpo_kernels.inputs import LogprobGrads
    from grpo_kernels.kernels import linear_tiles
    from grpo_kernels.kernels.launch import recording
    from grpo_kernels.kernels.linear_backward_kernels import linear_logprobs_backward
    from grpo_kernels.kernels.linear_forward_kernels import linear_logprobs_forward

    def launched(dtype, tf32, deterministic=True):
        hidden, weight, bias, ids = linear_tiles.aot_inputs(dtype, True)
        stats = torch.zeros(hidden.shape[0])
        with recording(90, tf32=tf32) as records:
            linear_logprobs_forward(hidden, weight, bias, ids, 1.0)
            linear_logprobs_backward(hidden, weight, bias, ids, LogprobGrads(stats, stats, stats, stats),
                                     LogitTransform(1.0), (True, True, True), deterministic)
        return {(getattr(r.kernel, "fn", r.kernel).__name__, r.kwargs.get("DOT_FP32"), r.kwargs.get("BLOCK_M"))
                for r in records}

    precision = torch.backends.cuda.matmul.fp32_precision
    for dtype in (torch.bfloat16, torch.float16):
        for tf32 in (False, True):
            names = launched(dtype, tf32)
            assert {n for n, *_ in names} == {"linear_fwd_partial_kernel", "linear_fwd_merge_kernel",
                                              "head_dlogits_kernel"}, names
            assert {d for n, d, _ in names if n == "linear_fwd_partial_kernel"} == {linear_tiles.DOT_NATIVE}
            assert {m for n, _, m in names if m is not None} == {128}  # sm_90 half tiles, not the interpreter's
    for tf32, dot in ((False, linear_tiles.DOT_IEEE), (True, linear_tiles.DOT_TF32)):
        for deterministic in (True, False):
            names = launched(torch.float32, tf32, deterministic)
            assert "head_dlogits_kernel" not in {n for n, *_ in names}
            assert {d for _, d, _ in names if d is not None} == {dot}, (tf32, names)
    assert torch.backends.cuda.matmul.fp32_precision == precision


def test_every_gpu_variant_is_recorded():
    """The scenario set holds the variants a GPU run launches and CPU recording once missed: the light backward's
    cuBLAS route (``head_dlogits_light_*``), the d-logits epilogue per dtype / bias / entropy / cap, TF32 variants
    of every fp32 tile kernel (forward, d-logits tiles, atomic backward), and the forward / fold with the extra
    statistics TRL's trainers ask for; as many configs as docs/kernels.md's variant list states."""
    names = {n for a, n in expected_names() if a == 90}
    # docs/kernels.md, "The variant list": 281 configs per architecture
    assert len(names) == len({n for a, n in expected_names() if a == 80}) == 281
    for must in ("distill_row_jsd_fp32/distill_row_kernel", "distill_row_revkl_bf16_nograd/distill_row_kernel",
                 "distill_tile_fwd_jsd_bf16_softcap/distill_jsd_kernel", "distill_tile_bwd_fwdkl_fp16/distill_grad_kernel",
                 "distill_tile_fwd_fwdkl_bf16/distill_fold_kernel"):
        assert must in names, must
    for must in ("linear_fwd_bf16_bias_top1/linear_fwd_partial_kernel",
                 "linear_fwd_bf16_bias_mean/linear_fwd_merge_kernel",
                 "linear_fwd_bf16_bias_mean_top1/linear_fwd_partial_kernel",
                 "linear_fwd_fp16_bias_extras/linear_fwd_partial_kernel",
                 "linear_fwd_fp32_bias_extras_tf32/linear_fwd_partial_kernel", "head_fold_bias_top1/head_fold_kernel",
                 "head_fold_bias_mean/head_fold_kernel", "head_fold_bias_mean_top1/head_fold_kernel",
                 "head_fold_nobias_extras/head_fold_kernel", "head_fold_bias_softcap_extras/head_fold_kernel"):
        assert must in names, must
    for must in ("head_dlogits_light_bf16_bias_ent/head_dlogits_kernel",
                 "head_dlogits_light_fp16_nobias_noent_softcap/head_dlogits_kernel",
                 "head_dlogits_bf16_nobias_ent", "head_dlogits_fp16_nobias_noent", "head_dlogits_fp16_bias_ent_softcap",
                 "head_dlogits_fp32_nobias_noent_softcap", "linear_fwd_fp32_bias_tf32/linear_fwd_partial_kernel",
                 "linear_dlogits_fp32_bias_ent_tf32/linear_dlogits_kernel", "linear_bwd_atomic_fp32_bias_ent_hwb_tf32",
                 "linear_bwd_atomic_fp32_nobias_noent_w_tf32", "linear_bwd_atomic_fp32_bias_ent_hwb_softcap_tf32"):
        assert must in names, must
    # TF32 changes only fp32 tile kernels: no row sweep, no half-precision kernel gets a _tf32 twin
    assert all(n.startswith("linear_") and "_fp32_" in n for n in names if "_tf32" in n)


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
    assert any(r.name.startswith("distill_row_jsd_bf16") for r in reports)
    check(reports)
    check_vector_widths(reports)
    check_distill_vectors(reports)
    check_sweep_budget(reports)


@pytest.mark.slow
def test_aot_every_config():
    reports = aot.report_module(MODULES, ARCHS)
    assert {(r.arch, r.name) for r in reports} == expected_names()
    check(reports)
    check_distill_vectors(reports)
