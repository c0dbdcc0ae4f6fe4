"""The operations whose crash states are explored, each on a root of committed steps.

Each builds a manager root with steps 1 and 2 (through a ``CheckpointManager``, as
training would), then records one operation on it: a manager's save (sync or
async), a pruning save (``keep_last``), a deletion (``root/delete``), an overwrite
(with and without the atomic exchange), an incremental save (hard links to its
base, or copies where no link can be made), a safetensors export and a rollback
(the newer step moved to a branch, or deleted). ``python -m tests.crash_operations``
explores all of them and prints the counts that docs/reliability.md quotes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import functional_ckpt as fc
from functional_ckpt._src.storage import commit
from tests.crash_explorer import Report, explore
from tests.crash_record import Recorder


def state(version: int) -> dict[str, Any]:
    """A small training state; ``frozen`` never changes (an incremental save links it)."""
    return {
        "model": {"w": torch.full((8, 8), float(version)), "frozen": torch.arange(256.0)},
        "optimizer": {"m": torch.full((8,), float(version))},
        "step": version,
        "note": f"version {version}",
    }


@contextlib.contextmanager
def no_exchange() -> Iterator[None]:
    """As on a file system without ``renameat2(RENAME_EXCHANGE)`` (NFS, FUSE, macOS)."""
    real = commit._RENAMEAT2
    commit._RENAMEAT2 = None
    try:
        yield
    finally:
        commit._RENAMEAT2 = real


def _save(mgr: fc.CheckpointManager) -> None:
    mgr.maybe_save(state(3), step=3, force=True)


def _delete(mgr: fc.CheckpointManager) -> None:
    mgr.delete(1)


def _overwrite(mgr: fc.CheckpointManager) -> None:
    fc.save(mgr.path(2), state(5), overwrite=True)


def _overwrite_no_exchange(mgr: fc.CheckpointManager) -> None:
    with no_exchange():
        _overwrite(mgr)


def _incremental(mgr: fc.CheckpointManager) -> None:
    fc.save(mgr.path(3), state(3), base=mgr.path(2))


def _incremental_copies(mgr: fc.CheckpointManager) -> None:
    """As across file systems: no hard link, the base's file copied (``copy_file_range``)."""
    real = os.link

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "cross-device link")

    os.link = refuse
    try:
        _incremental(mgr)
    finally:
        os.link = real


def _export(mgr: fc.CheckpointManager) -> None:
    fc.export_safetensors(state(2), mgr.root / "exports" / "step_000000002")


def _rollback_branch(mgr: fc.CheckpointManager) -> None:
    mgr.rollback(1)  # step 2 goes to a branch


def _rollback_delete(mgr: fc.CheckpointManager) -> None:
    mgr.rollback(1, newer="delete")


def _save_async(mgr: fc.CheckpointManager) -> None:
    _save(mgr)
    mgr.wait()


#: name -> (the manager's keyword arguments, the operation)
OPERATIONS: dict[str, tuple[dict[str, Any], Callable[[fc.CheckpointManager], None]]] = {
    "save (manager)": ({}, _save),
    "async save (manager, async_save=True)": ({"async_save": True}, _save_async),
    "pruning save (keep_last=2)": ({"keep": fc.keep_last(2)}, _save),
    "delete (root/delete)": ({}, _delete),
    "overwrite (RENAME_EXCHANGE)": ({}, _overwrite),
    "overwrite (two renames)": ({}, _overwrite_no_exchange),
    "incremental save (hard links)": ({}, _incremental),
    "incremental save (copies)": ({}, _incremental_copies),
    "safetensors export": ({}, _export),
    "rollback (newer steps to a branch)": ({}, _rollback_branch),
    "rollback (newer steps deleted)": ({}, _rollback_delete),
}


def record(base: Path, name: str) -> Recorder:
    """Build a root of steps 1 and 2 under ``base`` and record operation ``name`` on it."""
    options, operation = OPERATIONS[name]
    root = base / "root"
    with fc.CheckpointManager(root, **options) as mgr:
        for step in (1, 2):
            mgr.maybe_save(state(step), step=step, force=True)
        mgr.wait()  # an async save committed before the recording starts
        with Recorder(root) as rec:
            operation(mgr)
    return rec


def run(name: str, base: Path, *, seed: int = 0) -> tuple[Recorder, Report]:
    """Record ``name`` and explore its crash states in ``base`` (which must be empty)."""
    rec = record(base, name)
    memory = Path("/dev/shm")  # the checks fsync a lot: in memory where it exists
    with (
        tempfile.TemporaryDirectory(dir=memory if memory.is_dir() else base) as scratch,
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore", fc.errors.LeftoverWarning)  # recovery is expected
        return rec, explore(name, rec, Path(scratch), seed=seed)


def main() -> int:
    failed = 0
    for name in OPERATIONS:
        with tempfile.TemporaryDirectory() as tmp:
            _, report = run(name, Path(tmp))
        print(report.line())
        for failure in report.failures[:1]:
            print(failure)
        failed += bool(report.failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
