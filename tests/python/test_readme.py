"""The README's Python examples run as written and print what the README says they print.

Convention: in a ```python block of the README, every ``print(...)`` ends its line with a comment
holding a Python string literal, the exact line that call prints (``print(x)  # " Paris."``;
escapes such as ``\\n`` are allowed). The block is run with stdout captured, and the capture must
equal those lines, in order. A print without such a comment fails the test, so no example shows
output the test does not check.
"""

from __future__ import annotations

import ast
import contextlib
import io
import re
import tokenize
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks() -> list[tuple[int, str]]:
    """Each ```python block of the README with the README line its code starts on."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1)) for m in BLOCK.finditer(text)]


def expected_output(code: str, first_line: int) -> str:
    """What the block must print: the string literal commented on each print call's last line."""
    comments = {
        tok.start[0]: tok.string[1:].strip()
        for tok in tokenize.generate_tokens(io.StringIO(code).readline)
        if tok.type == tokenize.COMMENT
    }
    calls = [
        node
        for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]
    lines = []
    for call in sorted(calls, key=lambda c: c.lineno):
        line = call.end_lineno or call.lineno
        where = f"README.md line {first_line + line - 1}"
        comment = comments.get(line)
        assert comment is not None, f"{where}: a print without the line it prints as a comment"
        try:
            printed = ast.literal_eval(comment)
        except (ValueError, SyntaxError):
            printed = None
        assert isinstance(printed, str), f"{where}: the comment must be a string literal, got {comment!r}"
        lines.append(printed + "\n")
    return "".join(lines)


BLOCKS = python_blocks()


def test_the_readme_shows_the_python_api() -> None:
    assert len(BLOCKS) >= 2, "the README shows the Engine and the core from Python"


@pytest.mark.parametrize(("first_line", "code"), BLOCKS, ids=[f"line{n}" for n, _ in BLOCKS])
def test_readme_example_prints_what_the_readme_says(first_line: int, code: str) -> None:
    expected = expected_output(code, first_line)
    # padded so that a traceback names the README's own line numbers
    compiled = compile("\n" * (first_line - 1) + code, str(README), "exec")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        exec(compiled, {"__name__": "readme"})
    assert captured.getvalue() == expected
