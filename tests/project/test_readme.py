"""README.md is a short user guide whose examples, commands and links hold (documentation that cannot rot)."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_README_LINES = 300
# The user-guide documents README links to, some of which are written in parallel work: while one is missing, its
# link check skips saying so; once the file exists it is checked like any other. A link to any other missing file
# fails.
REQUIRED_DOCS = ["install", "training", "training-cli", "training-runs", "api", "kernels", "memory", "distributed",
                 "numerics", "benchmarks", "contributing", "DESIGN"]
# The documents this guide moved README's reference sections into; their own links are checked too.
MOVED_DOCS = sorted(p.relative_to(Path(__file__).resolve().parents[2]).as_posix()
                    for p in (Path(__file__).resolve().parents[2] / "docs").glob("*.md"))


def _section(text: str, heading: str) -> str:
    start = text.index(heading)
    end = text.find("\n## ", start + len(heading))
    return text[start:] if end < 0 else text[start:end]


def _blocks(text: str, lang: str) -> list[str]:
    """The fenced code blocks of ``text`` whose info string is ``lang`` ("" for a plain fence), in order."""
    blocks, current, info = [], None, None
    for line in text.splitlines():
        if line.startswith("```"):
            if current is None:
                current, info = [], line[3:].strip()
                continue
            if info == lang:
                blocks.append("\n".join(current) + "\n")
            current = None
        elif current is not None:
            current.append(line)
    return blocks


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercase, punctuation other than '-' and '_' dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_anchor(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}


def _local_links(path: Path) -> list[tuple[str, str]]:
    """(target relative to the repository root, anchor or '') of every relative Markdown link in ``path``."""
    out = []
    for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path.resolve()
        out.append((resolved.relative_to(ROOT).as_posix(), anchor))
    return out


def _check_link(source: Path, target: str, anchor: str) -> None:
    if not (ROOT / target).exists():
        pytest.fail(f"{source.relative_to(ROOT)} links to {target}, which does not exist")
    if anchor and target.endswith(".md"):
        assert anchor in _anchors(ROOT / target), f"{source.relative_to(ROOT)}: no heading for #{anchor} in {target}"


def test_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into docs/ (limit {MAX_README_LINES})"


def test_readme_links_every_user_doc():
    links = {target for target, _ in _local_links(README)}
    missing = [name for name in REQUIRED_DOCS if f"docs/{name}.md" not in links]
    assert not missing, f"README.md does not link docs/ {missing}"


@pytest.mark.parametrize("link", sorted(set(_local_links(README))), ids=lambda l: "#".join(filter(None, l)))
def test_readme_links_exist(link):
    _check_link(README, *link)


@pytest.mark.parametrize("doc", MOVED_DOCS)
def test_moved_docs_links_exist(doc):
    source = ROOT / doc
    for target, anchor in sorted(set(_local_links(source))):
        _check_link(source, target, anchor)


def test_test_command_is_what_ci_runs():
    # .ci/run holds README's command in README_TEST_COMMAND='...' and runs it as one bash process (test_ci_run.py)
    ci = [line.strip().split("=", 1)[1].strip("'") for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip().startswith("README_TEST_COMMAND=")]
    assert len(ci) == 1, f".ci/run should define README_TEST_COMMAND once, found {ci}"
    commands = _blocks(_section(README.read_text(), "## Install and the two commands"), "bash")[0]
    lines = [line.strip() for line in commands.splitlines() if line.strip() and not line.startswith("#")]
    assert lines == ["bash scripts/setup.sh && .venv/bin/python -m grpo.train", ci[0]], lines
    assert (ROOT / "scripts" / "setup.sh").exists()
    assert 'if __name__ == "__main__":' in (ROOT / "grpo" / "train.py").read_text()


def test_example_commands_exist_and_every_example_is_shown():
    text = README.read_text()
    trl = _blocks(_section(text, "## Use with TRL"), "bash")[0].split("#")[0].strip()
    assert trl == ".venv/bin/python examples/trl_grpo.py", trl
    shown = set(re.findall(r"examples/(\w+\.py)", text))
    on_disk = {p.name for p in (ROOT / "examples").glob("*.py")}
    assert shown == on_disk, f"README shows {sorted(shown)}, examples/ holds {sorted(on_disk)}"


def test_api_example_runs():
    section = _section(README.read_text(), "## API")
    exec(compile(_blocks(section, "python")[0], "README.md:API", "exec"), {})


def test_explain_output_is_what_explain_prints():
    """README's explain() example, run after the API example's imports, prints the block shown under it (the
    fp32-output GEMM line, which depends on the machine, is left out of README)."""
    section = _section(README.read_text(), "## API")
    code = _blocks(section, "python")[1]
    shown = _blocks(section, "")[0].rstrip("\n")
    printed = []
    exec(compile("import torch\nimport grpo_kernels as gk\n" + code, "README.md:explain", "exec"),
         {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    lines = [line for line in "\n".join(printed).splitlines() if "fp32-output GEMM" not in line]
    assert "\n".join(lines) == shown
    # the sentence after it: the same call under a 512 MiB budget
    assert "With `memory_budget=512 << 20` the same call takes the memory-light recompute path (`head.light`, 8NHV,\n" \
           "510 MiB)" in section
    printed.clear()
    exec(compile("import torch\nimport grpo_kernels as gk\n" + code.replace("adv))", "adv, memory_budget=512 << 20))"),
                 "README.md:explain", "exec"), {"print": lambda *a: printed.append(" ".join(map(str, a)))})
    assert "path head.light" in printed[0] and "matmul FLOPs: 8 N H V" in printed[0], printed[0]
    # (510.25: the d-logits chunk counts 4 bytes an element on bf16, what a CUDA run's cuBLAS route allocates)
    assert "transient memory: 510.25 MiB of a 512.00 MiB budget" in printed[0], printed[0]


def test_benchmark_commands_are_the_documented_ones():
    """README's benchmark commands are docs/benchmarks.md's, which tests/project/test_bench_commands.py runs
    verbatim."""
    block = _blocks(_section(README.read_text(), "## Benchmarks"), "bash")[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]
    documented = _blocks((ROOT / "docs" / "benchmarks.md").read_text(), "bash")[0].splitlines()
    assert commands and all(c in documented for c in commands), (commands, documented)
