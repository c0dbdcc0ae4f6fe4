"""The read model every command starts from: what a path names (a root, a checkpoint,
a recording), the damage found in a checkpoint, and a root's sections (its checkpoints,
exports, branches, remote and memory tiers) as rows of plain data. ``fckpt ls``
prints them (``--json``: the rows; else a table per section), ``prune`` deletes by them.
The layout of a root is :mod:`functional_ckpt._src.root`'s; this adds the wording.
"""

from __future__ import annotations

import argparse
import functools
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import functional_ckpt as fc
from functional_ckpt._src.cli import tiers
from functional_ckpt._src.cli import ui as fmt
from functional_ckpt._src.cli.ui import PROG, UI, Column, Declined, Section, UsageError
from functional_ckpt._src.export.exports import export_infos
from functional_ckpt._src.format.header import record_of
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.format.naming import BRANCHES_DIR, is_temporary_name
from functional_ckpt._src.manager.provenance import Lineage, run_of
from functional_ckpt._src.policy.config import stored_spec
from functional_ckpt._src.policy.retention import union_parts
from functional_ckpt._src.root.listing import RootEntry, kept_by, newest_summary, root_entries
from functional_ckpt._src.root.rollback import branches
from functional_ckpt._src.root.run import read_run
from functional_ckpt._src.storage.usage import disk_bytes, shared_bytes
from functional_ckpt.errors import CheckpointNotFound, ConfigError, IncompleteCheckpoint

if TYPE_CHECKING:
    from functional_ckpt._src.recording.layout import Committed

__all__ = ["Verified", "problem_line", "verify_listed", "verify_one", "verify_rows"]
__all__ += ["COMMITTED", "cmd_ls", "cmd_prune", "kept_by", "newest_checkpoint", "read_recording"]
__all__ += ["retention_parts", "scan_root"]

#: Statuses of a committed checkpoint (``intact`` once ``--verify`` re-read it).
COMMITTED = ("ok", "damaged", "intact")


def is_checkpoint_dir(path: Path) -> bool:
    """Holds one checkpoint (ours, committed or not, or a stock DCP one), whatever its name."""
    return classify(path, by_name=False) in (Kind.COMMITTED, Kind.UNCOMMITTED, Kind.STOCK_DCP)


def refuse_stock_dcp(path: Path, command: str) -> None:
    """Say what a stock DCP checkpoint is and what to do instead of ``command``."""
    if classify(path) is Kind.STOCK_DCP:
        then = (
            "then fc.export_safetensors(state, OUT)"
            if command == "export"
            else f"then fc.save it and run '{PROG} {command}' on the saved copy"
        )
        raise UsageError(
            f"{path}: a stock torch.distributed.checkpoint directory, not a functional_ckpt "
            f"checkpoint: it records no tree of its values, so '{PROG} {command}' cannot read "
            "it on its own. In Python, restore it with a template "
            f"(state = fc.restore(path, like=fc.capture(model=model, ...))), {then}; "
            f"'{PROG} inspect {path}' shows what it holds"
        )


def require_exists(path: Path) -> None:
    if not path.exists():
        raise CheckpointNotFound(f"{path}: no such file or directory")


def scan_root(root: Path) -> list[RootEntry]:
    """Every checkpoint-related directory directly under ``root``, by step then name."""
    require_exists(root)
    if not root.is_dir():
        raise CheckpointNotFound(f"{root}: not a directory")
    if is_checkpoint_dir(root):
        raise UsageError(
            f"{root}: is a checkpoint, not a directory of checkpoints; try '{PROG} inspect {root}'"
        )
    return root_entries(root)


def newest_checkpoint(root: Path) -> Path:
    """``root`` itself if it is a checkpoint, else its newest committed, readable one."""
    if is_checkpoint_dir(root):
        return root
    scan_root(root)  # refuses what is no root of checkpoints
    newest = newest_summary(root)
    if newest is None:
        raise CheckpointNotFound(f"{root}: no committed checkpoint here")
    return newest.path


