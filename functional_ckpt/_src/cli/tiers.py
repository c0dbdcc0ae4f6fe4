"""The remote and memory tiers of a root as ``fckpt ls`` shows them, and remote URLs as
arguments (credentials from the environment, fsspec options as JSON in
``FCKPT_STORAGE_OPTIONS``): the remote tier's reading side loads only for a URL."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.cli import ui as fmt
from functional_ckpt._src.cli.parser import is_url
from functional_ckpt._src.cli.ui import UI, Column, Section, UsageError
from functional_ckpt._src.format.naming import parse_step, step_name
from functional_ckpt._src.manager.provenance import run_of
from functional_ckpt._src.remote.uploader import read_status
from functional_ckpt._src.root.listing import RootEntry, committed_steps, read_info
from functional_ckpt._src.root.run import read_run
from functional_ckpt._src.storage.committed import header_named
from functional_ckpt._src.storage.ram import holds_every_file, read_memory_status
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint

if TYPE_CHECKING:
    from functional_ckpt._src.format.header import Header
    from functional_ckpt._src.remote.store import RemoteStep, Store

__all__ = ["fetched", "is_url", "ls_remote", "memory", "open_store", "split_step", "tiers"]

OPTIONS_ENV = "FCKPT_STORAGE_OPTIONS"


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


def tiers(root: Path, rows: Sequence[RootEntry]) -> Section | None:
    """Where each step lives, for a root with a remote tier: a remote copy is a local
    checkpoint's only where its commit marker is the local one (as the uploader compares)."""
    status = read_status(root)
    url = status.get("url")
    if not isinstance(url, str):
        return None
    local = {r.step: r.path for r in rows if r.canonical and r.committed and r.step is not None}
    failed = status.get("failed")
    failed = failed if isinstance(failed, dict) else {}
    try:
        store = open_store(url)
        listing, error = store.listing(), ""
    except (CheckpointError, UsageError) as err:
        listing, error = {}, fmt.one_line(err)
    remote = {s for s, r in listing.items() if r.committed}
    partial = {s for s, r in listing.items() if not r.committed}
    place: Column = ("TIER", fmt.cell("tier"), lambda r: "bad" if "failed" in r["note"] else "")
    columns = [fmt.STEP, place, ("NOTE", fmt.cell("note"), "dim")]
    section = Section("tiers", f"(remote {url})", columns)
    for step in sorted(local.keys() | set(listing)):
        note = _remote_head(store, step, local.get(step), listing)[1] if step in remote else ""
        if step in remote and step in local and not note:
            tier = "both"
        elif step in remote and step not in local:
            tier = "remote"
        elif step in local and step == status.get("uploading"):
            tier = "uploading"
        elif step in local:
            tier = "local"
            note = f"upload failed: {failed[str(step)]}" if str(step) in failed else note
            note = note or ("upload pending" if step in partial or error else "")
        else:
            tier, note = "partial", "an interrupted upload (not a checkpoint)"
        section.rows.append({"kind": "tier", "step": step, "tier": tier, "note": note})
    if error:
        section.rows.append({"kind": "tier", "step": None, "tier": "unknown", "note": error})
    return section


def _remote_head(
    store: Store, step: int, local: Path | None, listing: dict[int, RemoteStep]
) -> tuple[Header | None, str]:
    """A committed remote checkpoint's header and why it is damaged (renamed, say) or, with
    the ``local`` one of its step, no copy of it as the uploader decides (or is unread)."""
    from functional_ckpt._src.remote.protocol import differs

    try:
        head = header_named(store.manifest(step)[1], step, step_name(step))
        return head, differs(store, step, local, listing[step].objects, {}) if local else ""
    except (CheckpointError, ValueError, OSError) as err:  # damage, or (with ``local``) unread
        return None, fmt.one_line(err) if local or isinstance(err, CorruptCheckpoint) else ""


def _run(row: dict[str, Any]) -> str:
    if "run" not in row:  # unreadable, or named for another step than it records
        return "-"
    return str(row["run"])[:8] + ("" if row["this_run"] else " (another run)")


def _alive(status: dict[str, Any]) -> bool:
    """Whether the process that recorded ``status`` still runs (unknown on another host)."""
    pid = status.get("pid")
    if status.get("host") != socket.gethostname() or not isinstance(pid, int):
        return True
    try:
        os.kill(pid, 0)
    except OSError as err:  # no permission: another user's process, alive
        return not isinstance(err, ProcessLookupError)
    return True


def memory(root: Path) -> Section | None:
    """The checkpoints in the memory tier's folder, for a root with one."""
    status = read_memory_status(root)
    folder = status.get("path")
    if not isinstance(folder, str):
        return None
    replicas, this = status.get("replicas"), read_run(root)
    run, pid = "closed", status.get("pid")
    if status.get("open"):
        run = f"open by pid {pid}" if _alive(status) else f"left by pid {pid}, no longer running"
    columns: list[Column] = [("CHECKPOINT", lambda r: step_name(r["step"]), ""), fmt.STEP, fmt.SIZE]
    columns.append(("RUN", _run, ""))
    if isinstance(replicas, int):  # committed only once every replica was confirmed
        columns += [("REPLICAS", lambda r: f"{r['replicas']} confirmed", "")]
        columns += [("HERE", lambda r: "whole" if r["whole"] else "parts", "")]
    columns.append(("NOTE", fmt.cell("note"), "dim"))
    empty = "  no checkpoints (a closed manager removes its memory tier)"
    section = Section("memory tier", f"({folder}, {run})", columns, empty=empty)
    try:
        held = committed_steps(Path(folder))
    except CheckpointError as err:  # a file in its place: said as a folder gone is
        held, section.empty = {}, f"  {fmt.one_line(err)}"
    for step, path in sorted(held.items()):
        row = {"kind": "memory", "step": step, "path": str(path), "size": dir_size(path)}
        try:
            run_id = run_of(read_info(path, step).metadata)  # which run each checkpoint is of
            row |= {"run": run_id, "this_run": this is not None and run_id == this.id, "note": ""}
        except (CheckpointError, OSError) as err:
            row["note"] = fmt.one_line(err)
        if isinstance(replicas, int):
            row |= {"replicas": replicas, "whole": holds_every_file(path)}
        section.rows.append(row)
    return section


def ls_remote(args: argparse.Namespace, ui: UI) -> int:
    """``fckpt ls URL``: the checkpoints of a remote root (exit status 1 if one is damaged)."""
    store = open_store(args.root)
    columns: list[Column] = [("CHECKPOINT", lambda r: step_name(r["step"]), ""), fmt.STEP]
    columns += [fmt.SAVED, fmt.SIZE, ("STATUS", fmt.cell("status"), ""), fmt.RUN]
    section = Section("", "", [*columns, ("NOTE", fmt.cell("note"), "dim")])
    for step, entry in sorted(store.listing().items()):
        head, note = _remote_head(store, step, None, {}) if entry.committed else (None, "")
        created, run = (None, None) if head is None else (head.created, run_of(head.metadata))
        status = "damaged" if note else "ok" if entry.committed else "partial"
        size = sum(v for v in entry.objects.values() if v > 0)
        row = {"step": step, "status": status, "time": created, "size": size, "run": run}
        section.rows.append({**row, "note": note})
    if args.json:
        ui.json(section.rows)
    elif not section.rows:
        ui.print(f"{args.root}: no checkpoints")
    else:
        section.print(ui)
        committed = sum(r["status"] != "partial" for r in section.rows)
        ui.print(f"\n{committed} committed checkpoints on {args.root}")
    return 1 if any(r["status"] == "damaged" for r in section.rows) else 0
