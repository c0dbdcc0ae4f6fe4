"""Run the Python examples of the documentation.

Every fenced code block tagged ``python`` in the pages below is executed. The blocks
of one page run in order, in one namespace, inside a temporary working directory, so
checkpoints written by the examples land there. A block tagged ``python-skip`` or
containing ``# doctest: skip`` is not run.
"""

from __future__ import annotations

import re
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parent.parent / "docs"
PAGES = ["guide.md", "api.md", "format.md", "async.md"]
SKIP_MARK = "# doctest: skip"

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first code line
    info: str  # the first word of the fence's info string
    source: str


def code_blocks(text: str) -> list[Block]:
    """Every fenced code block of a Markdown text, with its language tag."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        info = m["info"].strip().split(" ")[0] if m["info"].strip() else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines):
            close = _FENCE.match(lines[j])
            if (
                close is not None
                and close["fence"][0] == fence[0]
                and len(close["fence"]) >= len(fence)
                and not close["info"].strip()
            ):
                break
            line = lines[j]
            body.append(line[len(indent) :] if line.startswith(indent) else line.lstrip())
            j += 1
        else:
            raise AssertionError(f"unclosed code fence at line {i + 1}")
        blocks.append(Block(i + 2, info, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.info == "python" and SKIP_MARK not in b.source]


def test_fence_parser() -> None:
    text = "\n".join(
        [
            "intro",
            "```python",
            "x = 1",
            "```",
            "```",
            "not python",
            "```",
            "```python-skip",
            "raise RuntimeError",
            "```",
            "```python",
            "raise RuntimeError  # doctest: skip",
            "```",
            "1. item",
            "",
            "   ```python",
            "   y = x + 1",
            "   ```",
        ]
    )
    blocks = code_blocks(text)
    assert [b.info for b in blocks] == ["python", "", "python-skip", "python", "python"]
    assert [b.source for b in runnable(blocks)] == ["x = 1\n", "y = x + 1\n"]
    assert runnable(blocks)[0].line == 3


@pytest.mark.parametrize("page", PAGES)
def test_examples_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = DOCS / page
    assert path.is_file(), f"{path} is missing"
    blocks = runnable(code_blocks(path.read_text(encoding="utf-8")))
    assert blocks, f"{page} has no runnable python examples"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for block in blocks:
        # Pad with blank lines so tracebacks show the line number in the Markdown file.
        code = compile("\n" * (block.line - 1) + block.source, str(path), "exec")
        try:
            exec(code, namespace)
        except Exception:
            pytest.fail(
                f"{page}: the example at line {block.line} raised:\n{traceback.format_exc()}",
                pytrace=False,
            )