def is_damaged(row: RootEntry) -> bool:
    """Does listing alone find ``row`` damaged: an unreadable manifest, or a ``step_N``
    directory (a real name, not a save in progress) that lost its commit marker?"""
    return row.status == "damaged" or (row.status == "uncommitted" and row.canonical)


@dataclass(frozen=True)
class Verified:
    """One checkpoint's verdict: what ``verify`` prints of it."""

    where: str
    ok: bool
    problems: tuple[str, ...] = ()
    files_checked: int = 0
    bytes_checked: int = 0

    def print(self, emit: Callable[[str], None], ui: UI, quiet: bool) -> None:
        if self.ok:
            if not quiet:
                what = f"{self.files_checked} files, {fmt.human(self.bytes_checked)}"
                emit(f"{ui.paint('OK', 'ok')}       {self.where}  ({what})")
            return
        emit(f"{ui.paint('DAMAGED', 'bad')}  {self.where}")
        for line in self.problems:
            emit(f"  {line}")


def problem_line(path: Path | str, text: str) -> str:
    """``path: text``, naming the path once where the text starts with it (or a file in it)."""
    return text if text.startswith((f"{path}: ", f"{path}/")) else f"{path}: {text}"


def verify_one(path: Path) -> Verified:
    """The verdict on one checkpoint; damage never raises."""
    try:
        report = fc.verify(path)
    except (fc.errors.CorruptCheckpoint, fc.errors.UnsafeCheckpoint, IncompleteCheckpoint) as err:
        if isinstance(err, IncompleteCheckpoint) and is_temporary_name(path.name):
            raise
        return Verified(str(path), False, (problem_line(path, fmt.one_line(err)),))
    lines = [  # a file's problem is named by the file, a key's by the checkpoint and the key
        problem_line(path / p.where, p.detail) if p.file == p.where else problem_line(path, str(p))
        for p in report.problems
    ]
    return Verified(str(path), report.ok, tuple(lines), report.files_checked, report.bytes_checked)


def verify_listed(root: Path, path: Path) -> Verified | None:
    """:func:`verify_one` for a checkpoint listed under ``root``; None if it was pruned
    since the listing (a live root: its trainer prunes while this reads). A verdict
    other than intact is taken only once ``root`` is listed again with it still there."""
    try:
        result = verify_one(path)
    except fc.CheckpointError:
        result = None
    if result is not None and result.ok:
        return result
    if path not in [r.path for r in scan_root(root) if r.status in COMMITTED]:
        return None
    return verify_one(path) if result is None else result


def verify_rows(root: Path, rows: list[RootEntry], ui: UI) -> list[RootEntry]:
    """``ls --verify``: ``ok`` becomes ``intact`` or ``damaged``; a checkpoint pruned
    meanwhile is dropped, not taken for damage."""
    todo = [r for r in rows if r.status == "ok"]
    with ui.progress("verifying", sum(r.size for r in todo)) as bar:
        for row in todo:
            result = verify_listed(root, row.path)
            if result is None:
                rows = [r for r in rows if r is not row]
                continue
            row.status = "intact" if result.ok else "damaged"
            row.detail = (
                "" if result.ok else f"{len(result.problems)} problems: {result.problems[0]}"
            )
            bar.advance(row.size)
    return rows


def retention_parts(spec: object) -> list[tuple[str, fc.policy.RetentionPolicy]] | None:
    """A recorded retention spec as policy parts, one per ``|`` operand; None if not one.
    A spec is plain data of ``keep_*`` kinds only: nothing read from a checkpoint runs."""
    try:
        policy = fc.policy.retention_from_config(stored_spec(spec))
    except ConfigError:
        return None
    return [(repr(part), part) for part in union_parts(policy)]


def recorded_retention(rows: Sequence[RootEntry]) -> object | None:
    """The retention spec the newest checkpoint's manager recorded (``manager.keep``)."""
    specs = [record_of(r.metadata).raw.get("keep") for r in rows if r.status in ("ok", "intact")]
    return next((spec for spec in reversed(specs) if spec is not None), None)


