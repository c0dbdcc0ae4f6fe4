"""Where ``fckpt`` output goes and how it looks, and the two outcomes besides success.

Colours need a terminal on stdout and no ``NO_COLOR``/``TERM=dumb``; progress needs a
terminal on stderr, so ``fckpt verify ROOT > log`` shows progress while the log stays
plain, stable text for scripts (tables never wrapped, no trailing spaces). ``rich`` is
imported only to draw a bar, a colour or a non-ASCII table, so plain output starts fast.
"""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any

from functional_ckpt._src.text import joined_lines, printable_lines
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from rich.progress import Progress as RichProgress

__all__ = ["PROG", "Declined", "Progress", "UI", "UsageError", "Verified", "human", "jsonable"]
__all__ += ["one_line"]

PROG = "fckpt"


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class Declined(Exception):
    """The command ran and the answer is "no" (damage found, prune declined): exit 1."""


def one_line(err: BaseException) -> str:
    """An exception as one line: multi-line messages joined, errno noise dropped."""
    if (
        isinstance(err, OSError)
        and err.strerror
        and err.filename
        and not isinstance(err, CheckpointError)
    ):
        return f"{err.filename}: {err.strerror}"
    return joined_lines(str(err)) or type(err).__name__


def jsonable(value: Any) -> Any:
    """Plain JSON for any manifest value: exact where JSON can be, descriptive otherwise."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 53:
        return {"int": hex(value)}  # exact; JSON readers lose big ints and repr may refuse them
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, bytes | bytearray):
        return {"bytes": value.hex()}
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [jsonable(v) for v in value]
    np = sys.modules.get("numpy")  # not loaded: no value is one of its types
    if np is not None and isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if np is not None and isinstance(value, np.generic):
        return jsonable(value.item())
    return repr(value)


def time_text(t: float | None) -> str:
    """A save time for a table; "-" when unknown or not representable."""
    if t is None or not math.isfinite(t) or t <= 0:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, ValueError, OSError):
        return "-"


_STYLES = {
    "ok": "green",
    "bad": "bold red",
    "warn": "yellow",
    "dim": "dim",
    "key": "bold",
    "dtype": "cyan",
    "head": "bold",
}
#: Wide enough that no table row of any real root wraps on a non-terminal.
_PLAIN_WIDTH = 1 << 16


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def human(n: float) -> str:
    """Bytes in binary units, short enough for a table column."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _plain_cells(head: Sequence[str], rows: Sequence[Sequence[str]], styles: Any) -> bool:
    """Every cell printable ASCII, one per column: ``rich`` would print :func:`_plain_table`."""
    width = len(head)
    if (
        not width
        or len(rows) != len(styles)
        or any(len(r) != width or len(s) != width for r, s in zip(rows, styles, strict=True))
    ):
        return False
    return all(c.isascii() and c.isprintable() for row in (head, *rows) for c in row)


def _plain_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """The lines ``rich`` prints for a plain ASCII table, without importing ``rich``."""
    widths = [max(len(c) for c in column) for column in zip(head, *rows, strict=True)]
    return [
        "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
        for cells in (head, *rows)
    ]


