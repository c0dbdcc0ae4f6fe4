"""Run the Python examples of the documentation.

Every fenced code block tagged ``python`` in README.md and in every page of docs/
is executed, with warnings as errors (an example that warns teaches the warning;
only what a dependency warns about its own internals is let through).
The blocks of one page run in order, in one namespace, inside a temporary working
directory, so checkpoints written by the examples land there.

A block that cannot run here says why, in the block: ``# doctest: skip (reason)``.
A skip without a reason, or a ``python-skip`` fence, fails the test.

A page whose examples need an optional package says so with
``<!-- doctest: requires=transformers -->`` (comma-separated modules): without
them its examples are skipped, with the reason.

A page whose examples need several processes says so with the comment
``<!-- doctest: ranks=N -->``: its blocks then run in ``N`` processes at once, each
with the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` …), all
in the same working directory. This file is also the runner of one such process:
``python tests/test_docs.py PAGE``.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import prefork
from tests.patience import HANG

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
PAGES = ["README.md", *sorted(f"docs/{p.name}" for p in DOCS.glob("*.md"))]
SKIP_MARK = "# doctest: skip"
_SKIP_WITH_REASON = re.compile(r"# doctest: skip \(([^()\s][^()]*)\)")
_RANKS = re.compile(r"^<!-- doctest: ranks=(\d+) -->$", re.MULTILINE)
_REQUIRES = re.compile(r"^<!-- doctest: requires=([\w.,]+) -->$", re.MULTILINE)

#: Warnings attributed to these packages' own frames are shown, not raised; a warning
#: attributed to an example (or to functional_ckpt) fails the page.
_DEPENDENCIES = r"(torch|transformers|lightning|lightning_fabric|accelerate|torchdata)(\.|$)"

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


def unexplained_skips(blocks: list[Block]) -> list[Block]:
    """Python blocks left out without saying why."""
    return [
        b
        for b in blocks
        if b.info.startswith("python")
        and (
            b.info != "python" or (SKIP_MARK in b.source and not _SKIP_WITH_REASON.search(b.source))
        )
    ]


def runnable(blocks: list[Block]) -> list[Block]:
    return [b for b in blocks if b.info == "python" and SKIP_MARK not in b.source]


def ranks(text: str) -> int:
    m = _RANKS.search(text)
    return 1 if m is None else int(m[1])


class PageError(Exception):
    """An example of a page raised; the message names the page, the line and the traceback."""


def run_page(path: Path) -> None:
    """Execute a page's blocks in order in one namespace, in the current directory."""
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for block in runnable(code_blocks(path.read_text(encoding="utf-8"))):
        # Pad with blank lines so tracebacks show the line number in the Markdown file.
        code = compile("\n" * (block.line - 1) + block.source, str(path), "exec", dont_inherit=True)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # an example that warns teaches the warning
                # ... but what a dependency says about its own internals (torch's DCP
                # warns on every single-process call) is not the example's doing.
                warnings.filterwarnings("default", module=_DEPENDENCIES)
                exec(code, namespace)
        except Exception as e:
            raise PageError(
                f"{path.name}: the example at line {block.line} raised:\n{traceback.format_exc()}"
            ) from e


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
            "raise RuntimeError  # doctest: skip (needs a GPU)",
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
    assert [b.info for b in blocks] == ["python", "", "python-skip", "python", "python", "python"]
    assert [b.source for b in runnable(blocks)] == ["x = 1\n", "y = x + 1\n"]
    assert runnable(blocks)[0].line == 3
    assert [b.line for b in unexplained_skips(blocks)] == [9, 15]
    assert ranks(text) == 1 and ranks(text + "\n<!-- doctest: ranks=2 -->\n") == 2


def test_an_example_that_warns_fails_its_page(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nimport warnings\nwarnings.warn('careless', UserWarning)\n```\n")
    with pytest.raises(PageError, match="careless"):
        run_page(page)
    page.write_text(
        "```python\nimport torch\nx = torch.ones(2, requires_grad=True)\ny = float(x.sum())\n```\n"
    )
    with pytest.raises(PageError, match="requires_grad"):
        run_page(page)  # torch warns, but the example is at fault (its frame)


def test_every_page_is_covered() -> None:
    assert "README.md" in PAGES and "docs/guide.md" in PAGES and "docs/distributed.md" in PAGES
    assert len(PAGES) == 1 + len(list(DOCS.glob("*.md")))


@pytest.mark.parametrize("page", PAGES)
def test_skips_say_why(page: str) -> None:
    blocks = code_blocks((REPO / page).read_text(encoding="utf-8"))
    bad = [b.line for b in unexplained_skips(blocks)]
    assert not bad, (
        f"{page}: python blocks at lines {bad} are skipped without a reason; run them, or "
        "mark them ```python with '# doctest: skip (why it cannot run here)'"
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(path: Path, world: int, timeout: float = HANG, grace: float = 60) -> None:
    """Run a page's examples as ``torchrun --nproc_per_node=world`` would, in the cwd.

    When one rank fails, the others get ``grace`` seconds to fail too (they usually
    do at once, on a dropped connection) before they are killed.
    """
    port = str(free_port())
    with tempfile.TemporaryDirectory() as logs:
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world),
                "LOCAL_WORLD_SIZE": str(world),
                "OMP_NUM_THREADS": "1",
                "FCKPT_TIMEOUT": "600",
                "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            }
            with open(Path(logs) / f"{rank}.log", "w") as log:
                procs.append(
                    prefork.Popen(
                        [sys.executable, __file__, str(path)],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        deadline, killed = time.monotonic() + timeout, False
        while None in (codes := [p.poll() for p in procs]):
            if any(code not in (None, 0) for code in codes):
                deadline = min(deadline, time.monotonic() + grace)
            if time.monotonic() > deadline and not killed:
                for p in procs:
                    if p.poll() is None:
                        p.kill()
                killed = True
            time.sleep(0.05)
        failures = [
            f"rank {rank} exited with {p.returncode}:\n"
            + (Path(logs) / f"{rank}.log").read_text(errors="replace")[-4000:]
            for rank, p in enumerate(procs)
            if p.returncode != 0
        ]
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)


@pytest.mark.parametrize("page", PAGES)
def test_examples_run(page: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = REPO / page
    text = path.read_text(encoding="utf-8")
    if not any(b.info == "python" for b in code_blocks(text)):
        pytest.skip(f"{page} has no python examples")
    assert runnable(code_blocks(text)), f"{page} skips every python example"
    for m in _REQUIRES.finditer(text):
        for module in m[1].split(","):
            pytest.importorskip(module, reason=f"{page} needs {module} (the test extra)")
    monkeypatch.chdir(tmp_path)
    world = ranks(text)
    if world > 1:
        run_ranks(path, world)
        return
    try:
        run_page(path)
    except PageError as e:
        pytest.fail(str(e), pytrace=False)


if __name__ == "__main__":
    try:
        run_page(Path(sys.argv[1]))
    except PageError as e:
        print(e, file=sys.stderr)
        sys.exit(1)
