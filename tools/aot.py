"""Ahead-of-time compilation of Triton kernels for a GPU that is not there (docs/DESIGN.md section 6).

``triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", arch, 32))`` builds a real cubin on a
machine without a GPU; the ``cuobjdump`` shipped in Triton's wheel then reports registers, stack/local bytes and
static shared memory, and its SASS shows whether the dots lowered to Hopper's HGMMA or to HMMA, and the width
of the global loads / stores (``LDG.E.128`` 16-byte vectors vs ``LDG.E.U16`` 2-byte scalars). Spills are read
from ``ptxas -v`` ("bytes spill stores/loads"), captured while Triton assembles the kernel (or by re-running the
same ptxas on the PTX when the kernel came from Triton's cache). Shared memory is Triton's dynamic allocation
(``metadata.shared``) plus the cubin's static part.

Where the configs come from: every kernel module of ``grpo_kernels.kernels`` has ``aot_launches()``, a list of
``(name, thunk)`` scenarios that call the module's real launchers on small CPU tensors of the GPU shape class.
``module_configs`` runs each thunk under ``grpo_kernels.kernels.launch.recording(arch, tf32)``, once with torch's
fp32 matmul precision at "highest" (IEEE) and once at "high" (TF32; configs only that run launches are named
``..._tf32``): nothing runs, routes are decided as on a CUDA device (``launch.as_cuda``), every
``launch(kernel, grid, *args, **kwargs)`` is recorded, and ``signature_of`` derives the signature from the actual
arguments with Triton's own specialization rule (the JIT's ``specialize_impl``: pointer dtypes, i32/i64, ints
divisible by 16 or equal to 1, 16-byte aligned pointers, ``do_not_specialize``). So no signature is written by
hand, and a changed kernel argument list cannot drift from what is compiled here.

A config is ``(name, kernel, signature, constexprs)``: ``signature`` maps argument names to Triton types
(``"*bf16"``, ``"i32"``, ``"fp32"``), a ``":16"`` suffix marking a value specialized as divisible by 16 (or a
16-byte aligned pointer); ``constexprs`` maps constexpr arguments to values and carries the launch options
``num_warps``, ``num_stages``, ``num_ctas``, ``maxnreg`` (names Triton reserves, so they never clash).

Instructions per element: for a row-sweep kernel (constexpr ``BLOCK_V`` or ``BLOCK``, no ``BLOCK_M``) the report
counts the SASS instructions of each innermost loop that loads from global memory (a backward branch's target to
the branch; NOPs excluded) and divides by the elements one iteration covers per thread,
``BLOCK / (32 num_warps)``: at one instruction per cycle per scheduler this is the issue time of a sweep, to hold
against the memory floor (docs/kernels.md, "Reading the AOT report").

Kernels created while ``TRITON_INTERPRET=1`` are interpreter objects, not JITFunctions, and their helper calls
resolve to interpreter objects too; ``report_module`` therefore compiles in a child process with
``TRITON_INTERPRET=0`` (``python -m tools.aot --module MOD --arch 90``), which works from any
process, the interpreted test session included. ``compile_config`` compiles in-process.

Which Triton compiles: the child's. ``GRPO_AOT_PYTHON`` names its interpreter (default: this one), e.g.
``.venv-triton36/bin/python`` (scripts/setup_aot36.sh: the GPU image's Triton 3.6 beside CI's 3.9); each report
carries the compiling Triton's version. Only APIs both versions have are used here.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")
# Largest dynamic shared memory per block (bytes): H100/H200 (sm_90) and A100 (sm_80).
MAX_SHARED = {90: 232448, 80: 166912}
# SASS instructions per element and sweep loop of the bf16 row sweeps on sm_90 (docs/kernels.md, "Budgets"; held by
# tests/kernels/test_aot.py, and the figure README.md and docs/kernels.md state by tests/project/test_docs_figures.py).
SWEEP_BUDGET = 14


@dataclass
class KernelReport:
    """Resources of one compiled kernel on one architecture."""

    name: str
    arch: int
    registers: int
    stack_bytes: int
    local_bytes: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    num_warps: int
    num_stages: int
    hgmma: bool
    hmma: bool
    ldg128: int = 0  # SASS global loads / stores by width: 16-byte vectors and 2-byte scalars (bf16 / fp16)
    stg128: int = 0
    ldg16: int = 0
    stg16: int = 0
    loop_instructions: list = dataclasses.field(default_factory=list)  # SASS per sweep loop body, in code order
    loop_elements: int = 0  # elements per thread one iteration covers (0: not a row sweep)
    error: str = ""
    triton: str = ""  # the version of the Triton that compiled it

    @property
    def per_element(self) -> list:
        """SASS instructions per element of each sweep loop (empty for kernels that are not row sweeps)."""
        if not self.loop_elements:
            return []
        return [round(n / self.loop_elements, 2) for n in self.loop_instructions]

    @property
    def spills(self) -> bool:
        """ptxas reported spill stores/loads, or the cubin uses local memory."""
        return self.spill_stores > 0 or self.spill_loads > 0 or self.local_bytes > 0

    def line(self) -> str:
        if self.error:
            return f"sm_{self.arch} {self.name}: ERROR {self.error.splitlines()[-1] if self.error else ''}"
        mma = "HGMMA" if self.hgmma else ("HMMA" if self.hmma else "no-MMA")
        return (f"sm_{self.arch} {self.name}: regs={self.registers} spill={self.spill_stores}/{self.spill_loads} "
                f"stack={self.stack_bytes} local={self.local_bytes} smem={self.shared_bytes} warps={self.num_warps} "
                f"stages={self.num_stages} {mma} LDG.128={self.ldg128} STG.128={self.stg128} "
                f"LDG.U16={self.ldg16} STG.U16={self.stg16}"
                + (f" instr/elem={self.per_element}" if self.per_element else ""))


def _triton():
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    return triton, GPUTarget, ASTSource


def tool_path(name: str) -> str:
    """Path of a CUDA binary shipped in Triton's wheel (cuobjdump, nvdisasm, ptxas)."""
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def _as_jit(fn):
    """A JITFunction for ``fn`` (a JITFunction, a plain python function or an interpreter function).

    Building one from an interpreter function works only when the kernel calls no other @triton.jit helper;
    use ``report_module`` (child process without the interpreter) otherwise.
    """
    from triton.runtime.jit import JITFunction
    if isinstance(fn, JITFunction):
        return fn
    return JITFunction(getattr(fn, "fn", fn))


