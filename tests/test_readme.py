"""README's API example runs as written (documentation that cannot rot)."""
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_api_example_runs():
    text = README.read_text()
    section = text[text.index("## API"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md:API", "exec"), {})
