"""Which folder in RAM a memory tier uses, so that no other user can plant or block it.

The default is ``/dev/shm/fckpt-<uid>-<secret>``, the secret kept in the root's run
record (its owner's only); any folder is verified (this user's, not a link, closed to
others) each time it is opened, and tied to its run by a mark, never by a path.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from pathlib import Path
from typing import Any

from functional_ckpt._src.log import warn
from functional_ckpt._src.root.listing import committed_steps
from functional_ckpt._src.root.run import RUN_FILE, Run
from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import CheckpointError, MemoryTierWarning

__all__ = ["MARK_FILE", "adopt", "check_apart", "default_folder", "own_folder", "report_others"]

#: In the tier's folder: the root and the run it belongs to.
MARK_FILE = ".memory-tier.json"
_SHM = Path("/dev/shm")


def default_folder(root: Path, run: Run) -> Path:
    """The run's folder under ``/dev/shm``, named by its secret."""
    if not _SHM.is_dir():
        raise CheckpointError(
            f"CheckpointManager({root}, memory=fc.manager.Memory()): this machine has no "
            "/dev/shm; give the tier a folder in RAM with Memory(path=...)"
        )
    return _SHM / f"fckpt-{os.getuid()}-{run.secret}"


def own_folder(folder: Path, *, private: bool) -> None:
    """Make ``folder`` (mode 0700) if missing; refuse it unless a directory of this user's,
    not a link, not writable by others (``private``: no access at all)."""
    with contextlib.suppress(FileExistsError):
        if not private:
            durable.make_dirs(folder.parent)
        os.mkdir(folder, 0o700)
    st = os.lstat(folder)
    mask = 0o077 if private else 0o022
    bad = [
        (stat.S_ISLNK(st.st_mode), "is a link"),
        (not stat.S_ISDIR(st.st_mode), "is not a directory"),
        (st.st_uid != os.getuid(), f"belongs to another user (uid {st.st_uid})"),
        (st.st_mode & mask, f"is open to other users (mode {stat.S_IMODE(st.st_mode):o})"),
    ]
    why = next((w for b, w in bad if b), None)
    if why is not None:
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the folder {why}; a memory tier's folder must be "
            "a directory of this user's that no other user can write (chmod go-w), not a link"
        )


def check_apart(folder: Path, root: Path) -> None:
    """Refuse a folder inside or around any root (retention of one would delete the
    other's checkpoints)."""
    a, b = os.path.realpath(folder), os.path.realpath(root)
    inside = [p for p in (Path(a), *Path(a).parents) if (p / RUN_FILE).exists()]
    around: list[Path] = []
    with contextlib.suppress(OSError):
        around = [Path(e.path) for e in os.scandir(a) if os.path.isfile(Path(e.path) / RUN_FILE)]
    if a == b or a.startswith(b + os.sep) or b.startswith(a + os.sep) or inside or around:
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the memory tier's folder must be apart from the "
            f"disk root {root} and from any other root ({', '.join(map(str, inside + around))}"
            "): neither inside the other"
        )


def adopt(folder: Path, root: Path, run: Run) -> None:
    """Mark ``folder`` as this run's; refuse (never empty) one holding checkpoints of
    another run, or of no known run."""
    mine = {"root": os.path.realpath(root), "run": run.id}
    theirs = opener.read_state(folder / MARK_FILE, "memory tier mark")
    if theirs == mine:
        return
    held = sorted(committed_steps(folder))
    if held:
        whose = (
            f"run {theirs.get('run')} of {theirs.get('root')}"
            if isinstance(theirs, dict)
            else "no memory tier of a known run"
        )
        raise CheckpointError(
            f"Memory(path={str(folder)!r}): the folder holds checkpoints (steps {held}) of "
            f"{whose}, not of this run ({run.id} of {root}); they are left as they are. "
            "Remove them, or give the tier another folder"
        )
    durable.replace_durably(folder / MARK_FILE, json.dumps(mine).encode(), sync=False)


def report_others(root: Path, run: Run, stacklevel: int) -> None:
    """Warn of this user's folders holding an earlier run of ``root`` (emptied by hand):
    never resumed nor removed."""
    real = os.path.realpath(root)
    with contextlib.suppress(OSError):
        for path in _SHM.glob(f"fckpt-{os.getuid()}-*"):
            mark: Any = opener.read_state(path / MARK_FILE, "memory tier mark")
            if not isinstance(mark, dict) or mark.get("root") != real or mark.get("run") == run.id:
                continue
            held = sorted(committed_steps(path))
            if held:
                warn(
                    f"{path}: memory-tier checkpoints (steps {held}) of an earlier run "
                    f"of {root} ({mark.get('run')}), whose run record is gone from the root; "
                    "a new run starts and they are not resumed. Remove the folder to free "
                    "its RAM",
                    MemoryTierWarning,
                    stacklevel=stacklevel,
                )