def policy_from_flags(args: argparse.Namespace) -> list[tuple[str, Any]] | None:
    """``--keep-last N [--keep-best K --metric M [--mode max]]`` as policy parts."""
    if args.keep_best is not None and not args.metric:
        raise UsageError("--keep-best needs --metric NAME")
    for flag, given in (("--metric", args.metric), ("--mode", args.mode)):
        if given is not None and args.keep_best is None:
            raise UsageError(f"{flag}: only with --keep-best K, which keeps the best by it")
    parts = [fc.keep_last(args.keep_last)] if args.keep_last is not None else []
    if args.keep_best is not None:
        parts.append(fc.keep_best(args.keep_best, args.metric, mode=args.mode or "min"))
    return [(repr(p), p) for p in parts] or None


_STATUS_STYLE = {"ok": "ok", "intact": "ok", "damaged": "bad", "quarantined": "bad"}
_CHECKPOINTS: list[Column] = [("CHECKPOINT", fmt.cell("name"), ""), fmt.STEP, fmt.SAVED, fmt.SIZE]
_CHECKPOINTS += [("SHARED", lambda r: fmt.human(r["shared"]), "dim")]
_CHECKPOINTS += [("STATUS", fmt.cell("status"), lambda r: _STATUS_STYLE.get(r["status"], "warn"))]
METRICS: Column = ("METRICS", lambda r: fmt.metrics_text(r["metrics"]), "")
_CHECKPOINTS += [fmt.RUN, METRICS]
_CHECKPOINTS += [("KEPT BY", lambda r: ", ".join(r["kept_by"]) or r["detail"], lambda r: _why(r))]


def _why(row: dict[str, Any]) -> str:
    return "bad" if "deleted by" in (", ".join(row["kept_by"]) or row["detail"]) else "dim"


def _checkpoints(root: Path, rows: list[RootEntry], parts: Any) -> Section:
    # Another lineage's checkpoints are kept, as the manager keeps them (the same rule).
    ours = Lineage(read_run(root)).learn(r.metadata for r in rows).holds
    records = [
        fc.policy.CheckpointRecord(r.step, r.time or 0.0, r.metrics)
        for r in rows
        if r.status in ("ok", "intact") and r.canonical and r.step is not None and ours(r.metadata)
    ]
    kept: dict[Any, list[str]] = kept_by(parts or [], records)
    doomed = ["(deleted by the next prune)"] if parts else []
    foreign = ["another run's: never resumed nor deleted"]
    section = Section("", "", _CHECKPOINTS)
    for r in rows:
        wanted = r.canonical and r.status in ("ok", "intact")
        doomed_here = doomed if ours(r.metadata) else foreign
        row: dict[str, Any] = {"name": r.name, "path": str(r.path), "step": r.step}
        row |= {"status": r.status, "time": r.time, "size": r.size}
        row |= {"shared": shared_bytes(r.path), "metrics": fmt.jsonable(r.metrics)}
        row |= {"kept_by": (kept.get(r.step) or doomed_here) if wanted else [], "detail": r.detail}
        section.rows.append({**row, "run": run_of(r.metadata)})
    return section


def _exports(root: Path) -> Section | None:
    exports = export_infos(root)
    if not exports:
        return None
    title = f"(safetensors, under {exports[0].path.parent})"
    columns: list[Column] = [("EXPORT", lambda r: Path(r["path"]).name, ""), fmt.STEP]
    columns += [fmt.SAVED, fmt.SIZE, METRICS, ("FILES", _files, "dim")]
    section = Section("exports", title, columns)
    for e in exports:
        row: dict[str, Any] = {"kind": "export", "name": f"{e.path.parent.name}/{e.path.name}"}
        row["path"] = str(e.path)
        row |= {"step": e.step, "status": "export", "time": e.time, "size": e.size}
        section.rows.append({**row, "metrics": fmt.jsonable(e.metrics), "files": list(e.files)})
    return section


def _files(row: dict[str, Any]) -> str:
    side = [f for f in row["files"] if not f.startswith("model")]
    weights = len(row["files"]) - len(side)
    return ", ".join([f"{weights} weight file{'s' if weights != 1 else ''}", *side])


