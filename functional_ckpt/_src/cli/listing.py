"""``fckpt ls``, ``verify`` and ``prune``: the commands about a root of checkpoints, and
finding the checkpoints a command is given.

The layout of a root (names, statuses, summaries) is :mod:`functional_ckpt._src.root`'s;
this adds the command line's wording.
"""

from __future__ import annotations

import argparse
import functools
import operator
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import functional_ckpt as fc
from functional_ckpt._src.cli import tiers
from functional_ckpt._src.cli.ui import (
    PROG,
    UI,
    Declined,
    UsageError,
    Verified,
    human,
    jsonable,
    one_line,
    time_text,
)
from functional_ckpt._src.export.exports import ExportInfo, export_infos
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.header import MANAGER_KEY
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.manager.provenance import Lineage, run_of
from functional_ckpt._src.policy.config import stored_spec
from functional_ckpt._src.policy.retention import union_parts
from functional_ckpt._src.root.listing import RootEntry, kept_by, newest_summary, root_entries
from functional_ckpt._src.root.rollback import branches
from functional_ckpt._src.root.run import read_run
from functional_ckpt._src.storage.usage import dir_size, disk_bytes, shared_bytes
from functional_ckpt.errors import CheckpointNotFound, ConfigError

__all__ = ["cmd_ls", "cmd_prune", "cmd_verify", "newest_checkpoint", "retention_parts"]

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
    require_exists(root)
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


# --------------------------------------------------------------------------- retention


def retention_parts(spec: object) -> list[tuple[str, fc.policy.RetentionPolicy]] | None:
    """A recorded retention spec as policy parts, one per ``|`` operand; None if not one.

    A spec is plain data of ``keep_*`` kinds only: nothing read from a checkpoint runs.
    """
    try:
        policy = fc.policy.retention_from_config(stored_spec(spec))
    except ConfigError:
        return None
    return [(repr(part), part) for part in union_parts(policy)]


def recorded_retention(rows: Sequence[RootEntry]) -> object | None:
    """The retention spec the newest checkpoint's manager recorded (``manager.keep``)."""
    for row in reversed(rows):
        if row.status not in ("ok", "intact"):  # "intact": re-read by --verify
            continue
        record = row.metadata.get(MANAGER_KEY)
        spec: object = record.get("keep") if isinstance(record, dict) else None
        if spec is not None:
            return spec
    return None


def policy_from_flags(
    args: argparse.Namespace,
) -> list[tuple[str, fc.policy.RetentionPolicy]] | None:
    """``--keep-last N [--keep-best K --metric M [--mode max]]`` as policy parts."""
    if args.keep_best is not None and not args.metric:
        raise UsageError("--keep-best needs --metric NAME")
    parts = [fc.keep_last(args.keep_last)] if args.keep_last is not None else []
    if args.keep_best is not None:
        parts.append(fc.keep_best(args.keep_best, args.metric, mode=args.mode))
    return [(repr(p), p) for p in parts] or None


# --------------------------------------------------------------------------- ls


def _verify_rows(root: Path, rows: list[RootEntry], ui: UI) -> list[RootEntry]:
    """Replace ``ok`` by ``intact`` or ``damaged`` after re-reading every byte; the rows
    still there (a checkpoint pruned meanwhile is dropped, not taken for damage)."""
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


def cmd_ls(args: argparse.Namespace, ui: UI) -> int:
    """List a root; exit status 1 when a checkpoint in it is damaged (``--verify`` or not)."""
    if tiers.is_url(args.root):
        return tiers.ls_remote(args, ui)
    root = Path(args.root)
    if classify(root) is Kind.RECORDING:
        from functional_ckpt._src.cli.recording import ls_recording  # numpy and torch

        return ls_recording(args, ui)
    rows = scan_root(root)
    if args.verify:
        rows = _verify_rows(root, rows, ui)
    source = "flags"
    parts = policy_from_flags(args)
    if parts is None:
        recorded = recorded_retention(rows)
        parts = retention_parts(recorded) if recorded is not None else None
        source = "recorded in the checkpoints"
    run = read_run(root)  # another lineage's checkpoints are kept, as the manager keeps them
    ours = Lineage(None if run is None else run.id).learn(r.metadata for r in rows).holds
    records = [
        fc.policy.CheckpointRecord(r.step, r.time or 0.0, r.metrics)
        for r in rows
        if r.status in ("ok", "intact") and r.canonical and r.step is not None and ours(r.metadata)
    ]
    kept = kept_by(parts or [], records)
    why = {
        r.name: ["another run's: never resumed nor deleted"] for r in rows if not ours(r.metadata)
    }
    for row in rows:
        if row.step in kept and row.canonical and row.status in ("ok", "intact"):
            why[row.name] = kept[row.step] or (["(deleted by the next prune)"] if parts else [])
    exports = export_infos(root)
    branched = [_branch_json(root, name, steps) for name, steps in branches(root).items()]
    remote = tiers.tier_rows(root, rows)  # where each step lives, with a remote tier
    memory = tiers.memory_rows(root)  # the checkpoints in RAM, with a memory tier
    if args.json:
        doc = [_row_json(r, why.get(r.name, [])) for r in rows]
        doc += [_export_json(e) for e in exports] + branched + (remote[1] if remote else [])
        doc += memory[1] if memory else []
        ui.json(doc)
    elif not rows and not exports and not branched and not (memory and memory[1]):
        ui.print(f"{root}: no checkpoints")
    else:
        _print_ls(rows, why, parts, source, ui)
        tiers.print_exports(exports, ui)
        tiers.print_branches(branched, ui)
        tiers.print_tiers(remote, ui)
        tiers.print_memory(memory, ui)
    return 1 if any(is_damaged(r) for r in rows) else 0


