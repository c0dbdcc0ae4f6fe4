"""``fckpt verify``: re-read every byte of one checkpoint, of a root or of a remote root;
one verdict per checkpoint, local or remote alike."""

from __future__ import annotations

import argparse
import functools
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import functional_ckpt as fc
from functional_ckpt._src.cli import listing, tiers
from functional_ckpt._src.cli.listing import COMMITTED, Verified, is_damaged, scan_root
from functional_ckpt._src.cli.ui import UI, one_line
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt.errors import CheckpointError, CheckpointNotFound

__all__ = ["cmd_verify"]


#: A checkpoint's size (what the progress bar advances by) and its verdict, when asked.
Check = tuple[int, Callable[[], Verified | None]]


def _targets(target: Path) -> tuple[list[Check], list[Verified], list[Path]]:
    """Checkpoints to verify under ``target`` (of a root: each skipped if pruned meanwhile),
    damage found by listing alone, and stock DCP dirs."""
    listing.require_exists(target)
    if listing.is_checkpoint_dir(target) or not target.is_dir():
        return [(dir_size(target), functools.partial(listing.verify_one, target))], [], []
    rows = scan_root(target)
    listed = functools.partial(listing.verify_listed, target)
    checks: list[Check] = [
        (r.size, functools.partial(listed, r.path)) for r in rows if r.status in COMMITTED
    ]
    broken = [
        Verified(str(r.path), False, (f"{r.path}: {r.detail}",))
        for r in rows
        if r.status == "uncommitted" and is_damaged(r)
    ]
    stock = [r.path for r in rows if r.status == "foreign"]
    if not checks and not broken and not stock:
        raise CheckpointNotFound(f"{target}: no checkpoints to verify here")
    return checks, broken, stock


def cmd_verify(args: argparse.Namespace, ui: UI) -> int:
    remote = tiers.is_url(args.path)
    where = args.path if remote else str(Path(args.path))
    checks, broken, stock = _remote(args.path) if remote else _targets(Path(args.path))
    results = list(broken)
    emit = (lambda line: None) if args.json else ui.print
    for result in broken:  # found by listing alone: one line each
        emit(f"{ui.paint('DAMAGED', 'bad')}  {result.problems[0]}")
    for path in stock:
        emit(
            f"{ui.paint('SKIPPED', 'warn')}  {path}: a stock torch.distributed.checkpoint "
            "directory records no checksums; it cannot be verified"
        )
    with ui.progress("verifying", sum(size for size, _ in checks)) as bar:
        for size, verified in checks:  # each result as soon as it is known
            found = verified()
            bar.advance(size)
            if found is not None:  # else pruned since the listing
                results.append(found)
                found.print(emit if args.json else bar.print, ui, args.quiet)
    return _summary(ui, where, results, args.json, stock)


def _remote(url: str) -> tuple[list[Check], list[Verified], list[Path]]:
    """``fckpt verify URL``: each checkpoint downloaded, then every byte checked."""
    from functional_ckpt._src.remote.fetch import download

    root, step = tiers.split_step(url)
    store = tiers.open_store(root)
    steps = (
        [step]
        if step is not None
        else [s for s, r in sorted(store.listing().items()) if r.committed]
    )
    if not steps:
        raise CheckpointNotFound(f"{url}: no committed checkpoints to verify here")

    def check(step: int) -> Verified:
        where = store.where(step)
        with tempfile.TemporaryDirectory(prefix="fckpt-") as tmp:
            try:
                report = fc.verify(download(store, step, Path(tmp), check=False))
            except CheckpointError as err:
                return Verified(where, False, (listing.problem_line(where, one_line(err)),))
        problems = tuple(f"{where}/{p}" for p in report.problems)
        return Verified(where, report.ok, problems, report.files_checked, report.bytes_checked)

    return [(0, functools.partial(check, s)) for s in steps], [], []


def _summary(
    ui: UI, target: str, results: Sequence[Verified], json: bool, stock: Sequence[Path] = ()
) -> int:
    """The last line or the JSON document; the exit status: 1 if any checkpoint is damaged."""
    bad, n = sum(not r.ok for r in results), len(results)
    if json:
        rows = [
            {"path": r.where, "status": s, "problems": list(r.problems)}
            | {"files_checked": r.files_checked, "bytes_checked": r.bytes_checked}
            for r, s in [(r, "intact" if r.ok else "damaged") for r in results]
            + [(Verified(str(p), False), "skipped") for p in stock]
        ]
        doc = {"path": target, "ok": not bad, "intact": n - bad, "damaged": bad}
        ui.json({**doc, "skipped": len(stock), "checkpoints": rows})
    else:
        unverified = f"; {len(stock)} stock DCP not verifiable" if stock else ""
        if bad:
            ui.print(f"{bad} of {n} checkpoints damaged{unverified}")
        elif not n:
            ui.print(f"no functional_ckpt checkpoint to verify{unverified}")
        else:
            ui.print(f"{n} checkpoint{'s' if n != 1 else ''} intact{unverified}")
    return 1 if bad else 0