def _branches(root: Path) -> Section | None:
    columns: list[Column] = [("BRANCH", fmt.cell("name"), "")]
    columns += [("STEPS", lambda r: ", ".join(map(str, r["steps"])) or "-", "dim")]
    section = Section("branches", f"(kept aside by rollbacks; '{PROG} ls PATH' each)", columns)
    for name, steps in branches(root).items():
        where = f"{BRANCHES_DIR}/{name}"
        section.rows.append(
            {"kind": "branch", "name": where, "path": str(root / where), "steps": steps}
        )
    return section if section.rows else None


def cmd_ls(args: argparse.Namespace, ui: UI) -> int:
    """List a root; exit status 1 when a checkpoint in it is damaged (``--verify`` or not)."""
    if tiers.is_url(args.root):
        return tiers.ls_remote(args, ui)
    root = Path(args.root)
    if classify(root) is Kind.RECORDING:
        return _ls_recording(root, args, ui)
    rows = scan_root(root)
    if args.verify:
        rows = verify_rows(root, rows, ui)
    parts, source = policy_from_flags(args), "flags"
    if parts is None:
        parts = retention_parts(recorded_retention(rows))
        source = "recorded in the checkpoints"
    main = _checkpoints(root, rows, parts)
    below = [_exports(root), _branches(root), tiers.tiers(root, rows), tiers.memory(root)]
    shown = [s for s in below if s is not None]
    if args.json:
        ui.json([row for s in [main, *shown] for row in s.rows])
    elif not rows and not any(s.rows for s in shown if s.name != "tiers"):
        ui.print(f"{root}: no checkpoints")
    else:
        main.print(ui)
        committed = sum(r.status in COMMITTED for r in rows)
        total = disk_bytes([r.path for r in rows])  # a file shared by several counts once
        ui.print(f"\n{committed} committed checkpoints, {fmt.human(total)} in all")
        if parts:
            ui.print(f"retention ({source}): {' | '.join(label for label, _ in parts)}")
        else:
            ui.print(
                "retention: unknown (not recorded in the checkpoints); pass --keep-last N "
                "[--keep-best K --metric M] to see what a policy would keep"
            )
        for section in shown:
            section.print(ui)
    return 1 if any(is_damaged(r) for r in rows) else 0


def read_recording(path: Path) -> tuple[Committed, dict[str, Any]]:
    """A recording's committed records and what ``ls`` and ``inspect`` say of it (only its
    marker, header and index read)."""
    from functional_ckpt._src.format.manifest import TensorEntry
    from functional_ckpt._src.recording.replay import Replay  # numpy and torch

    with Replay(path) as replay:
        rec = replay.committed
    steps = rec.steps.tolist()
    doc = {"path": str(rec.path), "kind": "recording", "created": rec.header.get("created")}
    doc |= {"every": rec.header.get("every"), "records": len(steps)}
    doc |= {"first_step": steps[0] if steps else None, "last_step": steps[-1] if steps else None}
    doc |= {"leaves": len(rec.leaves), "data_bytes": sum(rec.segments)}
    doc["tensor_bytes_per_record"] = sum(e.nbytes for e in rec.leaves if isinstance(e, TensorEntry))
    doc |= {"file_bytes": rec.file_bytes, "uncommitted_bytes": rec.tail_bytes}
    return rec, {**doc, "metadata": rec.header.get("metadata")}


def recording_lines(doc: dict[str, Any], ui: UI) -> list[str]:
    span = "no records" if not doc["records"] else f"steps {doc['first_step']}..{doc['last_step']}"
    lines = [
        ui.paint(doc["path"], "head"),
        f"  recording, started {fmt.time_text(doc['created'])}, every {doc['every']} steps: "
        f"{doc['records']} committed records, {span}",
        f"  {doc['leaves']} leaves, {fmt.human(doc['tensor_bytes_per_record'])} of tensors per "
        f"record; {fmt.human(doc['data_bytes'])} of data written, {fmt.human(doc['file_bytes'])} "
        "in files",
    ]
    if doc["uncommitted_bytes"]:
        lines.append(
            f"  {fmt.human(doc['uncommitted_bytes'])} past the last commit (a crash's leftovers; "
            "not part of the recording)"
        )
    return lines