def _row_json(row: RootEntry, kept: list[str]) -> dict[str, Any]:
    return {
        "name": row.name,
        "path": str(row.path),
        "step": row.step,
        "status": row.status,
        "time": row.time,
        "size": row.size,
        "shared": shared_bytes(row.path),
        "metrics": jsonable(row.metrics),
        "kept_by": kept,
        "detail": row.detail,
        "run": run_of(row.metadata),
    }


def _branch_json(root: Path, name: str, steps: list[int]) -> dict[str, Any]:
    """A branch a rollback left (a root of its own) as a row of ``ls --json``."""
    where = f"{naming.BRANCHES_DIR}/{name}"
    return {"kind": "branch", "name": where, "path": str(root / where), "steps": steps}


def _export_json(e: ExportInfo) -> dict[str, Any]:
    """An export as a row of ``ls --json``: ``"kind": "export"`` tells it apart."""
    return {
        "kind": "export",
        "name": f"{e.path.parent.name}/{e.path.name}",
        "path": str(e.path),
        "step": e.step,
        "status": "export",
        "time": e.time,
        "size": e.size,
        "metrics": jsonable(e.metrics),
        "files": list(e.files),
    }


def _print_ls(
    rows: Sequence[RootEntry],
    kept: Mapping[str, list[str]],
    parts: Sequence[tuple[str, Any]] | None,
    source: str,
    ui: UI,
) -> None:
    head = ["CHECKPOINT", "STEP", "SAVED", "SIZE", "SHARED", "STATUS", "RUN", "METRICS", "KEPT BY"]
    cells: list[list[str]] = []
    styles: list[list[str]] = []
    for r in rows:
        why = ", ".join(kept[r.name]) if kept.get(r.name) else r.detail
        cells.append(
            [
                r.name,
                "-" if r.step is None else str(r.step),
                time_text(r.time),
                human(r.size),
                human(shared_bytes(r.path)),
                r.status,
                (run_of(r.metadata) or "-")[:8],
                tiers.metrics_text(r.metrics),
                why,
            ]
        )
        status = {"ok": "ok", "intact": "ok", "damaged": "bad", "quarantined": "bad"}
        bad = "bad" if "deleted by" in why else "dim"
        styles.append(["", "", "dim", "", "dim", status.get(r.status, "warn"), "dim", "", bad])
    ui.table(head, cells, styles)
    committed = [r for r in rows if r.status in COMMITTED]
    total = disk_bytes([r.path for r in rows])  # a file shared by several counts once
    ui.print(f"\n{len(committed)} committed checkpoints, {human(total)} in all")
    if parts:
        ui.print(f"retention ({source}): {' | '.join(label for label, _ in parts)}")
    else:
        ui.print(
            "retention: unknown (not recorded in the checkpoints); pass --keep-last N "
            "[--keep-best K --metric M] to see what a policy would keep"
        )


# --------------------------------------------------------------------------- verify


def _problem(path: Path, err: BaseException) -> str:
    """``path: message``, without naming the path twice when the message starts with it."""
    text = one_line(err)
    return text if text.startswith(f"{path}: ") else f"{path}: {text}"


