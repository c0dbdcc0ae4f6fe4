"""``fckpt``: look at, check, compare, export and prune checkpoints from the shell.

Every subcommand is a thin layer over the public functions (``fc.inspect``,
``fc.verify``, ``fc.restore``, ``fc.export_safetensors``, ``fc.plan_deletions``,
``CheckpointManager.delete``): the command line adds presentation, never new
checkpoint logic. Conventions:

* results go to stdout, progress bars and errors to stderr; progress bars only
  when stderr is a terminal, colours only when stdout is one (and ``NO_COLOR`` is
  unset), so piped output is plain text;
* exit status 0: done and all good; 1: the answer is "no" (a checkpoint is
  damaged, the demo's runs differ, a prune was declined); 2: bad input (missing
  path, not a checkpoint, wrong flags), reported as one line
  ``fckpt: error: <message>`` without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any, NoReturn

import numpy as np
import torch

import functional_ckpt as fc
from functional_ckpt import format as fmt
from functional_ckpt.io import Node
from functional_ckpt.manager import MANAGER_KEY, QUARANTINE_INFIX, parse_step
from functional_ckpt.retention import RetentionError, retention_from_spec, union_parts
from functional_ckpt.tree import NODE_KEY, KeyPath, iter_leaves

__all__ = [
    "DiffEntry",
    "DiffResult",
    "UsageError",
    "build_parser",
    "diff_checkpoints",
    "kept_by",
    "main",
    "retention_parts",
]

PROG = "fckpt"


class UsageError(Exception):
    """Bad command-line input: reported in one line, exit status 2."""


class Declined(Exception):
    """The command ran and the answer is "no" (damage found, prune declined): exit 1."""


# --------------------------------------------------------------------------- terminal

_STYLES = {
    "ok": "32",
    "bad": "1;31",
    "warn": "33",
    "dim": "2",
    "key": "1",
    "dtype": "36",
    "head": "1",
}


class UI:
    """Where output goes and how it looks, decided once from the streams and the env.

    Colours need a terminal on stdout and no ``NO_COLOR`` (https://no-color.org);
    progress bars need a terminal on stderr, so ``fckpt verify ROOT > log`` still
    shows progress while the log stays clean.
    """

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
        code = _STYLES.get(style)
        return f"\033[{code}m{text}\033[0m" if self.colour and code else text

    def print(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def error(self, message: str) -> None:
        print(f"{PROG}: error: {message}", file=self.err, flush=True)

    def progress(self, label: str, total: int, unit: str = "B") -> Progress:
        return Progress(self.err, label, total, unit, enabled=self.show_progress)

    def interactive(self) -> bool:
        return _isatty(self.stdin)

    def confirm(self, question: str) -> bool:
        print(f"{question} [y/N] ", end="", file=self.out, flush=True)
        answer = self.stdin.readline()
        return answer.strip().lower() in ("y", "yes")


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


class Progress:
    """A one-line bar on a terminal, redrawn at most ten times a second; else nothing.

    Plain output (pipes, CI logs) gets no bar at all: carriage-return animations
    only clutter a log, and the command prints its result lines either way.
    """

    def __init__(self, stream: IO[str], label: str, total: int, unit: str, enabled: bool) -> None:
        self.stream, self.label, self.total, self.unit = stream, label, max(0, total), unit
        self.enabled = enabled
        self.done = 0
        self._drawn = 0.0
        self._visible = False
        self._line = ""
        self._lock = threading.Lock()

    def __enter__(self) -> Progress:
        self.update(0, force=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _amount(self, n: float) -> str:
        return human(n) if self.unit == "B" else f"{int(n)}"

    def update(self, done: float, *, force: bool = False) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done = int(min(max(done, 0), self.total or done))
            now = time.monotonic()
            if not force and now - self._drawn < 0.1:
                return
            self._drawn = now
            width = shutil.get_terminal_size((80, 24)).columns
            frac = self.done / self.total if self.total else 0.0
            tail = f" {100 * frac:3.0f}% {self._amount(self.done)}/{self._amount(self.total)}"
            room = max(10, min(40, width - len(self.label) - len(tail) - 4))
            filled = int(frac * room)
            bar = "#" * filled + "-" * (room - filled)
            line = f"{self.label} [{bar}]{tail}"[: width - 1]
            if line == self._line and self._visible:
                return
            self._line = line
            self.stream.write("\r" + line)
            self.stream.flush()
            self._visible = True

    def close(self) -> None:
        with self._lock:
            if self._visible:
                width = shutil.get_terminal_size((80, 24)).columns
                self.stream.write("\r" + " " * (width - 1) + "\r")
                self.stream.flush()
                self._visible = False


def _io_counter() -> int | None:
    """Bytes this process read and wrote so far (Linux ``/proc/self/io``), else None."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["rchar"]) + int(fields["wchar"])
    except (OSError, KeyError, ValueError):
        return None


@contextlib.contextmanager
def io_meter(progress: Progress) -> Iterator[None]:
    """Drive ``progress`` by the bytes this process reads and writes meanwhile.

    ``fc.verify`` and ``fc.export_safetensors`` take no callback; both do plain
    ``pread``/``write`` I/O, so the kernel's per-process byte counters measure
    their progress exactly, without touching them. Where the counters are not
    available the bar simply jumps to the end.
    """
    start = _io_counter() if progress.enabled else None
    stop = threading.Event()

    def poll() -> None:
        while not stop.wait(0.1):
            now = _io_counter()
            if now is not None and start is not None:
                progress.update(now - start)

    thread = threading.Thread(target=poll, daemon=True) if start is not None else None
    if thread is not None:
        thread.start()
    try:
        with progress:
            yield
            progress.update(progress.total, force=True)
    finally:
        stop.set()
        if thread is not None:
            thread.join()


# --------------------------------------------------------------------------- finding checkpoints


def is_checkpoint_dir(path: Path) -> bool:
    """Looks like one checkpoint (ours, committed or not, or a stock DCP one)."""
    return path.is_dir() and any(
        (path / name).exists() for name in (fmt.COMMIT_MARKER, fmt.MANIFEST, fmt.DCP_METADATA)
    )


def require_exists(path: Path) -> None:
    if not path.exists():
        raise fc.CheckpointNotFound(f"{path}: no such file or directory")


@dataclass
class Row:
    """One entry of a checkpoint root, whatever state it is in."""

    name: str
    path: Path
    step: int | None
    status: str  # ok | damaged | uncommitted | quarantined | deleting | foreign
    canonical: bool = False
    time: float | None = None
    size: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    detail: str = ""
    kept_by: list[str] = field(default_factory=list)

    @property
    def committed(self) -> bool:
        return self.status in ("ok", "damaged", "intact")


def _dir_size(path: Path) -> int:
    total = 0
    with contextlib.suppress(OSError), os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _step_of(name: str, meta: Mapping[str, Any]) -> int | None:
    record = meta.get(MANAGER_KEY)
    if isinstance(record, dict) and isinstance(record.get("step"), int):
        return int(record["step"])
    m = re.search(r"(\d+)$", name)
    return int(m.group(1)) if m else None


def _base_name(name: str) -> str:
    for infix in (fmt.TMP_INFIX, fmt.TRASH_INFIX, QUARANTINE_INFIX):
        name = name.split(infix)[0]
    return name


def _committed_row(entry: Path) -> Row:
    name = entry.name
    try:
        manifest = fmt.read_manifest(entry)
    except (fc.CheckpointError, OSError) as err:
        return Row(
            name,
            entry,
            _step_of(name, {}),
            "damaged",
            size=_dir_size(entry),
            detail=_one_line(err),
            canonical=parse_step(name) is not None,
        )
    meta = manifest.get("metadata")
    meta = dict(meta) if isinstance(meta, dict) else {}
    record = meta.get(MANAGER_KEY)
    metrics = record.get("metrics") if isinstance(record, dict) else None
    created = manifest.get("created")
    return Row(
        name,
        entry,
        _step_of(name, meta),
        "ok",
        canonical=parse_step(name) is not None,
        time=float(created) if isinstance(created, int | float) else None,
        size=_dir_size(entry),
        metrics={k: float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)},
        metadata=meta,
    )


