"""Every tolerance written in a test says where it comes from (docs/contributing.md, "Pass rules").

A numeric tolerance in a test under tests/ (outside tests/support, which holds the rules themselves) must carry a
``# bound: <derivation>`` comment: on a line of the statement that holds it, or in the block of comment lines right
above that statement. The derivation names the unit roundoff and operation count it comes from, the exactness it
relies on, or why it is not a numerical tolerance at all (a sampling error, a threshold of "clearly different").

What counts as a tolerance literal (found on the syntax tree, so strings and comments never count):
- a keyword argument or parameter default named ``rtol``, ``atol``, ``rel``, ``abs``, ``rel_tol``, ``abs_tol``,
  ``tol`` or ``tolerance`` whose value contains a non-zero number (``rtol=0, atol=0`` is exact equality);
- a numeric argument of a closeness call (``allclose``, ``isclose``, ``assert_close``, ``approx``), and such a call
  with no tolerance argument at all (nor a ``**`` splat that may hold one), which relies on its library's fitted
  default;
- a comparison (``<``, ``<=``, ``>``, ``>=``) in an ``assert`` with a non-integer number below 1 in magnitude on
  either side (``err < 2e-4``, ``diff <= 1e-5 * scale``, ``abs(a - b) > 1e-3``); comparisons elsewhere (building
  a random mask, ``torch.rand(...) < 0.5``) are not tolerances;
- an assignment to a name containing ``tol`` (``PARAM_ATOL = 1e-5``, ``tol = 1e-5 if ... else 2e-2``) whose value
  contains a non-zero number.
Names (``atol=ATOL[dtype]``, ``rtol=bound``) are not literals: the marker goes where their number is written.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
MARKER = "# bound:"
TOLERANCE_KWARGS = {"rtol", "atol", "rel", "abs", "rel_tol", "abs_tol", "tol", "tolerance"}
CLOSE_CALLS = {"allclose", "isclose", "assert_close", "approx"}
TOL_NAME = re.compile("tol", re.IGNORECASE)
INEQUALITIES = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _numbers(node: ast.AST) -> list[float]:
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and type(n.value) in (int, float)]


def _nonzero(node: ast.AST) -> bool:
    return any(v != 0 for v in _numbers(node))


def _small_float(node: ast.AST) -> bool:
    return any(type(v) is float and 0 < abs(v) < 1 for v in _numbers(node))


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _hits(node: ast.AST, in_assert: bool) -> list[tuple[ast.AST, str]]:
    """(node, reason) for each tolerance literal ``node`` itself holds (not its children)."""
    found = []
    if isinstance(node, ast.keyword) and node.arg in TOLERANCE_KWARGS and _nonzero(node.value):
        found.append((node.value, f"{node.arg}={ast.unparse(node.value)}"))
    elif isinstance(node, ast.Call) and _call_name(node) in CLOSE_CALLS:
        if any(_nonzero(a) for a in node.args[2 if _call_name(node) != "approx" else 1:]):
            found.append((node, f"a numeric tolerance argument of {_call_name(node)}"))
        given = any(k.arg in TOLERANCE_KWARGS or k.arg is None for k in node.keywords)  # None: a **splat
        if not given and len(node.args) <= (1 if _call_name(node) == "approx" else 2):
            found.append((node, f"{_call_name(node)} with its library's default tolerance"))
    elif in_assert and isinstance(node, ast.Compare) and any(isinstance(op, INEQUALITIES) for op in node.ops):
        if any(_small_float(side) for side in [node.left, *node.comparators]):
            found.append((node, f"comparison {ast.unparse(node)}"))
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
        if node.value is not None and any(TOL_NAME.search(n) for n in names) and _nonzero(node.value):
            found.append((node, f"{', '.join(names)} = {ast.unparse(node.value)}"))
    elif isinstance(node, ast.arguments):
        params = node.posonlyargs + node.args
        pairs = list(zip(params[len(params) - len(node.defaults):], node.defaults))
        pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
        found += [(d, f"default {a.arg}={ast.unparse(d)}") for a, d in pairs
                  if a.arg in TOLERANCE_KWARGS and _nonzero(d)]
    return found


def _statements(tree: ast.AST) -> dict[int, ast.stmt]:
    """id(node) -> the innermost statement holding it."""
    owner = {}

    def visit(node, stmt):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, ast.stmt) else stmt
            owner[id(child)] = inner
            visit(child, inner)
    visit(tree, None)
    return owner


def _marked(lines: list[str], stmt: ast.stmt, node: ast.AST) -> bool:
    """A marker on a line of the statement (of a compound one: its header up to the literal), or in the comment
    block right above it."""
    compound = hasattr(stmt, "body")  # for / if / with / def: only the header up to the literal
    first = stmt.lineno
    last = (getattr(node, "end_lineno", None) or stmt.end_lineno) if compound else stmt.end_lineno
    if any(MARKER in line for line in lines[first - 1:last]):
        return True
    i = first - 2
    while i >= 0 and lines[i].lstrip().startswith("#"):
        if lines[i].lstrip().startswith(MARKER):
            return True
        i -= 1
    return False


def unmarked(source: str, name: str = "<snippet>") -> list[str]:
    """``name:line: reason`` for each tolerance literal in ``source`` without a ``# bound:`` marker."""
    tree = ast.parse(source)
    lines = source.splitlines()
    owner = _statements(tree)
    found = []
    for node in ast.walk(tree):
        stmt = node if isinstance(node, ast.stmt) else owner.get(id(node))
        for lit, reason in _hits(node, isinstance(stmt, ast.Assert)):
            if stmt is not None and not _marked(lines, stmt, lit):
                found.append(f"{name}:{getattr(lit, 'lineno', stmt.lineno)}: {reason}")
    return sorted(set(found), key=lambda s: (s.split(":")[0], int(s.split(":")[1])))