class Progress:
    """A transient ``rich`` progress bar on a terminal; nothing otherwise (a log stays clean).
    Shown from ``with`` (or :meth:`start`) to :meth:`close`; a ``total`` of 0 has no end."""

    def __init__(
        self, stream: IO[str], label: str, total: int, unit: str, enabled: bool, out: Any = None
    ) -> None:
        self.label, self.total, self.out = label, max(0, total), out or sys.stdout
        self._bar: RichProgress | None = None
        self._task: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                MofNCompleteColumn,
                TaskProgressColumn,
                TextColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            amount = DownloadColumn(binary_units=True) if unit == "B" else MofNCompleteColumn()
            columns = (TextColumn("{task.description}"), BarColumn(), TaskProgressColumn())
            self._bar = RichProgress(
                *columns,
                amount,
                TimeRemainingColumn(),
                console=Console(file=stream, force_terminal=True),
                transient=True,
            )

    def start(self) -> Progress:
        if self._bar is not None and self._task is None:
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.total or None)
        return self

    def __enter__(self) -> Progress:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update(self, done: float, *, force: bool = False, label: str | None = None) -> None:
        """Set the amount done (and what is being done); ``force`` draws now."""
        if self._bar is None or self._task is None:
            return
        completed = min(max(done, 0), self.total or done)
        self._bar.update(self._task, completed=completed, description=label or self.label)
        self.label = label or self.label
        if force:
            self._bar.refresh()

    def advance(self, amount: float) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, amount)

    def print(self, text: str) -> None:
        """A result line on stdout while the bar runs: above the bar when both share a terminal."""
        if self._bar is not None and self._task is not None and _isatty(self.out):
            from rich.text import Text

            self._bar.console.print(Text.from_ansi(text), soft_wrap=True, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class UI:
    """The streams of one ``fckpt`` run and how to write to them."""

    def __init__(
        self,
        out: IO[str] | None = None,
        err: IO[str] | None = None,
        stdin: IO[str] | None = None,
        env: Mapping[str, str] | None = None,
        *,
        colour: bool | None = None,
    ) -> None:
        self.out = out if out is not None else sys.stdout
        self.err = err if err is not None else sys.stderr
        self.stdin = stdin if stdin is not None else sys.stdin
        env = os.environ if env is None else env
        plain_term = env.get("TERM") == "dumb" or bool(env.get("NO_COLOR"))
        self.colour = (_isatty(self.out) and not plain_term) if colour is None else colour
        self.show_progress = _isatty(self.err) and env.get("TERM") != "dumb"
        encoding = (getattr(self.out, "encoding", None) or "").lower().replace("-", "")
        self.ascii_only = encoding not in ("utf8", "utf16", "utf32")

    def paint(self, text: str, style: str) -> str:
        """``text`` in the style's colours when colours are on, else unchanged."""
        name = _STYLES.get(style)
        if not (self.colour and name):
            return text
        from rich.style import Style

        return Style.parse(name).render(text)

    def print(self, text: str = "") -> None:
        """Output lines; plain output is escaped here (coloured output by its callers)."""
        print(text if self.colour else printable_lines(text), file=self.out, flush=True)

    def note(self, text: str) -> None:
        """A line about the run, not its result: stderr, so stdout stays the result alone."""
        print(printable_lines(text), file=self.err, flush=True)

    def error(self, message: str) -> None:
        print(f"{PROG}: error: {printable_lines(message)}", file=self.err, flush=True)

    def progress(self, label: str, total: int, unit: str = "B") -> Progress:
        return Progress(self.err, label, total, unit, enabled=self.show_progress, out=self.out)

    def table(self, head: Sequence[str], rows: Sequence[Sequence[str]], styles: Any) -> None:
        """Print a table: aligned columns, ``head`` bold, ``styles[i][j]`` per cell."""
        if not self.colour and _plain_cells(head, rows, styles):
            for line in _plain_table(head, rows):
                self.print(line)
            return
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), show_edge=False)
        for name in head:
            table.add_column(Text(name, style="bold" if self.colour else ""), no_wrap=True)
        for cells, cell_styles in zip(rows, styles, strict=True):
            table.add_row(
                *(
                    Text(c, style=_STYLES.get(s, "") if self.colour else "")
                    for c, s in zip(cells, cell_styles, strict=True)
                )
            )
        buf = io.StringIO()
        console = Console(
            file=buf,
            width=_PLAIN_WIDTH,
            force_terminal=self.colour,
            no_color=not self.colour,
            color_system="standard" if self.colour else None,
            highlight=False,
        )
        console.print(table)
        for line in buf.getvalue().splitlines():
            self.print(line.rstrip())

    def interactive(self) -> bool:
        return _isatty(self.stdin)

    def confirm(self, question: str) -> bool:
        print(f"{question} [y/N] ", end="", file=self.out, flush=True)
        answer = self.stdin.readline()
        return answer.strip().lower() in ("y", "yes")

    def json(self, doc: Any) -> None:
        """The one JSON document of a ``--json`` run: nothing else goes to stdout."""
        self.print(json.dumps(doc, indent=2, default=repr))

    def verdict(self, emit: Any, result: Verified, quiet: bool) -> None:
        """``fckpt verify``'s lines for one checkpoint (``emit`` prints one, above a bar)."""
        if result.ok:
            if not quiet:
                what = f"{result.files_checked} files, {human(result.bytes_checked)}"
                emit(f"{self.paint('OK', 'ok')}       {result.where}  ({what})")
            return
        emit(f"{self.paint('DAMAGED', 'bad')}  {result.where}")
        for line in result.problems:
            emit(f"  {line}")

    def verified(
        self, target: str, results: Sequence[Verified], json: bool, stock: Any = ()
    ) -> int:
        """``fckpt verify``'s last line or JSON document, for a path and a URL alike;
        the exit status: 1 if any checkpoint is damaged."""
        bad, n = sum(not r.ok for r in results), len(results)
        if json:
            rows = [
                {"path": r.where, "status": s, "problems": list(r.problems)}
                | {"files_checked": r.files_checked, "bytes_checked": r.bytes_checked}
                for r, s in [(r, "intact" if r.ok else "damaged") for r in results]
                + [(Verified(str(p), False), "skipped") for p in stock]
            ]
            doc = {"path": target, "ok": not bad, "intact": n - bad, "damaged": bad}
            self.json({**doc, "skipped": len(stock), "checkpoints": rows})
        else:
            unverified = f"; {len(stock)} stock DCP not verifiable" if stock else ""
            if bad:
                self.print(f"{bad} of {n} checkpoints damaged{unverified}")
            elif not n:
                self.print(f"no functional_ckpt checkpoint to verify{unverified}")
            else:
                self.print(f"{n} checkpoint{'s' if n != 1 else ''} intact{unverified}")
        return 1 if bad else 0


@dataclass(frozen=True)
class Verified:
    """One checkpoint's verdict, local or remote alike: what ``verify`` prints per checkpoint."""

    where: str
    ok: bool
    problems: tuple[str, ...] = ()
    files_checked: int = 0
    bytes_checked: int = 0