def classify(entry: Path) -> Row | None:
    """A row for a directory of a root, or None if it is not checkpoint-related."""
    name = entry.name
    if not entry.is_dir() or entry.is_symlink():
        return None
    base = _base_name(name)
    step = _step_of(base, {})
    if QUARANTINE_INFIX in name:
        return Row(
            name,
            entry,
            step,
            "quarantined",
            size=_dir_size(entry),
            detail="found unreadable by a manager and moved aside",
        )
    if fmt.TRASH_INFIX in name:
        return Row(
            name,
            entry,
            step,
            "deleting",
            size=_dir_size(entry),
            detail="a deletion in progress (or interrupted)",
        )
    if fmt.TMP_INFIX in name:
        return Row(
            name,
            entry,
            step,
            "uncommitted",
            size=_dir_size(entry),
            detail="a save in progress, or one a crash interrupted",
        )
    if (entry / fmt.COMMIT_MARKER).exists():
        return _committed_row(entry)
    if (entry / fmt.MANIFEST).exists():
        return Row(
            name,
            entry,
            step,
            "uncommitted",
            size=_dir_size(entry),
            canonical=parse_step(name) is not None,
            detail="never committed: the COMMITTED marker is missing",
        )
    if (entry / fmt.DCP_METADATA).exists():
        return Row(
            name,
            entry,
            step,
            "foreign",
            size=_dir_size(entry),
            detail="a stock torch.distributed.checkpoint directory",
        )
    return None


def scan_root(root: Path) -> list[Row]:
    """Every checkpoint-related directory directly under ``root``, by step then name."""
    require_exists(root)
    if not root.is_dir():
        raise fc.CheckpointNotFound(f"{root}: not a directory")
    if is_checkpoint_dir(root):
        raise UsageError(
            f"{root}: is a checkpoint, not a directory of checkpoints; try '{PROG} inspect {root}'"
        )
    rows = [row for entry in sorted(root.iterdir()) if (row := classify(entry)) is not None]
    rows.sort(key=lambda r: (r.step if r.step is not None else -1, r.name))
    return rows


def newest_checkpoint(root: Path) -> Path:
    """``root`` itself if it is a checkpoint, else its newest committed, readable one."""
    require_exists(root)
    if is_checkpoint_dir(root):
        return root
    ok = [r for r in scan_root(root) if r.status == "ok"]
    if not ok:
        raise fc.CheckpointNotFound(f"{root}: no committed checkpoint here")
    return ok[-1].path


# --------------------------------------------------------------------------- retention


def retention_parts(spec: object) -> list[tuple[str, fc.RetentionPolicy]] | None:
    """Rebuild a recorded retention policy from its spec, one part per ``|`` operand.

    A spec is plain data (kind and arguments) and only the ``keep_*`` kinds exist,
    so nothing read from a checkpoint can run; None for anything else.
    """
    try:
        policy = retention_from_spec(spec)  # type: ignore[arg-type]
    except RetentionError:
        return None
    return [(repr(part), part) for part in union_parts(policy)]


def recorded_retention(rows: Sequence[Row]) -> object | None:
    """The spec of the retention policy the newest checkpoint says its writer used.

    A manager records it under ``metadata["manager"]["keep"]``.
    """
    for row in reversed(rows):
        if row.status != "ok":
            continue
        record = row.metadata.get(MANAGER_KEY)
        spec = record.get("keep") if isinstance(record, dict) else None
        if isinstance(spec, dict):
            return spec
    return None