def test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "support" not in p.relative_to(TESTS).parts)


test_files.__test__ = False  # a helper, not a test


def test_every_tolerance_literal_carries_its_derivation():
    found = [hit for path in test_files() for hit in unmarked(path.read_text(), str(path.relative_to(TESTS.parent)))]
    assert found == [], ("tolerance literals without a '# bound: <derivation>' comment (docs/contributing.md, "
                         "\"Pass rules\"):\n" + "\n".join(found))


def test_the_scan_finds_an_unexplained_tolerance():
    """The check can fail: each kind of literal is reported without a marker and accepted with one."""
    bare = ("torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)\n"
            "assert (x - y).abs().max() < 2e-4\n"
            "assert abs(a - b) <= 1e-5 * max(abs(b), 1.0)\n"
            "PARAM_ATOL = 1e-5\n"
            "assert torch.allclose(a, b)\n"
            "assert x == pytest.approx(y, rel=1e-5)\n"
            "def close(a, b, tol=1e-3):\n    return a\n")
    assert sorted({int(h.split(":")[1]) for h in unmarked(bare)}) == [1, 2, 3, 4, 5, 6, 7]
    marked = ("torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # bound: n u, n = 40\n"
              "# bound: 2 gamma(8) of fp32\n"
              "#   (a second comment line)\n"
              "assert (x - y).abs().max() < 2e-4\n"
              "assert torch.allclose(\n    a, b)  # bound: default rtol of 1e-5 is gamma(100) of fp32\n")
    assert unmarked(marked) == []
    exact = ("torch.testing.assert_close(a, b, rtol=0, atol=0)\n"
             "assert_three_way(o, n, t, dtype, 'loss', scale=grad_scale(t))\n"
             "torch.testing.assert_close(a, b, rtol=bound, atol=ATOL[dtype])\n"
             "assert n < 3 and x > 2.5\n"
             "mask = torch.rand(4, 5) < 0.5\n")
    assert unmarked(exact) == []
    # a marker two statements up does not count
    assert len(unmarked("# bound: for the next line only\nx = 1\nassert e < 1e-6\n")) == 1
