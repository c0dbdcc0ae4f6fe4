"""What every ``fckpt`` command shares: its two outcomes besides success, and finding checkpoints.

The layout of a root (names, statuses, summaries) is :mod:`functional_ckpt._src.root`'s;
this only adds the command line's wording.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.cli.ui import PROG, UI, human
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.text import joined_lines
from functional_ckpt.errors import CheckpointError, CheckpointNotFound

if TYPE_CHECKING:  # the listing (manifest views, the codec) loads once a command reads a root
    from functional_ckpt._src.root.listing import RootEntry

__all__ = [
    "Declined",
    "UsageError",
    "Verified",
    "is_checkpoint_dir",
    "is_damaged",
    "newest_checkpoint",
    "one_line",
    "print_json",
    "print_verified",
    "verify_json",
    "require_exists",
    "scan_root",
    "time_text",
]


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


def time_text(t: float | None) -> str:
    """A save time for a table; "-" when unknown or not representable."""
    if t is None or not math.isfinite(t) or t <= 0:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, ValueError, OSError):
        return "-"


def is_checkpoint_dir(path: Path) -> bool:
    """Holds one checkpoint (ours, committed or not, or a stock DCP one), whatever its name."""
    return classify(path, by_name=False) in (Kind.COMMITTED, Kind.UNCOMMITTED, Kind.STOCK_DCP)


def refuse_stock_dcp(path: Path, command: str) -> None:
    """Say what a stock DCP checkpoint is and what to do instead of ``command``."""
    then = {
        "export": "then fc.export_safetensors(state, OUT)",
        "diff": f"then fc.save it and run '{PROG} diff' on the saved copy",
    }.get(command, f"then fc.save it and run '{PROG} {command}' on the saved copy")
    if classify(path) is Kind.STOCK_DCP:
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
    from functional_ckpt._src.root.listing import root_entries

    return root_entries(root)


def newest_checkpoint(root: Path) -> Path:
    """``root`` itself if it is a checkpoint, else its newest committed, readable one."""
    require_exists(root)
    if is_checkpoint_dir(root):
        return root
    scan_root(root)  # refuses what is no root of checkpoints
    from functional_ckpt._src.root.listing import newest_summary

    newest = newest_summary(root)
    if newest is None:
        raise CheckpointNotFound(f"{root}: no committed checkpoint here")
    return newest.path


@dataclass(frozen=True)
class Verified:
    """One checkpoint's verdict, local or remote alike: what ``verify`` prints per checkpoint."""

    where: str
    ok: bool
    problems: tuple[str, ...] = ()
    files_checked: int = 0
    bytes_checked: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.where,
            "status": "intact" if self.ok else "damaged",
            "problems": list(self.problems),
            "files_checked": self.files_checked,
            "bytes_checked": self.bytes_checked,
        }


def is_damaged(row: RootEntry) -> bool:
    """Does listing alone find ``row`` damaged: an unreadable manifest, or a ``step_N``
    directory (a real name, not a save in progress) that lost its commit marker?"""
    return row.status == "damaged" or (row.status == "uncommitted" and row.canonical)


def print_json(ui: UI, doc: Any) -> None:
    """The one JSON document of a ``--json`` run: nothing else goes to stdout."""
    ui.print(json.dumps(doc, indent=2))


def verify_json(
    target: str, results: Sequence[Verified], skipped: Sequence[dict[str, Any]] = ()
) -> dict[str, Any]:
    """``verify --json``'s document, for a local path and a remote URL alike."""
    bad = sum(not r.ok for r in results)
    return {
        "path": target,
        "ok": not bad,
        "intact": len(results) - bad,
        "damaged": bad,
        "skipped": len(skipped),
        "checkpoints": [r.to_json() for r in results] + list(skipped),
    }


def print_verified(ui: UI, emit: Callable[[str], None], result: Verified, quiet: bool) -> bool:
    """``fckpt verify``'s lines for one checkpoint; True if damaged.

    ``emit`` prints a line (above a progress bar when one runs).
    """
    if result.ok:
        if not quiet:
            what = f"{result.files_checked} files, {human(result.bytes_checked)}"
            emit(f"{ui.paint('OK', 'ok')}       {result.where}  ({what})")
        return False
    emit(f"{ui.paint('DAMAGED', 'bad')}  {result.where}")
    for line in result.problems:
        emit(f"  {line}")
    return True