def kept_by(
    parts: Sequence[tuple[str, fc.RetentionPolicy]], checkpoints: Sequence[Any]
) -> dict[int, list[str]]:
    """For each step, the parts of the policy that keep it ("latest" always keeps the newest)."""
    out: dict[int, list[str]] = {c.step: [] for c in checkpoints}
    for label, policy in parts:
        for step in sorted(policy.select(checkpoints)):
            out[step].append(label)
    if out:
        out[max(out)].append("latest")
    return out


def _records(rows: Sequence[Row]) -> list[fc.CheckpointRecord]:
    return [
        fc.CheckpointRecord(r.step, r.time or 0.0, r.metrics)
        for r in rows
        if r.status in ("ok", "intact") and r.canonical and r.step is not None
    ]


def policy_from_flags(args: argparse.Namespace) -> list[tuple[str, fc.RetentionPolicy]] | None:
    """``--keep-last N [--keep-best K --metric M [--mode max]]`` as policy parts."""
    parts: list[tuple[str, fc.RetentionPolicy]] = []
    if getattr(args, "keep_best", None) is not None and not getattr(args, "metric", None):
        raise UsageError("--keep-best needs --metric NAME")
    if getattr(args, "keep_last", None) is not None:
        policy = fc.keep_last(args.keep_last)
        parts.append((repr(policy), policy))
    if getattr(args, "keep_best", None) is not None:
        policy = fc.keep_best(args.keep_best, args.metric, mode=args.mode)
        parts.append((repr(policy), policy))
    return parts or None


def _union(parts: Sequence[tuple[str, fc.RetentionPolicy]]) -> fc.RetentionPolicy:
    policy = parts[0][1]
    for _, more in parts[1:]:
        policy = policy | more
    return policy


