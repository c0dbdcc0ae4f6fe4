"""Where ``fckpt`` output goes and how it looks: one table printer, one JSON emitter. Output
redirected to a log stays plain, stable text for scripts (tables never wrapped, no trailing
spaces) while progress still shows on a terminal's stderr; ``rich`` is imported only to draw
a bar, a colour or a non-ASCII table, so plain output starts fast."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from functional_ckpt._src.text import joined_lines, printable_lines
from functional_ckpt.errors import CheckpointError

__all__ = ["PROG", "RUN", "SAVED", "SIZE", "STEP", "Column", "Declined", "Progress", "Section"]
__all__ += ["UI", "UsageError", "cell", "human", "jsonable", "metrics_text", "one_line"]
__all__ += ["time_text"]

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


def human(n: float) -> str:
    """Bytes in binary units, short enough for a table column."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


_STYLES = {"ok": "green", "bad": "bold red", "warn": "yellow", "dim": "dim", "key": "bold"}
_STYLES |= {"dtype": "cyan", "head": "bold"}
#: Wide enough that no table row of any real root wraps on a non-terminal.
_PLAIN_WIDTH = 1 << 16

#: A column of a table of plain-data rows: its head, its cell of a row, its style
#: (a name, or the style of a row).
Column = tuple[str, Callable[[Any], str], str | Callable[[Any], str]]


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


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
    """A transient ``rich`` progress bar on a terminal; nothing otherwise (a log stays clean)."""

    def __init__(
        self, stream: IO[str], label: str, total: int, unit: str, enabled: bool, out: Any = None
    ) -> None:
        self.label, self.total, self.out = label, max(0, total), out or sys.stdout
        self._bar: Any = None
        self._task: Any = None
        if enabled:
            from rich import progress as rp
            from rich.console import Console

            amount = (
                rp.DownloadColumn(binary_units=True) if unit == "B" else rp.MofNCompleteColumn()
            )
            columns = (rp.TextColumn("{task.description}"), rp.BarColumn(), rp.TaskProgressColumn())
            console = Console(file=stream, force_terminal=True)
            self._bar = rp.Progress(
                *columns, amount, rp.TimeRemainingColumn(), console=console, transient=True
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
        if self._task is not None:
            self.label = label or self.label
            completed = min(max(done, 0), self.total or done)
            self._bar.update(self._task, completed=completed, description=self.label)
            if force:
                self._bar.refresh()

    def advance(self, amount: float) -> None:
        if self._task is not None:
            self._bar.advance(self._task, amount)

    def print(self, text: str) -> None:
        """A result line on stdout while the bar runs: above the bar when both share a terminal."""
        if self._task is not None and _isatty(self.out):
            from rich.text import Text

            self._bar.console.print(Text.from_ansi(text), soft_wrap=True, highlight=False)
        else:
            print(text, file=self.out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = self._task = None


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

    def rows(self, columns: Sequence[Column], rows: Sequence[Any]) -> None:
        """A table with a line per row, its cells and styles given by ``columns``."""
        cells = [[cell(r) for _, cell, _ in columns] for r in rows]
        styles = [[s if isinstance(s, str) else s(r) for _, _, s in columns] for r in rows]
        self.table([head for head, _, _ in columns], cells, styles)

    def table(self, head: Sequence[str], rows: Sequence[Sequence[str]], styles: Any) -> None:
        """Print a table: aligned columns, ``head`` bold, ``styles[i][j]`` per cell."""
        if not self.colour and _plain_cells(head, rows, styles):
            for line in _plain_table(head, rows):
                self.print(line)
            return
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text

        def text(cell: str, style: str) -> Text:
            return Text(cell, style=_STYLES.get(style, "") if self.colour else "")

        table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), show_edge=False)
        for name in head:
            table.add_column(text(name, "head"), no_wrap=True)
        for cells, cell_styles in zip(rows, styles, strict=True):
            table.add_row(*(text(c, s) for c, s in zip(cells, cell_styles, strict=True)))
        buf = io.StringIO()
        console = Console(
            file=buf,
            width=_PLAIN_WIDTH,
            force_terminal=self.colour,
            no_color=not self.colour,
            color_system="standard" if self.colour else None,
        )
        console.print(table, highlight=False)
        for line in buf.getvalue().splitlines():
            self.print(line.rstrip())

    def interactive(self) -> bool:
        return _isatty(self.stdin)

    def confirm(self, question: str) -> bool:
        print(f"{question} [y/N] ", end="", file=self.out, flush=True)
        return self.stdin.readline().strip().lower() in ("y", "yes")

    def json(self, doc: Any) -> None:
        """The one JSON document of a ``--json`` run: nothing else goes to stdout."""
        self.print(json.dumps(doc, indent=2, default=repr))


@dataclass
class Section:
    """Rows of one kind as plain data (``--json`` prints them) and their table."""

    name: str  # the head of its title, below another section
    title: str
    columns: Sequence[Column]
    rows: list[dict[str, Any]] = field(default_factory=list)
    empty: str = ""  # printed instead of an empty table

    def print(self, ui: UI) -> None:
        if self.name:
            ui.print(f"\n{ui.paint(self.name, 'head')} {self.title}")
        if self.rows or not self.empty:
            ui.rows(self.columns, self.rows)
        else:
            ui.print(self.empty)


def cell(key: str) -> Callable[[Any], str]:
    return lambda r: str(r[key])


RUN: Column = ("RUN", lambda r: (r["run"] or "-")[:8], "dim")
SAVED: Column = ("SAVED", lambda r: time_text(r["time"]), "dim")
SIZE: Column = ("SIZE", lambda r: human(r["size"]), "")
STEP: Column = ("STEP", lambda r: "-" if r["step"] is None else str(r["step"]), "")