def _ls_recording(path: Path, args: argparse.Namespace, ui: UI) -> int:
    """A recording's committed records: each one's step and the bytes it added (a record
    shares every leaf that did not change with the one before)."""
    rec, doc = read_recording(path)
    added, leaves = rec.new_bytes()
    keys = ("step", "new_bytes", "new_leaves")
    rows = [
        dict(zip(keys, r, strict=True))
        for r in zip(rec.steps.tolist(), added.tolist(), leaves.tolist(), strict=True)
    ]
    if args.json:
        ui.json({**doc, "rows": rows})
        return 0
    columns: list[Column] = [fmt.STEP, ("NEW BYTES", lambda r: fmt.human(r["new_bytes"]), "")]
    ui.rows(
        [*columns, ("NEW LEAVES", lambda r: f"{r['new_leaves']}/{len(rec.leaves)}", "dim")], rows
    )
    for line in recording_lines(doc, ui):
        ui.print(line)
    return 0


def cmd_prune(args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root)
    if args.json and not (args.yes or args.dry_run):
        raise UsageError("--json: pass --yes or --dry-run too (a JSON run cannot ask)")
    rows = scan_root(root)
    parts = policy_from_flags(args)
    assert parts is not None  # --keep-last is required
    policy = functools.reduce(operator.or_, (p for _, p in parts))
    disk = fc.CheckpointManager(root, read_only=True).disk
    infos = disk.infos()
    if disk.lineage.unrelated:  # which run's history to prune is never guessed
        raise Declined(disk.lineage.unsure(root))
    kept = kept_by(parts, infos)  # a step no part keeps, nor "latest", is deleted
    plan = sorted(step for step, why in kept.items() if not why)
    sizes = {r.step: r.size for r in rows if r.canonical}
    checkpoints: list[dict[str, Any]] = [
        {"name": info.path.name, "path": str(info.path), "step": info.step}
        | {"action": "keep" if kept[info.step] else "delete"}
        | {"size": sizes.get(info.step, info.size), "kept_by": kept[info.step]}
        for info in infos
    ]
    doc = {"root": str(root), "policy": repr(policy), "dry_run": bool(args.dry_run)}
    doc |= {"checkpoints": checkpoints, "deleted": [], "freed": 0}
    if not infos and not args.json:
        ui.print(f"{root}: no committed checkpoints; nothing to prune")
        return 0
    if not args.json:
        for c in checkpoints:
            doomed = c["action"] == "delete"
            label = ui.paint("delete", "bad") if doomed else ui.paint("keep  ", "ok")
            why = "" if doomed else f"  ({', '.join(c['kept_by'])})"
            ui.print(f"{label}  {c['name']}  {fmt.human(c['size'])}{why}")
    freed = sum(sizes.get(s, 0) for s in plan)
    question = f"delete {len(plan)} of {len(infos)} checkpoints ({fmt.human(freed)})?"
    if not plan or args.dry_run:
        if args.json:
            ui.json(doc)
        elif not plan:
            ui.print(f"nothing to delete: the policy {policy!r} keeps all {len(infos)} checkpoints")
        else:
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
    # Deleted under the writer lock, re-planned there: only steps shown and still doomed
    # (a trainer that saved meanwhile may have changed what the policy keeps).
    with fc.CheckpointManager(root, save=fc.policy.never(), keep=fc.policy.keep_all()) as mgr:
        deleted = [s for s in fc.policy.plan_deletions(policy, mgr.disk.infos()) if s in set(plan)]
        for step in deleted:
            mgr.delete(step)
    freed = sum(sizes.get(s, 0) for s in deleted)
    if args.json:
        ui.json({**doc, "deleted": deleted, "freed": freed})
    else:
        ui.print(f"deleted {len(deleted)} checkpoints, freed {fmt.human(freed)}")
    return 0