# --------------------------------------------------------------------------- ls


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def _time_text(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _status_style(status: str) -> str:
    return {"ok": "ok", "intact": "ok", "damaged": "bad", "quarantined": "bad"}.get(status, "warn")


def _verify_rows(rows: Sequence[Row], ui: UI) -> None:
    """Replace ``ok`` by ``intact`` or ``damaged`` after re-reading every byte."""
    todo = [r for r in rows if r.status == "ok"]
    with io_meter(ui.progress("verifying", sum(r.size for r in todo))):
        for row in todo:
            report = fc.verify(row.path)
            row.status = "intact" if report.ok else "damaged"
            row.detail = (
                "" if report.ok else f"{len(report.problems)} problems: {report.problems[0]}"
            )


def _table(rows: Sequence[Sequence[str]], styles: Sequence[Sequence[str]], ui: UI) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for cells, cell_styles in zip(rows, styles, strict=True):
        padded = [
            ui.paint(c.ljust(w) if i < len(cells) - 1 else c, s)
            for i, (c, w, s) in enumerate(zip(cells, widths, cell_styles, strict=True))
        ]
        lines.append("  ".join(padded).rstrip())
    return lines


def cmd_ls(args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root)
    rows = scan_root(root)
    if args.verify:
        _verify_rows(rows, ui)
    source = "flags"
    parts = policy_from_flags(args)
    if parts is None:
        recorded = recorded_retention(rows)
        parts = retention_parts(recorded) if recorded is not None else None
        source = "recorded in the checkpoints"
    records = _records(rows)
    kept = kept_by(parts or [], records)
    for row in rows:
        if row.step in kept and row.canonical and row.status in ("ok", "intact"):
            row.kept_by = kept[row.step] or (["(deleted by the next prune)"] if parts else [])
    if args.json:
        ui.print(json.dumps([_row_json(r) for r in rows], indent=2))
        return 0
    if not rows:
        ui.print(f"{root}: no checkpoints")
        return 0
    _print_ls(rows, parts, source, ui)
    return 0


def _row_json(row: Row) -> dict[str, Any]:
    return {
        "name": row.name,
        "path": str(row.path),
        "step": row.step,
        "status": row.status,
        "time": row.time,
        "size": row.size,
        "metrics": row.metrics,
        "kept_by": row.kept_by,
        "detail": row.detail,
    }


def _print_ls(
    rows: Sequence[Row], parts: Sequence[tuple[str, Any]] | None, source: str, ui: UI
) -> None:
    head = ["CHECKPOINT", "STEP", "SAVED", "SIZE", "STATUS", "METRICS", "KEPT BY"]
    cells = [head]
    styles = [["head"] * len(head)]
    for r in rows:
        why = ", ".join(r.kept_by) if r.kept_by else r.detail
        cells.append(
            [
                r.name,
                "-" if r.step is None else str(r.step),
                _time_text(r.time),
                human(r.size),
                r.status,
                _metrics_text(r.metrics),
                why,
            ]
        )
        deleting = "deleted by" in why
        styles.append(
            ["", "", "dim", "", _status_style(r.status), "", "bad" if deleting else "dim"]
        )
    for line in _table(cells, styles, ui):
        ui.print(line)
    committed = [r for r in rows if r.committed]
    ui.print(f"\n{len(committed)} committed checkpoints, {human(sum(r.size for r in rows))} in all")
    if parts:
        ui.print(f"retention ({source}): {' | '.join(label for label, _ in parts)}")
    else:
        ui.print(
            "retention: unknown (not recorded in the checkpoints); pass --keep-last N "
            "[--keep-best K --metric M] to see what a policy would keep"
        )


# --------------------------------------------------------------------------- inspect


def _dtype_text(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _short(value: Any, limit: int = 80) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


@dataclass(frozen=True)
class Entry:
    """One row of a flattened summary tree: a node, a tensor spec or a plain value."""

    path: KeyPath
    item: Any

    @property
    def key(self) -> str:
        return "/".join(self.path)


def flatten_tree(tree: Mapping[str, Any], prefix: KeyPath = ()) -> Iterator[Entry]:
    for key, item in tree.items():
        path = (*prefix, str(key))
        yield Entry(path, item)
        if isinstance(item, Node):
            yield from flatten_tree(item, path)


def filter_entries(entries: Sequence[Entry], prefix: str | None) -> list[Entry]:
    """Entries whose ``a/b/c`` key starts with ``prefix``, plus their ancestors for context."""
    if not prefix:
        return list(entries)
    hits = [e for e in entries if e.key.startswith(prefix)]
    wanted = {e.path for e in hits}
    for e in hits:
        wanted.update(e.path[:i] for i in range(1, len(e.path)))
    return [e for e in entries if e.path in wanted]


def _container_kind(node: Node) -> str:
    record = node.get(NODE_KEY)
    if isinstance(record, dict):
        kind = record.get("kind")
        if kind in ("list", "tuple"):
            return f"  ({kind})"
        if kind == "dict":
            return "  (dict, non-str keys)"
    return ""


def _entry_line(entry: Entry, ui: UI, width: int) -> str:
    """One tree row; leaf names are padded to ``width`` so their specs line up."""
    indent = "  " * len(entry.path)
    name = entry.path[-1]
    item = entry.item
    if isinstance(item, Node):
        return f"{indent}{ui.paint(name + '/', 'key')}{ui.paint(_container_kind(item), 'dim')}"
    if isinstance(item, fc.TensorSpec):
        spec = f"{_dtype_text(item.dtype)}{list(item.shape)}"
        size = ui.paint(human(item.nbytes), "dim")
        return f"{indent}{name.ljust(width)}  {ui.paint(spec, 'dtype')}  {size}"
    return f"{indent}{name.ljust(width)}  = {_short(item)}"


def _tree_lines(entries: Sequence[Entry], ui: UI) -> list[str]:
    shown = [e for e in entries if e.path[-1] != NODE_KEY]
    widths: dict[KeyPath, int] = {}
    for e in shown:
        if not isinstance(e.item, Node):
            widths[e.path[:-1]] = min(40, max(widths.get(e.path[:-1], 0), len(e.path[-1])))
    return [_entry_line(e, ui, widths.get(e.path[:-1], 0)) for e in shown]


def _metadata_lines(meta: Any, ui: UI) -> list[str]:
    if not isinstance(meta, dict) or not meta:
        return []
    lines = [ui.paint("metadata", "head")]
    for key, value in meta.items():
        if isinstance(value, dict) and value:
            lines.append(f"  {key}:")
            lines += [f"    {k} = {_short(v, 100)}" for k, v in value.items()]
        else:
            lines.append(f"  {key} = {_short(value, 100)}")
    return lines


def jsonable(value: Any) -> Any:
    """Plain JSON for any manifest value: exact where JSON can be, descriptive otherwise."""
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
    if isinstance(value, np.ndarray):
        return {"ndarray": value.tolist(), "dtype": str(value.dtype)}
    if isinstance(value, np.generic):
        return jsonable(value.item())
    return repr(value)


def _entry_json(entry: Entry) -> dict[str, Any]:
    item = entry.item
    if isinstance(item, Node):
        return {"key": entry.key, "path": list(entry.path), "kind": "node"}
    if isinstance(item, fc.TensorSpec):
        return {
            "key": entry.key,
            "path": list(entry.path),
            "kind": "tensor",
            "dtype": _dtype_text(item.dtype),
            "shape": list(item.shape),
            "nbytes": item.nbytes,
        }
    return {"key": entry.key, "path": list(entry.path), "kind": "value", "value": jsonable(item)}


def _inspect(path: Path) -> fc.CheckpointSummary:
    """``fc.inspect`` with a pointer to ``ls`` when given a directory of checkpoints."""
    require_exists(path)
    try:
        return fc.inspect(path)
    except fc.CheckpointNotFound:
        if path.is_dir() and any(classify(p) for p in path.iterdir()):
            raise UsageError(
                f"{path}: a directory of checkpoints, not a checkpoint; "
                f"see '{PROG} ls {path}' and inspect one of them"
            ) from None
        raise


def cmd_inspect(args: argparse.Namespace, ui: UI) -> int:
    path = Path(args.path)
    summary = _inspect(path)
    entries = filter_entries(list(flatten_tree(summary.tree)), args.key)
    if args.key and not entries:
        top = ", ".join(sorted(summary.tree)) or "none"
        raise UsageError(f"{path}: no key starts with {args.key!r} (top-level keys: {top})")
    if args.json:
        doc = {
            "path": str(summary.path),
            "format_version": summary.format_version,
            "created": summary.created,
            "world_size": summary.world_size,
            "foreign": summary.foreign,
            "num_tensors": summary.num_tensors,
            "num_values": summary.num_values,
            "tensor_bytes": summary.tensor_bytes,
            "file_bytes": summary.file_bytes,
            "metadata": jsonable(summary.metadata),
            "entries": [_entry_json(e) for e in entries],
        }
        ui.print(json.dumps(doc, indent=2))
        return 0
    for line in _inspect_lines(summary, entries, ui):
        ui.print(line)
    return 0


def _inspect_lines(summary: fc.CheckpointSummary, entries: Sequence[Entry], ui: UI) -> list[str]:
    kind = "stock DCP checkpoint" if summary.foreign else f"format v{summary.format_version}"
    lines = [
        ui.paint(str(summary.path), "head"),
        f"  {kind}, saved {_time_text(summary.created)}, written by "
        f"{summary.world_size} rank{'s' if summary.world_size != 1 else ''}",
        f"  {summary.num_tensors} tensors ({human(summary.tensor_bytes)}), "
        f"{summary.num_values} values, {human(summary.file_bytes)} in files",
    ]
    lines += _metadata_lines(summary.metadata, ui)
    lines.append(ui.paint("tree", "head"))
    lines += _tree_lines(entries, ui)
    return lines


# --------------------------------------------------------------------------- verify


def _verify_one(path: Path) -> tuple[bool, list[str], str]:
    """(intact, problem lines, summary) for one checkpoint; damage never raises."""
    try:
        report = fc.verify(path)
    except (fc.CorruptCheckpoint, fc.UnsafeCheckpoint) as err:
        return False, [f"{path}: {_one_line(err)}"], ""
    except fc.IncompleteCheckpoint as err:
        if fmt.is_temporary_name(path.name):
            raise
        return False, [f"{path}: {_one_line(err)}"], ""
    lines = [f"{path / p.where if _is_file(path, p.where) else path}: {p}" for p in report.problems]
    return report.ok, lines, f"{report.files_checked} files, {human(report.bytes_checked)}"


def _is_file(path: Path, where: str) -> bool:
    return "/" not in where and (path / where).exists()


def _verify_targets(target: Path) -> tuple[list[Path], list[str]]:
    """Checkpoints to verify under ``target`` and damage found by listing alone."""
    if is_checkpoint_dir(target) or not target.is_dir():
        return [target], []
    rows = scan_root(target)
    paths = [r.path for r in rows if r.committed]
    broken = [f"{r.path}: {r.detail}" for r in rows if r.status == "uncommitted" and r.canonical]
    if not paths and not broken:
        raise fc.CheckpointNotFound(f"{target}: no checkpoints to verify here")
    return paths, broken


def cmd_verify(args: argparse.Namespace, ui: UI) -> int:
    target = Path(args.path)
    require_exists(target)
    paths, broken = _verify_targets(target)
    bad = len(broken)
    for line in broken:
        ui.print(f"{ui.paint('DAMAGED', 'bad')}  {line}")
    with io_meter(ui.progress("verifying", sum(_dir_size(p) for p in paths))):
        results = [(p, *_verify_one(p)) for p in paths]
    for path, ok, problems, what in results:
        if ok:
            if not args.quiet:
                ui.print(f"{ui.paint('OK', 'ok')}       {path}  ({what})")
            continue
        bad += 1
        ui.print(f"{ui.paint('DAMAGED', 'bad')}  {path}")
        for line in problems:
            ui.print(f"  {line}")
    total = len(paths) + len(broken)
    if bad:
        ui.print(f"{bad} of {total} checkpoints damaged")
        return 1
    ui.print(f"{total} checkpoint{'s' if total != 1 else ''} intact")
    return 0


# --------------------------------------------------------------------------- diff


@dataclass(frozen=True)
class DiffEntry:
    """One difference (or sameness) between two checkpoints, for one key."""

    kind: str  # added | removed | kind | shape | dtype | value | tensor | same
    key: KeyPath
    detail: str = ""
    nbytes: int = 0

    def __str__(self) -> str:
        sign = {"added": "+", "removed": "-", "same": "="}.get(self.kind, "~")
        return f"{sign} {self.kind:<7} {'/'.join(self.key)}  {self.detail}".rstrip()


@dataclass
class DiffResult:
    a: Path
    b: Path
    entries: list[DiffEntry]

    @property
    def changes(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.kind != "same"]

    @property
    def same(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.kind == "same"]


def _leaves(path: Path) -> dict[KeyPath, tuple[str, Any]]:
    state = fc.restore(path)
    return {
        leaf.path: (leaf.kind, leaf.value) for leaf in iter_leaves(state) if leaf.kind != "node"
    }


def same_value(a: Any, b: Any) -> bool:
    """Exact equality of plain values: same types, floats bit for bit (NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return bool(a.hex() == b.hex())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return repr(a) == repr(b)


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """Each element's bytes as one row, to compare any dtype bit for bit."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def tensor_delta(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if bit-identical, else how much they differ.

    Values are compared in float64 (complex128 for complex dtypes), which holds
    every bool, integer up to 2**53, float8/16/32 exactly; NaN against a number
    is counted apart. Dtypes torch cannot convert get "bytes differ".
    """
    try:
        differ = (_element_bytes(a) != _element_bytes(b)).any(dim=1)
    except RuntimeError:
        return None if torch.equal(a, b) else "values differ"
    n = int(differ.sum())
    if n == 0:
        return None
    where = f"{n} of {a.numel()} elements differ"
    try:
        wide = torch.complex128 if a.is_complex() else torch.float64
        x = a.detach().reshape(-1).to(wide)[differ]
        y = b.detach().reshape(-1).to(wide)[differ]
    except (RuntimeError, TypeError):
        return f"bytes differ ({where})"
    d = (x - y).abs()
    nan = d.isnan()
    both_nan = x.isnan() & y.isnan()
    mismatched = int((nan & ~both_nan).sum())
    finite = d[~nan]
    text = f"max |Δ| {float(finite.max()):.3g}" if finite.numel() else "max |Δ| -"
    if mismatched:
        text += f", {mismatched} NaN vs number"
    return f"{text} ({where})"


def _spec(value: torch.Tensor) -> str:
    return f"{_dtype_text(value.dtype)}{list(value.shape)}"


def _diff_one(key: KeyPath, a: tuple[str, Any], b: tuple[str, Any]) -> DiffEntry:
    (ka, va), (kb, vb) = a, b
    if ka != kb:
        left = _spec(va) if ka == "tensor" else _short(va, 40)
        right = _spec(vb) if kb == "tensor" else _short(vb, 40)
        return DiffEntry("kind", key, f"{ka} {left} -> {kb} {right}")
    if ka == "value":
        if same_value(va, vb):
            return DiffEntry("same", key)
        return DiffEntry("value", key, f"{_short(va, 60)} -> {_short(vb, 60)}")
    if tuple(va.shape) != tuple(vb.shape):
        return DiffEntry("shape", key, f"{_spec(va)} -> {_spec(vb)}")
    if va.dtype != vb.dtype:
        return DiffEntry("dtype", key, f"{_spec(va)} -> {_spec(vb)}")
    delta = tensor_delta(va, vb)
    nbytes = va.numel() * va.element_size()
    if delta is None:
        return DiffEntry("same", key, _spec(va), nbytes)
    return DiffEntry("tensor", key, f"{_spec(va)}  {delta}", nbytes)


def diff_checkpoints(a: Path, b: Path) -> DiffResult:
    """Compare two checkpoints leaf by leaf (both restored in full, without templates)."""
    left, right = _leaves(a), _leaves(b)
    entries = []
    for key, (kind, value) in right.items():
        if key not in left:
            what = _spec(value) if kind == "tensor" else _short(value, 60)
            entries.append(DiffEntry("added", key, what))
    for key, (kind, value) in left.items():
        if key not in right:
            what = _spec(value) if kind == "tensor" else _short(value, 60)
            entries.append(DiffEntry("removed", key, what))
        else:
            entries.append(_diff_one(key, left[key], right[key]))
    order = {"added": 0, "removed": 1, "kind": 2, "shape": 3, "dtype": 4, "value": 5, "tensor": 6}
    entries.sort(key=lambda e: (order.get(e.kind, 7), e.key))
    return DiffResult(a, b, entries)


_DIFF_STYLE = {"added": "ok", "removed": "bad", "same": "dim"}


def cmd_diff(args: argparse.Namespace, ui: UI) -> int:
    a, b = Path(args.a), Path(args.b)
    for p in (a, b):
        require_exists(p)
    result = diff_checkpoints(a, b)
    ui.print(f"{ui.paint('A', 'head')} {a}\n{ui.paint('B', 'head')} {b}")
    shown = result.entries if args.all else result.changes
    for entry in shown:
        ui.print(ui.paint(str(entry), _DIFF_STYLE.get(entry.kind, "warn")))
    counts: dict[str, int] = {}
    for e in result.entries:
        counts[e.kind] = counts.get(e.kind, 0) + 1
    order = ("added", "removed", "kind", "shape", "dtype", "value", "tensor", "same")
    names = {
        "kind": "kind changed",
        "shape": "shape changed",
        "dtype": "dtype changed",
        "value": "value(s) changed",
        "tensor": "tensor(s) differ",
        "same": "identical",
    }
    ui.print(", ".join(f"{counts[k]} {names.get(k, k)}" for k in order if counts.get(k)))
    if not result.changes:
        ui.print("the checkpoints hold identical states")
    return 1 if args.exit_code and result.changes else 0


# --------------------------------------------------------------------------- export


_FLOAT_DTYPES = {
    name: dt
    for name in ("float16", "bfloat16", "float32", "float64", "half", "float", "double")
    if isinstance(dt := getattr(torch, name, None), torch.dtype)
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dtype = _FLOAT_DTYPES.get(name.removeprefix("torch."))
    if dtype is None:
        raise UsageError(f"--dtype {name}: expected one of {', '.join(sorted(_FLOAT_DTYPES))}")
    return dtype


def _selected_bytes(
    summary: fc.CheckpointSummary, select: KeyPath, dtype: torch.dtype | None
) -> tuple[int, int]:
    """(bytes to read, bytes to write) of the tensors under ``select``, for the progress bar."""
    entries = flatten_tree(summary.tree)
    read = write = 0
    for e in entries:
        if e.path[: len(select)] == select and isinstance(e.item, fc.TensorSpec):
            read += e.item.nbytes
            itemsize = dtype.itemsize if dtype and e.item.dtype.is_floating_point else None
            numel = math.prod(e.item.shape)
            write += numel * itemsize if itemsize else e.item.nbytes
    return read, write


def cmd_export(args: argparse.Namespace, ui: UI) -> int:
    src = newest_checkpoint(Path(args.path))
    out = Path(args.out)
    dtype = parse_dtype(args.dtype)
    select = tuple(k for k in args.select.split("/") if k)
    if not select:
        raise UsageError(f"--select {args.select!r}: expected a key such as 'model'")
    read, write = _selected_bytes(fc.inspect(src), select, dtype)
    with io_meter(ui.progress("exporting", read + write)):
        fc.export_safetensors(
            src,
            out,
            select=select[0] if len(select) == 1 else select,
            dtype=dtype,
            max_shard_size=args.max_shard_size,
            overwrite=args.overwrite,
        )
    files = sorted(p for p in out.iterdir() if p.is_file())
    ui.print(f"exported {'/'.join(select)} of {src} to {out}:")
    for f in files:
        ui.print(f"  {f.name}  {human(f.stat().st_size)}")
    return 0


# --------------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root)
    rows = scan_root(root)
    parts = policy_from_flags(args)
    assert parts is not None  # --keep-last is required
    policy = _union(parts)
    infos = fc.CheckpointManager(root, read_only=True).infos()
    if not infos:
        ui.print(f"{root}: no committed checkpoints; nothing to prune")
        return 0
    plan = fc.plan_deletions(policy, infos)
    kept = kept_by(parts, infos)
    sizes = {r.step: r.size for r in rows if r.canonical}
    for info in infos:
        doomed = info.step in plan
        label = ui.paint("delete", "bad") if doomed else ui.paint("keep  ", "ok")
        why = "" if doomed else f"  ({', '.join(kept[info.step])})"
        ui.print(f"{label}  {info.path.name}  {human(sizes.get(info.step, info.size))}{why}")
    freed = sum(sizes.get(s, 0) for s in plan)
    if not plan:
        ui.print(f"nothing to delete: the policy {policy!r} keeps all {len(infos)} checkpoints")
        return 0
    question = f"delete {len(plan)} of {len(infos)} checkpoints ({human(freed)})?"
    if args.dry_run:
        ui.print(f"dry run: would {question[:-1]}")
        return 0
    if not args.yes:
        if not ui.interactive():
            raise UsageError(
                "refusing to delete without confirmation: stdin is not a terminal; "
                "pass --yes (or --dry-run to only see the plan)"
            )
        if not ui.confirm(question[0].upper() + question[1:]):
            raise Declined("nothing deleted")
    deleted = _delete(root, policy, set(plan))
    ui.print(
        f"deleted {len(deleted)} checkpoints, freed {human(sum(sizes.get(s, 0) for s in deleted))}"
    )
    return 0


def _delete(root: Path, policy: fc.RetentionPolicy, approved: set[int]) -> list[int]:
    """Delete under the writer lock, re-planned there: only steps shown and still doomed.

    A trainer that saved since the plan was shown may have changed which steps the
    policy keeps; deleting only the intersection never removes something the user
    was not shown, nor something that became worth keeping.
    """
    with fc.CheckpointManager(root, save=fc.never(), keep=fc.keep_all()) as mgr:
        doomed = [s for s in fc.plan_deletions(policy, mgr.infos()) if s in approved]
        for step in doomed:
            mgr.delete(step)
    return doomed


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt import demo

    root = Path(args.root) if args.root else demo.default_root()

    def progress(label: str, total: int) -> Progress:
        bar = ui.progress(label, total, unit="steps")
        bar.update(0, force=True)
        return bar

    ui.print(f"fckpt demo: train, SIGKILL, resume, compare; working in {root}")
    result = demo.run_demo(root, args.steps, args.crash_at, progress=progress, say=ui.print)
    ui.print("")
    ui.print(demo.format_report(result, ui.paint, ui.ascii_only))
    return 0 if result.identical else 1


# --------------------------------------------------------------------------- parser


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit status 2 (via main)."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _sub(
    subs: Any, name: str, summary: str, description: str, examples: str
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = subs.add_parser(
        name,
        help=summary,
        description=description,
        epilog="examples:\n" + examples,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    return parser


def _add_policy_flags(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument(
        "--keep-last",
        type=_positive,
        metavar="N",
        required=required,
        help="keep the N highest steps",
    )
    p.add_argument(
        "--keep-best",
        type=_positive,
        metavar="K",
        help="also keep the K checkpoints with the best --metric",
    )
    p.add_argument("--metric", metavar="M", help="metric name for --keep-best (e.g. val_loss)")
    p.add_argument(
        "--mode",
        choices=("min", "max"),
        default="min",
        help="whether lower or higher --metric is better (default: min)",
    )


def _add_ls(subs: Any) -> None:
    p = _sub(
        subs,
        "ls",
        "list the checkpoints of a root",
        "List the checkpoints under ROOT: step, save time, size, status, metrics, and\n"
        "which part of the retention policy keeps each one. The policy is read from\n"
        "the checkpoints' metadata when recorded there, or taken from the flags.\n"
        "Half-written (*.tmp-*), quarantined (*.corrupt-*) and uncommitted directories\n"
        "are listed too, with their status.",
        "  fckpt ls runs/exp1\n"
        "  fckpt ls runs/exp1 --verify                 # also re-check every checksum\n"
        "  fckpt ls runs/exp1 --keep-last 2 --keep-best 1 --metric val_loss\n"
        "  fckpt ls runs/exp1 --json | jq '.[].step'\n",
    )
    p.add_argument("root", help="directory holding step_* checkpoints")
    p.add_argument("--verify", action="store_true", help="re-read every byte (slow)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    _add_policy_flags(p, required=False)
    p.set_defaults(func=cmd_ls)


def _add_inspect(subs: Any) -> None:
    p = _sub(
        subs,
        "inspect",
        "show what a checkpoint holds (no tensor data is read)",
        "Show a checkpoint's tree: every tensor's dtype, shape and size, every\n"
        "non-tensor value, and the metadata. Only the manifest is read, so this is\n"
        "instant even for huge checkpoints.",
        "  fckpt inspect runs/exp1/step_000001000\n"
        "  fckpt inspect runs/exp1/step_000001000 --key optimizer/param_groups\n"
        "  fckpt inspect runs/exp1/step_000001000 --json | jq '.entries[].key'\n",
    )
    p.add_argument("path", help="a checkpoint directory")
    p.add_argument(
        "--key",
        metavar="PREFIX",
        help="only keys starting with PREFIX, nested keys joined by '/' (model/0.weight)",
    )
    p.add_argument("--json", action="store_true", help="print JSON for scripts")
    p.set_defaults(func=cmd_inspect)


def _add_verify(subs: Any) -> None:
    p = _sub(
        subs,
        "verify",
        "re-check every checksum of a checkpoint or of a whole root",
        "Re-read every byte and check every CRC32. Given a root, verify every committed\n"
        "checkpoint under it. Prints one line per damaged file or key.\n"
        "Exit status: 0 all intact, 1 damage found, 2 bad input.",
        "  fckpt verify runs/exp1/step_000001000\n"
        "  fckpt verify runs/exp1 --quiet || echo 'damaged!'\n",
    )
    p.add_argument("path", help="a checkpoint directory, or a root of checkpoints")
    p.add_argument("-q", "--quiet", action="store_true", help="print only damage and the total")
    p.set_defaults(func=cmd_verify)


def _add_diff(subs: Any) -> None:
    p = _sub(
        subs,
        "diff",
        "compare two checkpoints key by key",
        "Keys added (+) and removed (-) from A to B, tensors whose shape or dtype\n"
        "changed, non-tensor values that changed, and for every other tensor the\n"
        "maximum absolute difference (or nothing, if bit-identical). Both checkpoints\n"
        "are read in full.",
        "  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000\n"
        "  fckpt diff a/step_000000100 b/step_000000100 --exit-code && echo identical\n",
    )
    p.add_argument("a", help="the first checkpoint")
    p.add_argument("b", help="the second checkpoint")
    p.add_argument("--all", action="store_true", help="also list the identical keys")
    p.add_argument(
        "--exit-code", action="store_true", help="exit with status 1 when the checkpoints differ"
    )
    p.set_defaults(func=cmd_diff)


def _add_export(subs: Any) -> None:
    p = _sub(
        subs,
        "export",
        "write the weights as Hugging Face-style safetensors",
        "Write the tensors under --select as model.safetensors, or as shards plus\n"
        "model.safetensors.index.json when they exceed --max-shard-size. OUT appears\n"
        "atomically: complete or not at all. PATH may be a root: its newest\n"
        "checkpoint is exported.",
        "  fckpt export runs/exp1/step_000001000 weights/\n"
        "  fckpt export runs/exp1 weights/ --dtype bfloat16 --max-shard-size 2GB\n"
        "  fckpt export ckpt ema/ --select ema/model --overwrite\n",
    )
    p.add_argument("path", help="a checkpoint, or a root (its newest checkpoint)")
    p.add_argument("out", help="output directory (must not exist unless --overwrite)")
    p.add_argument(
        "--select",
        default="model",
        help="subtree holding the weights, nested keys joined by '/' (default: model)",
    )
    p.add_argument("--dtype", help="convert floating-point tensors (bfloat16, float16, ...)")
    p.add_argument(
        "--max-shard-size",
        default="5GB",
        metavar="SIZE",
        help="largest shard, e.g. 500MB, 5GB, 2GiB (default: 5GB)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace OUT atomically")
    p.set_defaults(func=cmd_export)


def _add_prune(subs: Any) -> None:
    p = _sub(
        subs,
        "prune",
        "delete the checkpoints a retention policy does not keep",
        "Show which checkpoints the policy keeps and which it deletes, ask, then\n"
        "delete crash-safely (renamed out of sight first) under the root's writer\n"
        "lock. The newest checkpoint is never deleted. Without a terminal, --yes is\n"
        "required.",
        "  fckpt prune runs/exp1 --keep-last 3 --dry-run\n"
        "  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss\n"
        "  fckpt prune runs/exp1 --keep-last 1 --yes\n",
    )
    p.add_argument("root", help="directory holding step_* checkpoints")
    _add_policy_flags(p, required=True)
    p.add_argument("-y", "--yes", action="store_true", help="do not ask for confirmation")
    p.add_argument("-n", "--dry-run", action="store_true", help="show the plan, delete nothing")
    p.set_defaults(func=cmd_prune)


def _add_demo(subs: Any) -> None:
    from functional_ckpt.demo import DEFAULT_STEPS

    p = _sub(
        subs,
        "demo",
        "train, SIGKILL, resume, and check the result is bit-identical",
        "Train a small model on generated data in a subprocess that checkpoints with a\n"
        "CheckpointManager (every_steps | every_secs | on_improve, keep_last | keep_best,\n"
        "async saves), SIGKILL it partway, resume it in a new process, run an\n"
        "uninterrupted reference alongside, and compare: per-step losses and final\n"
        "state must be bit-identical. About a minute on 2 CPU cores.\n"
        "Exit status 0 only when identical.",
        "  fckpt demo\n"
        "  fckpt demo --root /tmp/demo --steps 300 --crash-at 100\n"
        "  fckpt ls /tmp/demo/run/checkpoints     # then look at what it left\n",
    )
    p.add_argument("--root", help="working directory (default: a new temporary directory)")
    p.add_argument(
        "--steps",
        type=_positive,
        default=DEFAULT_STEPS,
        help=f"training steps (default: {DEFAULT_STEPS})",
    )
    p.add_argument(
        "--crash-at",
        type=_positive,
        metavar="STEP",
        help="step after which the first process is killed (default: 40%% of --steps)",
    )
    p.set_defaults(func=cmd_demo)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Look at, check, compare, export and prune functional_ckpt checkpoints.",
        epilog="examples:\n"
        "  fckpt demo                          # see train / crash / resume work\n"
        "  fckpt ls runs/exp1\n"
        "  fckpt inspect runs/exp1/step_000001000 --key model\n"
        "  fckpt verify runs/exp1\n"
        "  fckpt diff runs/exp1/step_000001000 runs/exp1/step_000002000\n"
        "  fckpt export runs/exp1 weights/ --dtype bfloat16\n"
        "  fckpt prune runs/exp1 --keep-last 3 --keep-best 2 --metric val_loss\n\n"
        "exit status: 0 ok, 1 damage found / not identical / declined, 2 bad input\n"
        "'fckpt COMMAND --help' shows each command's options. NO_COLOR=1 disables colours.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {fc.__version__}")
    subs = parser.add_subparsers(title="commands", dest="command", required=True, metavar="COMMAND")
    for add in (_add_ls, _add_inspect, _add_verify, _add_diff, _add_export, _add_prune, _add_demo):
        add(subs)
    return parser


# --------------------------------------------------------------------------- main


def _one_line(err: BaseException) -> str:
    """An exception as one line: multi-line messages joined, errno noise dropped."""
    if (
        isinstance(err, OSError)
        and err.strerror
        and err.filename
        and not isinstance(err, fc.CheckpointError)
    ):
        return f"{err.filename}: {err.strerror}"
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``fckpt`` and ``python -m functional_ckpt``; returns the exit status."""
    from functional_ckpt.demo import DemoError

    ui = UI()
    try:
        args = build_parser().parse_args(argv)
        status: int = args.func(args, ui)
        return status
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else 0
    except UsageError as e:
        ui.error(_one_line(e))
        return 2
    except Declined as e:
        ui.error(_one_line(e))
        return 1
    except (fc.CorruptCheckpoint, DemoError) as e:
        ui.error(_one_line(e))
        return 1
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (fc.CheckpointError, OSError, ValueError, TypeError) as e:
        ui.error(_one_line(e))
        return 2
    except KeyboardInterrupt:
        ui.error("interrupted")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
