"""Lightning checkpoints in this format: a ``CheckpointIO`` on ``fc.save``/``fc.restore``
(nothing pickled, pruning crash-safe; ``async_save=True`` commits in call order).

``last.ckpt`` never lags a committed checkpoint: it is committed first, sharing the
files. The first save into a directory recovers or removes what killed saves of this
format left there; nothing else is ever deleted."""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.root.delete import remove_checkpoint
from functional_ckpt._src.root.leftovers import recover_beside
from functional_ckpt._src.save.api import save
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.plan import check_destination, prepare_save
from functional_ckpt._src.save.staging import PendingSave, run_in_background
from functional_ckpt._src.state.tree import to_python
from functional_ckpt.errors import CheckpointError

__all__ = ["FunctionalCheckpointIO"]


def _staged(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dict, its tensors copied to the host once each, for a background
    write that runs after training and Lightning changed what the dict refers to."""
    tensors: dict[int, Any] = {}
    stack: list[Any] = [checkpoint]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            if id(item) not in tensors:
                tensors[id(item)] = item.detach().to("cpu", copy=True)
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return copy.deepcopy(checkpoint, memo=tensors)


def _last_to_follow(
    checkpoint: dict[str, Any], target: Path, queued: Callable[[Path], bool]
) -> Path | None:
    """The last checkpoint ``ModelCheckpoint`` saves right after ``target``, when the
    dict names ``target`` as best (or top-k) and a last one beside it that this
    format wrote (committed, or ``queued``); never a link (``save_last="link"``)."""
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return None
    for state in callbacks.values():
        if not isinstance(state, dict):
            continue
        last, best, top = (
            state.get(k) for k in ("last_model_path", "best_model_path", "best_k_models")
        )
        saving = [best, *top] if isinstance(top, dict) else [best]
        path = Path(last) if isinstance(last, str) and last else target
        if path == target or path.parent != target.parent:
            continue
        if not any(isinstance(p, str) and p and Path(p) == target for p in saving):
            continue
        if queued(path) or classify(path) is Kind.COMMITTED:
            return path
    return None


def _write(paths: list[Path], checkpoint: dict[str, Any]) -> CheckpointInfo:
    """Commit ``checkpoint`` at each path in order, sharing the first one's files."""
    info = save(paths[0], checkpoint, overwrite=True)
    for path in paths[1:]:
        info = save(path, checkpoint, overwrite=True, base=paths[0])
    return info


class FunctionalCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing and reading this project's checkpoint format, a
    directory at the path Lightning chooses; ``async_save=True`` overlaps the write
    with training."""

    def __init__(self, *, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self._jobs: list[tuple[frozenset[Path], PendingSave]] = []  # in call order
        self._cleaned: set[Path] = set()

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike[str], storage_options: Any = None
    ) -> None:
        if storage_options is not None:
            raise CheckpointError(
                f"{path}: FunctionalCheckpointIO takes no storage_options "
                f"(got {storage_options!r:.60})"
            )
        if topology().distributed:
            raise CheckpointError(
                f"{path}: FunctionalCheckpointIO saves from one process, and Lightning calls it "
                "on rank 0 only under multi-process strategies; use it with a single-process "
                "strategy, or save with fc.save on every rank (see docs/distributed.md)"
            )
        target = Path(path)
        self._reap()
        self._clean(target.parent)
        last = _last_to_follow(checkpoint, target, self._queued)
        paths = [target] if last is None else [last, target]
        if not self.async_save:
            _write(paths, checkpoint)
            return
        staged = _staged(checkpoint)
        # What the write would refuse is refused now, not later on its thread.
        for p in paths[:-1]:
            check_destination(p, overwrite=True)
        prepare_save(target, staged, None, overwrite=True)
        before = self._jobs[-1][1] if self._jobs else None

        def write(pending: PendingSave) -> CheckpointInfo:
            if before is not None:
                before.exception()  # commits in call order; its failure is its own
            return _write(paths, staged)

        self._jobs.append((frozenset(paths), run_in_background(target, write)))

    def _clean(self, directory: Path) -> None:
        """Once per directory, before the first save into it: what killed saves left."""
        if directory in self._cleaned:
            return
        self._wait()  # none of this plugin's own saves is in flight there
        recover_beside(directory, stacklevel=4)
        self._cleaned.add(directory)

    def load_checkpoint(
        self, path: str | os.PathLike[str], map_location: Any = None, weights_only: Any = None
    ) -> dict[str, Any]:
        """The checkpoint dict as Lightning wrote it; never unpickled, whatever ``weights_only``."""
        if not (map_location is None or isinstance(map_location, str | torch.device)):
            raise CheckpointError(  # storage-remapping callables have no meaning here
                f"FunctionalCheckpointIO.load_checkpoint(map_location={map_location!r:.60}): pass "
                "a device (torch.device or str) or None; tensors are read straight onto it"
            )
        target = Path(path)
        self._wait(target)
        loaded = to_python(restore(target, device=map_location))
        assert isinstance(loaded, dict)
        return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        target = Path(path)
        self._wait(target)  # and any queued save sharing its files: they write it first
        if target.is_symlink():  # ``save_last="link"``: the checkpoint it names stays
            target.unlink()
            return
        remove_checkpoint(target, missing_ok=True)

    def teardown(self) -> None:
        """Wait for every background save; raise the first failure."""
        jobs, self._jobs = self._jobs, []
        errors = [e for _, p in jobs if (e := p.exception()) is not None]
        if errors:
            raise errors[0]

    def _queued(self, path: Path) -> bool:
        return any(path in paths for paths, _ in self._jobs)

    def _wait(self, path: Path | None = None) -> None:
        """Wait for the saves up to the last one that writes ``path`` (None: every one)."""
        for paths, pending in reversed(self._jobs):
            if path is None or path in paths:
                pending.exception()
                break
        self._reap()

    def _reap(self) -> None:
        """Forget finished saves (they finish in call order); a failed one is raised now."""
        while self._jobs and self._jobs[0][1].done():
            _, pending = self._jobs.pop(0)
            pending.result()
