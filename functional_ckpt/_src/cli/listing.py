"""``fckpt ls``, ``verify`` and ``prune``: the commands about a root of checkpoints."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import functional_ckpt as fc
from functional_ckpt._src.cli import tiers
from functional_ckpt._src.cli.common import (
    Declined,
    UsageError,
    Verified,
    is_checkpoint_dir,
    is_damaged,
    one_line,
    print_json,
    print_verified,
    require_exists,
    scan_root,
    time_text,
    verify_json,
)
from functional_ckpt._src.cli.ui import PROG, UI, human
from functional_ckpt._src.export.exports import ExportInfo, export_infos
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.header import MANAGER_KEY
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.format.naming import BRANCHES_DIR
from functional_ckpt._src.policy.config import retention_from_config, stored_spec
from functional_ckpt._src.policy.retention import union_parts
from functional_ckpt._src.root.listing import RootEntry, kept_by
from functional_ckpt._src.root.rollback import branches
from functional_ckpt._src.storage.usage import dir_size, disk_bytes, shared_bytes
from functional_ckpt.errors import ConfigError

__all__ = ["cmd_ls", "cmd_prune", "cmd_verify", "retention_parts", "verify_one"]

#: Statuses of a committed checkpoint (``intact`` once ``--verify`` re-read it).
COMMITTED = ("ok", "damaged", "intact")

# --------------------------------------------------------------------------- retention


def retention_parts(spec: object) -> list[tuple[str, fc.policy.RetentionPolicy]] | None:
    """Rebuild a recorded retention policy from its spec, one part per ``|`` operand.

    A spec is plain data (the configuration form) and only the ``keep_*`` kinds
    exist, so nothing read from a checkpoint can run; None for anything else.
    """
    try:
        policy = retention_from_config(stored_spec(spec))
    except ConfigError:
        return None
    return [(repr(part), part) for part in union_parts(policy)]


def recorded_retention(rows: Sequence[RootEntry]) -> object | None:
    """The spec of the retention policy the newest checkpoint says its writer used.

    A manager records it under ``metadata["manager"]["keep"]``.
    """
    for row in reversed(rows):
        if row.status not in ("ok", "intact"):  # "intact": re-read by --verify
            continue
        record = row.metadata.get(MANAGER_KEY)
        spec: object = record.get("keep") if isinstance(record, dict) else None
        if spec is not None:
            return spec
    return None


def _records(rows: Sequence[RootEntry]) -> list[fc.policy.CheckpointRecord]:
    return [
        fc.policy.CheckpointRecord(r.step, r.time or 0.0, r.metrics)
        for r in rows
        if r.status in ("ok", "intact") and r.canonical and r.step is not None
    ]


def policy_from_flags(
    args: argparse.Namespace,
) -> list[tuple[str, fc.policy.RetentionPolicy]] | None:
    """``--keep-last N [--keep-best K --metric M [--mode max]]`` as policy parts."""
    parts: list[tuple[str, fc.policy.RetentionPolicy]] = []
    if getattr(args, "keep_best", None) is not None and not getattr(args, "metric", None):
        raise UsageError("--keep-best needs --metric NAME")
    if getattr(args, "keep_last", None) is not None:
        policy = fc.keep_last(args.keep_last)
        parts.append((repr(policy), policy))
    if getattr(args, "keep_best", None) is not None:
        policy = fc.keep_best(args.keep_best, args.metric, mode=args.mode)
        parts.append((repr(policy), policy))
    return parts or None


def _union(
    parts: Sequence[tuple[str, fc.policy.RetentionPolicy]],
) -> fc.policy.RetentionPolicy:
    policy = parts[0][1]
    for _, more in parts[1:]:
        policy = policy | more
    return policy


# --------------------------------------------------------------------------- ls


def _metrics_text(metrics: Mapping[str, float]) -> str:
    return " ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))


def _status_style(status: str) -> str:
    return {"ok": "ok", "intact": "ok", "damaged": "bad", "quarantined": "bad"}.get(status, "warn")


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
    records = _records(rows)
    kept = kept_by(parts or [], records)
    why: dict[str, list[str]] = {}
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
        print_json(ui, doc)
    elif not rows and not exports and not branched and not (memory and memory[1]):
        ui.print(f"{root}: no checkpoints")
    else:
        _print_ls(rows, why, parts, source, ui)
        _print_exports(exports, ui)
        _print_branches(branched, ui)
        tiers.print_tiers(remote, ui)
        tiers.print_memory(memory, ui)
    return 1 if any(is_damaged(r) for r in rows) else 0


def _branch_json(root: Path, name: str, steps: list[int]) -> dict[str, Any]:
    """A branch a rollback left (a root of its own) as a row of ``ls --json``."""
    path = root / BRANCHES_DIR / name
    return {"kind": "branch", "name": f"{BRANCHES_DIR}/{name}", "path": str(path), "steps": steps}


def _print_branches(rows: Sequence[dict[str, Any]], ui: UI) -> None:
    if not rows:
        return
    ui.print(f"\n{ui.paint('branches', 'head')} (kept aside by rollbacks; '{PROG} ls PATH' each)")
    cells = [[r["name"], ", ".join(map(str, r["steps"])) or "-"] for r in rows]
    ui.table(["BRANCH", "STEPS"], cells, [["", "dim"]] * len(cells))


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
        "metrics": {k: v if math.isfinite(v) else repr(v) for k, v in e.metrics.items()},
        "files": list(e.files),
    }


def _print_exports(exports: Sequence[ExportInfo], ui: UI) -> None:
    if not exports:
        return
    ui.print(f"\n{ui.paint('exports', 'head')} (safetensors, under {exports[0].path.parent})")
    cells = []
    for e in exports:
        side = [f for f in e.files if not f.startswith("model")]
        weights = len(e.files) - len(side)
        what = f"{weights} weight file{'s' if weights != 1 else ''}"
        cells.append(
            [
                e.path.name,
                str(e.step),
                time_text(e.time),
                human(e.size),
                _metrics_text(e.metrics),
                ", ".join([what, *side]),
            ]
        )
    head = ["EXPORT", "STEP", "SAVED", "SIZE", "METRICS", "FILES"]
    ui.table(head, cells, [["", "", "dim", "", "", "dim"]] * len(cells))


def _row_json(row: RootEntry, kept: list[str]) -> dict[str, Any]:
    return {
        "name": row.name,
        "path": str(row.path),
        "step": row.step,
        "status": row.status,
        "time": row.time,
        "size": row.size,
        "shared": shared_bytes(row.path),
        "metrics": {k: v if math.isfinite(v) else repr(v) for k, v in row.metrics.items()},
        "kept_by": kept,
        "detail": row.detail,
    }


def _print_ls(
    rows: Sequence[RootEntry],
    kept: Mapping[str, list[str]],
    parts: Sequence[tuple[str, Any]] | None,
    source: str,
    ui: UI,
) -> None:
    head = ["CHECKPOINT", "STEP", "SAVED", "SIZE", "SHARED", "STATUS", "METRICS", "KEPT BY"]
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
                _metrics_text(r.metrics),
                why,
            ]
        )
        deleting = "deleted by" in why
        styles.append(
            ["", "", "dim", "", "dim", _status_style(r.status), "", "bad" if deleting else "dim"]
        )
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
    lines = [f"{path / p.where if _is_file(path, p.where) else path}: {p}" for p in report.problems]
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


def _is_file(path: Path, where: str) -> bool:
    return "/" not in where and (path / where).exists()


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
            if found is None:  # pruned since the listing
                continue
            result = found
            results.append(result)
            print_verified(ui, emit if args.json else bar.print, result, args.quiet)
    bad = sum(not r.ok for r in results)
    if args.json:
        skipped = [
            {
                "path": str(p),
                "status": "skipped",
                "problems": [],
                "files_checked": 0,
                "bytes_checked": 0,
            }
            for p in stock
        ]
        print_json(ui, verify_json(str(target), results, skipped))
        return 1 if bad else 0
    total = len(results)
    unverified = f"; {len(stock)} stock DCP not verifiable" if stock else ""
    if bad:
        ui.print(f"{bad} of {total} checkpoints damaged{unverified}")
        return 1
    if not total:
        ui.print(f"no functional_ckpt checkpoint to verify{unverified}")
        return 0
    ui.print(f"{total} checkpoint{'s' if total != 1 else ''} intact{unverified}")
    return 0


# --------------------------------------------------------------------------- prune


def cmd_prune(args: argparse.Namespace, ui: UI) -> int:
    root = Path(args.root)
    if args.json and not (args.yes or args.dry_run):
        raise UsageError("--json: pass --yes or --dry-run too (a JSON run cannot ask)")
    rows = scan_root(root)
    parts = policy_from_flags(args)
    assert parts is not None  # --keep-last is required
    policy = _union(parts)
    infos = fc.CheckpointManager(root, read_only=True).infos()
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
            print_json(ui, doc)
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
        print_json(ui, {**doc, "deleted": deleted, "freed": freed})
        return 0
    ui.print(f"deleted {len(deleted)} checkpoints, freed {human(freed)}")
    return 0


def _delete(root: Path, policy: fc.policy.RetentionPolicy, approved: set[int]) -> list[int]:
    """Delete under the writer lock, re-planned there: only steps shown and still doomed.

    A trainer that saved since the plan was shown may have changed which steps the
    policy keeps; deleting only the intersection never removes something the user
    was not shown, nor something that became worth keeping.
    """
    with fc.CheckpointManager(root, save=fc.policy.never(), keep=fc.policy.keep_all()) as mgr:
        doomed = [s for s in fc.policy.plan_deletions(policy, mgr.infos()) if s in approved]
        for step in doomed:
            mgr.delete(step)
    return doomed