def verify_one(path: Path) -> Verified:
    """The verdict on one checkpoint; damage never raises."""
    try:
        report = fc.verify(path)
    except (fc.errors.CorruptCheckpoint, fc.errors.UnsafeCheckpoint) as err:
        return Verified(str(path), False, (_problem(path, err),))
    except fc.errors.IncompleteCheckpoint as err:
        if naming.is_temporary_name(path.name):
            raise
        return Verified(str(path), False, (_problem(path, err),))
    lines = [
        f"{path / p.where if '/' not in p.where and (path / p.where).exists() else path}: {p}"
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


def _verify_targets(target: Path) -> tuple[list[Path], list[Verified], list[Path], bool]:
    """Checkpoints to verify under ``target``, damage found by listing alone, stock DCP
    dirs, and whether they were listed (``target`` is a root, whose checkpoints may be
    pruned meanwhile)."""
    if is_checkpoint_dir(target) or not target.is_dir():
        return [target], [], [], False
    rows = scan_root(target)
    paths = [r.path for r in rows if r.status in COMMITTED]
    broken = [
        Verified(str(r.path), False, (f"{r.path}: {r.detail}",))
        for r in rows
        if r.status == "uncommitted" and is_damaged(r)
    ]
    stock = [r.path for r in rows if r.status == "foreign"]
    if not paths and not broken and not stock:
        raise fc.errors.CheckpointNotFound(f"{target}: no checkpoints to verify here")
    return paths, broken, stock, True


def cmd_verify(args: argparse.Namespace, ui: UI) -> int:
    if tiers.is_url(args.path):
        return tiers.verify_remote(args, ui)
    target = Path(args.path)
    require_exists(target)
    paths, broken, stock, listed = _verify_targets(target)
    results = list(broken)
    emit = (lambda line: None) if args.json else ui.print
    for result in broken:  # found by listing alone: one line each
        emit(f"{ui.paint('DAMAGED', 'bad')}  {result.problems[0]}")
    for path in stock:
        emit(
            f"{ui.paint('SKIPPED', 'warn')}  {path}: a stock torch.distributed.checkpoint "
            "directory records no checksums; it cannot be verified"
        )
    with ui.progress("verifying", sum(dir_size(p) for p in paths)) as bar:
        for path in paths:  # each result as soon as it is known
            size = dir_size(path)
            found = verify_listed(target, path) if listed else verify_one(path)
            bar.advance(size)
            if found is not None:  # else pruned since the listing
                results.append(found)
                ui.verdict(emit if args.json else bar.print, found, args.quiet)
    return ui.verified(str(target), results, args.json, stock)


# --------------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root)
    if args.json and not (args.yes or args.dry_run):
        raise UsageError("--json: pass --yes or --dry-run too (a JSON run cannot ask)")
    rows = scan_root(root)
    parts = policy_from_flags(args)
    assert parts is not None  # --keep-last is required
    policy = functools.reduce(operator.or_, (p for _, p in parts))
    infos = fc.CheckpointManager(root, read_only=True).disk.infos()
    plan = fc.policy.plan_deletions(policy, infos) if infos else []
    kept = kept_by(parts, infos)
    sizes = {r.step: r.size for r in rows if r.canonical}
    doc: dict[str, Any] = {
        "root": str(root),
        "policy": repr(policy),
        "dry_run": bool(args.dry_run),
        "checkpoints": [
            {
                "name": info.path.name,
                "path": str(info.path),
                "step": info.step,
                "action": "delete" if info.step in plan else "keep",
                "size": sizes.get(info.step, info.size),
                "kept_by": [] if info.step in plan else kept[info.step],
            }
            for info in infos
        ],
        "deleted": [],
        "freed": 0,
    }
    if not infos and not args.json:
        ui.print(f"{root}: no committed checkpoints; nothing to prune")
        return 0
    if not args.json:
        for info in infos:
            doomed = info.step in plan
            label = ui.paint("delete", "bad") if doomed else ui.paint("keep  ", "ok")
            why = "" if doomed else f"  ({', '.join(kept[info.step])})"
            ui.print(f"{label}  {info.path.name}  {human(sizes.get(info.step, info.size))}{why}")
    freed = sum(sizes.get(s, 0) for s in plan)
    question = f"delete {len(plan)} of {len(infos)} checkpoints ({human(freed)})?"
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
    deleted = _delete(root, policy, set(plan))
    freed = sum(sizes.get(s, 0) for s in deleted)
    if args.json:
        ui.json({**doc, "deleted": deleted, "freed": freed})
        return 0
    ui.print(f"deleted {len(deleted)} checkpoints, freed {human(freed)}")
    return 0


def _delete(root: Path, policy: fc.policy.RetentionPolicy, approved: set[int]) -> list[int]:
    """Delete under the writer lock, re-planned there: only steps shown and still doomed
    (a trainer that saved meanwhile may have changed what the policy keeps)."""
    with fc.CheckpointManager(root, save=fc.policy.never(), keep=fc.policy.keep_all()) as mgr:
        doomed = [s for s in fc.policy.plan_deletions(policy, mgr.disk.infos()) if s in approved]
        for step in doomed:
            mgr.delete(step)
    return doomed
