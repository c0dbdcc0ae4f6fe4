"""What ``fckpt ls ROOT`` shows below the checkpoints (exports, branches, where each
step lives with a remote tier, the memory tier), and remote URLs as arguments
(credentials from the environment or ``FCKPT_STORAGE_OPTIONS``, fsspec options as JSON).
The remote tier's reading side is imported only when a URL is given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import functional_ckpt as fc
from functional_ckpt._src.cli.ui import PROG, UI, UsageError, Verified, human, one_line, time_text
from functional_ckpt._src.export.exports import ExportInfo
from functional_ckpt._src.format.header import header_of
from functional_ckpt._src.format.naming import parse_step, step_name
from functional_ckpt._src.manager.provenance import run_of
from functional_ckpt._src.remote.uploader import read_status
from functional_ckpt._src.root.listing import RootEntry, committed_steps, read_info
from functional_ckpt._src.root.run import read_run
from functional_ckpt._src.storage.ram import holds_every_file, read_memory_status
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt.errors import CheckpointError, CheckpointNotFound

if TYPE_CHECKING:
    from functional_ckpt._src.remote.store import Store

__all__ = [
    "fetched",
    "is_url",
    "ls_remote",
    "memory_rows",
    "print_memory",
    "print_tiers",
    "tier_rows",
    "verify_remote",
]

OPTIONS_ENV = "FCKPT_STORAGE_OPTIONS"


def is_url(text: str) -> bool:
    return "://" in text


def open_store(url: str) -> Store:
    from functional_ckpt._src.remote.store import Store

    raw = os.environ.get(OPTIONS_ENV)
    try:
        options = json.loads(raw) if raw else {}
    except ValueError as e:
        raise UsageError(f"{OPTIONS_ENV}: not JSON ({e})") from None
    if not isinstance(options, dict):
        raise UsageError(f"{OPTIONS_ENV}: expected a JSON object of fsspec storage options")
    return Store(url, options)


def split_step(url: str) -> tuple[str, int | None]:
    """``(root URL, step)`` of a checkpoint URL; ``(url, None)`` for a root."""
    head, _, tail = url.rstrip("/").rpartition("/")
    step = parse_step(tail)
    return (head, step) if step is not None and "://" in head else (url, None)


@contextlib.contextmanager
def fetched(url: str, *, check: bool) -> Iterator[Path]:
    """The remote checkpoint ``url`` (``…/step_N``), downloaded into a temporary directory."""
    root, step = split_step(url)
    if step is None:
        raise UsageError(f"{url}: name one checkpoint (…/step_000000100), see 'fckpt ls {url}'")
    from functional_ckpt._src.remote.fetch import download

    with tempfile.TemporaryDirectory(prefix="fckpt-") as tmp:
        yield download(open_store(root), step, Path(tmp), check=check)


# --------------------------------------------------------------------------- ls


def tier_rows(root: Path, rows: Sequence[RootEntry]) -> tuple[str, list[dict[str, Any]]] | None:
    """(remote URL, one row per step: tier and note) for a root with a remote tier."""
    status = read_status(root)
    url = status.get("url")
    if not isinstance(url, str):
        return None
    local = {r.step for r in rows if r.canonical and r.committed and r.step is not None}
    failed = status.get("failed")
    failed = failed if isinstance(failed, dict) else {}
    try:
        listing = open_store(url).listing()
        error = ""
    except (CheckpointError, UsageError) as err:
        listing, error = {}, one_line(err)
    remote = {s for s, r in listing.items() if r.committed}
    partial = {s for s, r in listing.items() if not r.committed}
    out = []
    for step in sorted(local | set(listing)):
        note = ""
        if step in local and step in remote:
            tier = "both"
        elif step in remote:
            tier = "remote"
        elif step in local and step == status.get("uploading"):
            tier = "uploading"
        elif step in local:
            tier = "local"
            note = f"upload failed: {failed[str(step)]}" if str(step) in failed else ""
            note = note or ("upload pending" if step in partial or error else "")
        else:
            tier, note = "partial", "an interrupted upload (not a checkpoint)"
        out.append({"kind": "tier", "step": step, "tier": tier, "note": note})
    if error:
        out.append({"kind": "tier", "step": None, "tier": "unknown", "note": error})
    return url, out


def print_tiers(found: tuple[str, list[dict[str, Any]]] | None, ui: UI) -> None:
    if found is None:
        return
    url, rows = found
    ui.print(f"\n{ui.paint('tiers', 'head')} (remote {url})")
    cells = [["-" if r["step"] is None else str(r["step"]), r["tier"], r["note"]] for r in rows]
    styles = [["", "bad" if "failed" in r["note"] else "", "dim"] for r in rows]
    ui.table(["STEP", "TIER", "NOTE"], cells, styles)


def memory_rows(root: Path) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
    """(the memory tier's status, one row per checkpoint in its folder) for a root with one."""
    status = read_memory_status(root)
    folder = status.get("path")
    if not isinstance(folder, str):
        return None
    out = []
    replicas = status.get("replicas")
    this = read_run(root)
    for step, path in sorted(committed_steps(Path(folder)).items()):
        row = {"kind": "memory", "step": step, "path": str(path), "size": dir_size(path)}
        with contextlib.suppress(CheckpointError, OSError):
            run = run_of(read_info(path, step).metadata)  # which run each checkpoint is of
            row |= {"run": run, "this_run": this is not None and run == this.id}
        if isinstance(replicas, int):  # committed only once every replica was confirmed
            row |= {"replicas": replicas, "whole": holds_every_file(path)}
        out.append(row)
    return status, out


def _alive(status: dict[str, Any]) -> bool:
    """Whether the process that recorded ``status`` still runs (unknown on another host)."""
    pid = status.get("pid")
    if status.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def print_memory(found: tuple[dict[str, Any], list[dict[str, Any]]] | None, ui: UI) -> None:
    if found is None:
        return
    status, rows = found
    run = "closed"
    if status.get("open"):
        pid = status.get("pid")
        run = f"open by pid {pid}" if _alive(status) else f"left by pid {pid}, no longer running"
    ui.print(f"\n{ui.paint('memory tier', 'head')} ({status.get('path')}, {run})")
    if not rows:
        ui.print("  no checkpoints (a closed manager removes its memory tier)")
        return
    cells = []
    for r in rows:
        run = str(r.get("run"))[:8] + ("" if r.get("this_run") else " (another run)")
        cells.append([step_name(r["step"]), str(r["step"]), human(r["size"]), run])
    head = ["CHECKPOINT", "STEP", "SIZE", "RUN"]
    if "replicas" in rows[0]:
        head += ["REPLICAS", "HERE"]
        for cell, r in zip(cells, rows, strict=True):
            cell += [f"{r['replicas']} confirmed", "whole" if r["whole"] else "parts"]
    ui.table(head, cells, [[""] * len(head)] * len(rows))


def metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def print_branches(rows: Sequence[dict[str, Any]], ui: UI) -> None:
    if not rows:
        return
    ui.print(f"\n{ui.paint('branches', 'head')} (kept aside by rollbacks; '{PROG} ls PATH' each)")
    cells = [[r["name"], ", ".join(map(str, r["steps"])) or "-"] for r in rows]
    ui.table(["BRANCH", "STEPS"], cells, [["", "dim"]] * len(cells))


def print_exports(exports: Sequence[ExportInfo], ui: UI) -> None:
    if not exports:
        return
    ui.print(f"\n{ui.paint('exports', 'head')} (safetensors, under {exports[0].path.parent})")
    cells = []
    for e in exports:
        side = [f for f in e.files if not f.startswith("model")]
        weights = len(e.files) - len(side)
        what = f"{weights} weight file{'s' if weights != 1 else ''}"
        row = [e.path.name, str(e.step), time_text(e.time), human(e.size)]
        cells.append([*row, metrics_text(e.metrics), ", ".join([what, *side])])
    head = ["EXPORT", "STEP", "SAVED", "SIZE", "METRICS", "FILES"]
    ui.table(head, cells, [["", "", "dim", "", "", "dim"]] * len(cells))


def ls_remote(args: argparse.Namespace, ui: UI) -> int:
    """``fckpt ls URL``: the checkpoints of a remote root."""
    store = open_store(args.root)
    listing = store.listing()
    rows: list[dict[str, Any]] = []
    cells: list[list[str]] = []
    for step, entry in sorted(listing.items()):
        created, run = None, None
        if entry.committed:
            with contextlib.suppress(CheckpointError, ValueError):
                head = header_of(store.manifest(step)[1])
                created, run = head.created, run_of(head.metadata)
        size = sum(v for v in entry.objects.values() if v > 0)
        status = "ok" if entry.committed else "partial"
        rows.append({"step": step, "status": status, "time": created, "size": size, "run": run})
        cells.append(
            [step_name(step), str(step), time_text(created), human(size), status, (run or "-")[:8]]
        )
    if args.json:
        ui.json(rows)
        return 0
    if not rows:
        ui.print(f"{args.root}: no checkpoints")
        return 0
    columns = ["CHECKPOINT", "STEP", "SAVED", "SIZE", "STATUS", "RUN"]
    ui.table(columns, cells, [["", "", "dim", "", "", "dim"]] * len(rows))
    committed = sum(r["status"] == "ok" for r in rows)
    ui.print(f"\n{committed} committed checkpoints on {args.root}")
    return 0


# --------------------------------------------------------------------------- verify


def verify_remote(args: argparse.Namespace, ui: UI) -> int:
    """``fckpt verify URL``: download each checkpoint and check every byte."""
    from functional_ckpt._src.remote.fetch import download

    root, step = split_step(args.path)
    store = open_store(root)
    steps = (
        [step] if step is not None else sorted(s for s, r in store.listing().items() if r.committed)
    )
    if not steps:
        raise CheckpointNotFound(f"{args.path}: no committed checkpoints to verify here")
    results: list[Verified] = []
    for s in steps:
        where = store.where(s)
        with tempfile.TemporaryDirectory(prefix="fckpt-") as tmp:
            try:
                report = fc.verify(download(store, s, Path(tmp), check=False))
                problems = tuple(f"{where}/{p}" for p in report.problems)
                result = Verified(
                    where, report.ok, problems, report.files_checked, report.bytes_checked
                )
            except CheckpointError as err:
                result = Verified(where, False, (f"{where}: {one_line(err)}",))
        results.append(result)
        if not args.json:
            ui.verdict(ui.print, result, args.quiet)
    return ui.verified(args.path, results, args.json)
