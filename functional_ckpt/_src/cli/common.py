"""What every ``fckpt`` command shares: its two outcomes besides success, and finding checkpoints.

The layout of a root (names, statuses, summaries) is :mod:`functional_ckpt._src.root`'s;
this only adds the command line's wording.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from functional_ckpt._src.cli.ui import PROG, UI
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.root.listing import RootEntry, newest_summary, root_entries
from functional_ckpt.errors import CheckpointError, CheckpointNotFound

__all__ = [
    "Declined",
    "UsageError",
    "is_checkpoint_dir",
    "newest_checkpoint",
    "one_line",
    "print_verified",
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
    text = "; ".join(line.strip() for line in str(err).splitlines() if line.strip())
    return text or type(err).__name__


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


def print_verified(
    ui: UI,
    emit: Callable[[str], None],
    where: object,
    result: tuple[bool, Sequence[str], str],
    quiet: bool,
) -> bool:
    """``fckpt verify``'s lines for one checkpoint, local or remote alike; True if damaged.

    ``result`` is (intact, problem lines, summary); ``emit`` prints a line (above a
    progress bar when one runs).
    """
    ok, problems, what = result
    if ok:
        if not quiet:
            emit(f"{ui.paint('OK', 'ok')}       {where}  ({what})")
        return False
    emit(f"{ui.paint('DAMAGED', 'bad')}  {where}")
    for line in problems:
        emit(f"  {line}")
    return True
