"""The package's functions stay small (docs/DESIGN.md section 4, "One body per path"): no internal function of
grpo_kernels/ takes more than 12 parameters or spans more than 80 lines. Exempt: the public functions (the names
in ``grpo_kernels.__all__``), ``@triton.jit`` kernels (a kernel takes its pointers, strides and flags one by one),
and the Liger drop-in's signatures (``PEER_SIGNATURES``). The validators are not exempt: they take the inputs and
config objects (``inputs.LossArguments``, ``GRPOLossConfig``), not the public signatures' arguments one by one."""
from __future__ import annotations

import ast
from pathlib import Path

import grpo_kernels

MAX_PARAMS = 12
MAX_LINES = 80
PACKAGE = Path(grpo_kernels.__file__).parent


def _params(fn: ast.FunctionDef) -> int:
    a = fn.args
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    n = len(names) + (a.vararg is not None) + (a.kwarg is not None)
    return n - (1 if names and names[0] in ("self", "cls", "ctx") else 0)


# grpo_kernels/liger.py and liger_jsd.py reproduce Liger-Kernel's signatures argument for argument: they are not ours
# to shrink
PEER_SIGNATURES = {"liger.py": ("__init__", "forward", "triton_grpo_loss"),
                   "liger_jsd.py": ("__init__", "forward", "liger_fused_linear_jsd", "chunked_liger_fused_linear_jsd")}


def _exempt(fn: ast.FunctionDef, path: Path | None = None) -> bool:
    jit = any("jit" in ast.unparse(d) for d in fn.decorator_list)
    peer = path is not None and fn.name in PEER_SIGNATURES.get(path.name, ())
    return jit or peer or fn.name in grpo_kernels.__all__


def oversized() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not _exempt(node, path):
                lines = node.end_lineno - node.lineno + 1
                if _params(node) > MAX_PARAMS or lines > MAX_LINES:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}: "
                                 f"{_params(node)} parameters, {lines} lines")
    return found


def test_no_internal_function_is_oversized():
    assert oversized() == []


def test_the_check_sees_an_oversized_function(tmp_path):
    """The check can fail: a 13-parameter function and an 81-line one are both reported."""
    wide = "def wide(" + ", ".join(f"a{i}" for i in range(13)) + "):\n    return a0\n"
    long = "def long():\n" + "    x = 1\n" * 80
    tree = ast.parse(wide + long)
    fns = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    assert _params(fns[0]) == 13 and not _exempt(fns[0])
    assert fns[1].end_lineno - fns[1].lineno + 1 == 81