def compile_config(fn, signature: dict, constexprs: dict, arch: int = 90):
    """Compile one config for ``sm_<arch>``; returns (CompiledKernel, num_warps, num_stages, ptxas log or "")."""
    triton, GPUTarget, ASTSource = _triton()
    from triton import knobs
    jit_fn = _as_jit(fn)
    constexprs = dict(constexprs)
    options = {k: constexprs.pop(k) for k in LAUNCH_OPTIONS if k in constexprs}
    options.setdefault("num_warps", 4)
    options.setdefault("num_stages", 3)
    sig, attrs = {}, {}
    for i, arg in enumerate(jit_fn.arg_names):
        if arg in constexprs:
            sig[arg] = "constexpr"
            continue
        if arg not in signature:
            raise KeyError(f"{jit_fn.__name__}: argument {arg!r} is in neither signature nor constexprs")
        ty, _, hint = signature[arg].partition(":")
        sig[arg] = ty
        if hint == "16":
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(jit_fn, sig, constexprs, attrs)
    log = io.StringIO()
    # Why capture stdout: with dump_ptxas_log Triton prints the `ptxas -v` report (spills) of a fresh compile.
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return kernel, options["num_warps"], options["num_stages"], log.getvalue()


def ptxas_spills(ptx: str, arch: int, log: str = "") -> tuple[int, int]:
    """(spill store bytes, spill load bytes) of a kernel, from a ptxas -v log or by assembling ``ptx`` again."""
    found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if not found:
        from triton.backends.nvidia.compiler import get_ptxas
        target = re.search(r"^\.target\s+(\w+)", ptx, re.MULTILINE).group(1)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "kernel.ptx")
            with open(path, "w") as f:
                f.write(ptx)
            out = subprocess.run([get_ptxas(arch).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={target}", path,
                                  "-o", os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
        found = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out.stdout + out.stderr)
    if not found:
        raise RuntimeError(f"no spill report in the ptxas -v output:\n{log}")
    return max(int(a) for a, _ in found), max(int(b) for _, b in found)


def inspect_cubin(cubin: bytes) -> dict:
    """registers, stack/local/static shared bytes and HGMMA/HMMA presence of a cubin, via cuobjdump."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool_path("cuobjdump"), "--dump-resource-usage", path], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([tool_path("cuobjdump"), "--dump-sass", path], check=True,
                              capture_output=True, text=True).stdout

    def field(key: str) -> int:
        m = re.search(rf"\b{key}:(\d+)", usage)
        if m is None:
            raise RuntimeError(f"cuobjdump printed no {key}: field:\n{usage}")
        return int(m.group(1))

    return {"registers": field("REG"), "stack_bytes": field("STACK"), "local_bytes": field("LOCAL"),
            "static_shared": field("SHARED"), "hgmma": "HGMMA" in sass,
            "hmma": re.search(r"\bHMMA\b", sass) is not None, **vector_widths(sass),
            "loop_instructions": sweep_loops(sass), "sass": sass}


_SASS_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def sweep_loops(sass: str) -> list:
    """SASS instruction counts of the innermost loops that load from global memory, in code order.

    A loop is a backward branch (``BRA`` to an address at or before itself) and the instructions from its target
    to it; innermost: containing no other loop. NOPs (alignment padding) are not counted."""
    ins = [(int(addr, 16), op, rest) for addr, op, rest in _SASS_LINE.findall(sass)]
    loops = set()
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) <= addr:
            loops.add((int(target.group(1), 16), addr))
    inner = [lp for lp in loops if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in loops)]
    counts = []
    for lo, hi in sorted(inner):
        body = [op for addr, op, _ in ins if lo <= addr <= hi and op != "NOP"]
        if any(op.startswith("LDG") for op in body):
            counts.append(len(body))
    return counts


def loop_elements(constexprs: dict) -> int:
    """Elements per thread one iteration of a row sweep covers (``BLOCK_V`` or ``BLOCK`` over the threads), 0 for
    kernels that are not row sweeps (tiled kernels have a ``BLOCK_M``)."""
    block = constexprs.get("BLOCK_V", constexprs.get("BLOCK"))
    if not isinstance(block, int) or "BLOCK_M" in constexprs:
        return 0
    return max(1, block // (32 * constexprs.get("num_warps", 4)))


def vector_widths(sass: str) -> dict:
    """Counts of global loads / stores by width in a SASS listing: ``LDG.E.128`` (16-byte vectors, with any cache
    or eviction modifiers) and ``LDG.E.U16`` (2-byte scalars), likewise ``STG``. A kernel that streams bf16 rows
    with the latter issues 8x the memory instructions (DESIGN.md section 4)."""
    def count(op: str, width: str) -> int:
        return len(re.findall(rf"\b{op}\.E(?:\.[A-Z0-9_]+)*?\.{width}\b", sass))
    return {"ldg128": count("LDG", "128"), "stg128": count("STG", "128"), "ldg16": count("LDG", "U16"),
            "stg16": count("STG", "U16")}


def report(name: str, fn, signature: dict, constexprs: dict, arch: int = 90) -> KernelReport:
    """Compile one config and read its resources (in this process).

    The resource summary is cached next to the kernel in Triton's cache, so a rerun of unchanged kernels costs
    neither ptxas nor cuobjdump.
    """
    from triton.runtime.cache import get_cache_manager
    kernel, warps, stages, log = compile_config(fn, signature, constexprs, arch)
    cache = get_cache_manager(kernel.hash)
    cached = cache.get_file(_REPORT_FILE)
    if cached is not None:
        with open(cached) as f:
            info = json.load(f)
    else:
        info = inspect_cubin(kernel.asm["cubin"])
        info.pop("sass")
        info["spill_stores"], info["spill_loads"] = ptxas_spills(kernel.asm["ptx"], arch, log)
        cache.put(json.dumps(info), _REPORT_FILE, binary=False)
    return KernelReport(name=name, arch=arch, registers=info["registers"], stack_bytes=info["stack_bytes"],
                        local_bytes=info["local_bytes"], spill_stores=info["spill_stores"],
                        spill_loads=info["spill_loads"], shared_bytes=kernel.metadata.shared + info["static_shared"],
                        num_warps=warps, num_stages=stages, hgmma=info["hgmma"], hmma=info["hmma"],
                        ldg128=info["ldg128"], stg128=info["stg128"], ldg16=info["ldg16"], stg16=info["stg16"],
                        loop_instructions=info["loop_instructions"], loop_elements=loop_elements(constexprs),
                        triton=_triton()[0].__version__)


_REPORT_FILE = "grpo_aot_report_v3.json"  # v3: with the sweep-loop instruction counts


def signature_of(kernel, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """(signature, constexprs) of one launch ``kernel[grid](*args, **kwargs)``, as the JIT would specialize it."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    jit_fn = _as_jit(kernel)
    options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
    bound = inspect.signature(jit_fn.fn).bind(*args, **{k: v for k, v in kwargs.items() if k not in options})
    bound.apply_defaults()
    signature, constexprs = {}, dict(options)
    for param in jit_fn.params:
        value = bound.arguments[param.name]
        if param.is_constexpr:
            constexprs[param.name] = value
            continue
        ty, key = native_specialize_impl(BaseBackend, value, False, not param.do_not_specialize,
                                         not param.do_not_specialize_on_alignment)
        if ty == "constexpr":  # an int equal to 1 (or None): the JIT compiles it in as a constant
            constexprs[param.name] = key
        else:
            signature[param.name] = ty + (":16" if key == "D" else "")
    return signature, constexprs


def module_configs(module: str, arch: int):
    """Every distinct kernel config ``module.aot_launches()`` launches for ``sm_<arch>`` (see the module docstring).

    Each scenario is recorded as a CUDA run would launch it (``launch.recording``: GPU routes, compiled tiles), twice:
    under torch's default fp32 matmul precision ("highest", IEEE fp32) and under "high" (TF32). A scenario that
    launches one kernel names its config; one that launches several (a forward and its merge) names them
    ``scenario/kernel``; configs that only the TF32 run launches get ``_tf32`` after the scenario's name. Identical
    configs reached from several scenarios (or both precisions) are listed once."""
    from grpo_kernels.kernels.launch import recording

    configs, seen = [], set()
    scenarios = importlib.import_module(module).aot_launches()
    for tf32 in (False, True):
        for name, thunk in scenarios:
            with recording(arch, tf32=tf32) as records:
                thunk()
            if not records:
                raise RuntimeError(f"{module}: AOT scenario {name!r} launched no kernel")
            scenario = f"{name}_tf32" if tf32 else name
            for rec in records:
                sig, consts = signature_of(rec.kernel, rec.args, rec.kwargs)
                key = (_as_jit(rec.kernel).fn, tuple(sorted(sig.items())), repr(sorted(consts.items())))
                if key in seen:
                    continue
                seen.add(key)
                label = scenario if len(records) == 1 else f"{scenario}/{_as_jit(rec.kernel).__name__}"
                configs.append((label, rec.kernel, sig, consts))
    return configs


_CONFIGS: dict = {}  # (module, arch) -> module_configs(module, arch), per worker process


def _one_thread() -> None:
    """One torch thread in the AOT processes: the scenarios' CPU ops are tiny, and with several threads on a busy
    machine each took ~20 ms (recording the linear modules: 25 s instead of 2 s)."""
    import torch
    torch.set_num_threads(1)


def _report_job(job) -> KernelReport:
    """Worker: compile config ``name`` of ``module`` for ``arch``; a compile error is a result, not a crash.

    Why the per-process cache: recording a module's scenarios takes seconds (the light backward's CPU GEMMs), and a
    worker compiles many configs of one module."""
    module, arch, name = job
    const = {}
    _one_thread()
    try:
        if (module, arch) not in _CONFIGS:
            _CONFIGS[(module, arch)] = module_configs(module, arch)
        _, fn, sig, const = next(c for c in _CONFIGS[(module, arch)] if c[0] == name)
        return report(name, fn, sig, const, arch)
    except Exception as exc:
        return KernelReport(name, arch, 0, 0, 0, 0, 0, 0, const.get("num_warps", 4), const.get("num_stages", 3),
                            False, False, error=f"{type(exc).__name__}: {exc}", triton=_triton()[0].__version__)


def child_python() -> str:
    """The interpreter whose Triton compiles in ``report_module``'s child process: ``$GRPO_AOT_PYTHON`` when set
    (e.g. ``.venv-triton36/bin/python``, the GPU image's Triton 3.6: scripts/setup_aot36.sh), else this one."""
    return os.environ.get("GRPO_AOT_PYTHON") or sys.executable


def child_env() -> dict:
    """The child process' environment: no interpreter, and this checkout importable (tests run from a checkout; the
    Triton 3.6 environment does not install the package)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated to silence its warning
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def kernel_modules() -> list[str]:
    """Every kernel module of grpo_kernels.kernels (those ending in ``_kernels``; they must have ``aot_launches``).

    Found by name, not imported here: importing one creates its kernels, which must happen in the process that
    compiles them (a test session runs under the interpreter)."""
    import pkgutil

    import grpo_kernels.kernels as pkg
    return [f"{pkg.__name__}.{info.name}" for info in pkgutil.iter_modules(pkg.__path__)
            if info.name.endswith("_kernels")]


def declared_configs(modules=None, archs=(90, 80)) -> list[tuple[int, str, str]]:
    """(arch, module, config name) of every config ``module_configs`` lists for ``modules`` (default: every kernel
    module), recorded in a child process as ``report_module`` compiles them (names only, nothing compiled)."""
    code = ("import sys, torch; from tools.aot import module_configs\n"
            "torch.set_num_threads(1)\n"
            "archs = [int(a) for a in sys.argv[1].split(',')]\n"
            "for m in sys.argv[2:]:\n"
            "    for a in archs:\n"
            "        for c in module_configs(m, a):\n"
            "            print(a, m, c[0])\n")
    out = subprocess.run([child_python(), "-c", code, ",".join(map(str, archs)), *(modules or kernel_modules())],
                         env=child_env(), capture_output=True, text=True, check=True).stdout.split()
    return [(int(a), m, n) for a, m, n in zip(out[::3], out[1::3], out[2::3])]


def report_module(modules, archs=(90, 80), jobs: int | None = None, only: str = "",
                  timeout: float = 3600.0) -> list[KernelReport]:
    """Compile every config of ``module_configs`` for ``modules`` (a name or a list) for each arch.

    Runs ``python -m tools.aot`` in a child process (``child_python()``, so ``GRPO_AOT_PYTHON`` selects another
    Triton) with ``TRITON_INTERPRET=0``, so it works from an interpreted test session; ``jobs`` worker processes
    compile in parallel (default: the CPU count, at most 8).
    """
    env = child_env()
    cmd = [child_python(), "-m", "tools.aot", "--json", "--only", only]
    for module in [modules] if isinstance(modules, str) else modules:
        cmd += ["--module", module]
    for arch in archs:
        cmd += ["--arch", str(arch)]
    if jobs:
        cmd += ["--jobs", str(jobs)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"AOT child process failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return [KernelReport(**json.loads(line)) for line in out.stdout.splitlines() if line.startswith("{")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--module", action="append", required=True, help="kernel module with aot_launches()")
    parser.add_argument("--arch", action="append", type=int, help="SM version, e.g. 90 or 80 (repeatable)")
    parser.add_argument("--only", default="", help="regex: compile only configs whose name matches")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="parallel compiles")
    parser.add_argument("--json", action="store_true", help="one JSON object per kernel on stdout")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("run with TRITON_INTERPRET=0 (interpreter kernels cannot be compiled)")
    _one_thread()
    jobs = [(module, arch, name) for module in args.module for arch in args.arch or [90, 80]
            for name, *_ in module_configs(module, arch) if not args.only or re.search(args.only, name)]
    failed = False
    with contextlib.ExitStack() as stack:
        if args.jobs > 1:
            import concurrent.futures
            import multiprocessing
            pool = stack.enter_context(concurrent.futures.ProcessPoolExecutor(
                args.jobs, mp_context=multiprocessing.get_context("spawn")))
            results = pool.map(_report_job, jobs)
        else:
            results = map(_report_job, jobs)
        for rep in results:
            failed |= bool(rep.error) or rep.spills
            print(json.dumps(dataclasses.asdict(rep)) if args.json else rep.line(), flush=True)
    return 1 if failed and not args.json else 0


if __name__ == "__main__":
    sys.exit(main())
