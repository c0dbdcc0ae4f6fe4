"""Lightning checkpoints in this format: a ``CheckpointIO`` on ``fc.save``/``fc.restore``.

``Trainer(plugins=[FunctionalCheckpointIO()])`` makes every checkpoint Lightning
writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) a directory in this
project's format instead of a pickle, and ``trainer.fit(ckpt_path=...)`` resume
from one. Lightning's checkpoint dict is saved as it is: hyper-parameters holding
paths, namespaces, enums, datetimes or (registered) dataclasses round-trip as
tagged plain data. Loading rebuilds the dict from the manifest alone (no
template, nothing unpickled). Pruned checkpoints are removed through
:func:`functional_ckpt.manager.remove_checkpoint`, crash-safely.

With ``async_save=True`` a save returns once the tensors are copied, the writes
and commits run in the background in call order, and ``teardown`` (end of
``fit``) waits for them; a background failure is raised by the next call.

``last.ckpt`` never lags a committed checkpoint: a checkpoint ``ModelCheckpoint``
saves while it keeps a last one (its state in the dict names both) is committed
there first, then at its own path sharing the same files, so a crash between the
two leaves ``last.ckpt`` at least as new as every checkpoint beside it (a run's
very first checkpoint excepted: no last one is known yet). The first save into a
directory removes what killed saves of this format left there (uncommitted
``NAME.tmp-<id>`` directories) and recovers committed ones whose name is free; no
other file, and no committed checkpoint, is ever deleted.
"""

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


def _device(map_location: Any) -> torch.device | str | None:
    """The device a ``map_location`` names; storage-remapping callables have no meaning here."""
    if map_location is None or isinstance(map_location, str | torch.device):
        return map_location
    raise CheckpointError(
        f"FunctionalCheckpointIO.load_checkpoint(map_location={map_location!r:.60}): pass a "
        "device (torch.device or str) or None; tensors are read straight onto it"
    )


def _staged(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dict, its tensors copied to the host, for a write that comes later.

    The background write runs after training has changed the weights in place and
    Lightning the objects the dict refers to (hyper-parameters, callback state).
    A tensor reached twice (tied weights) is copied once.
    """
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


_MODEL_CHECKPOINT_KEYS = ("last_model_path", "best_model_path", "best_k_models")


def _last_to_follow(
    checkpoint: dict[str, Any], target: Path, queued: Callable[[Path], bool]
) -> Path | None:
    """The last checkpoint Lightning saves right after ``target``, if the dict names one.

    ``ModelCheckpoint`` records in the state it saves the checkpoint it is saving
    (``best_model_path``, or one of ``best_k_models``) and its last checkpoint
    (``last_model_path``), and writes the last one right after. Only a checkpoint
    beside ``target`` that this format wrote (committed, or ``queued`` to be)
    counts: a symbolic link (``save_last="link"``) is Lightning's to update, and a
    save of anyone else (``trainer.save_checkpoint``) is followed by none.
    """
    callbacks = checkpoint.get("callbacks")
    if not isinstance(callbacks, dict):
        return None
    for state in callbacks.values():
        if not isinstance(state, dict):
            continue
        last, best, top = (state.get(k) for k in _MODEL_CHECKPOINT_KEYS)
        saving = [best, *top] if isinstance(top, dict) else [best]
        if not isinstance(last, str) or not last:
            continue
        if not any(isinstance(p, str) and p and Path(p) == target for p in saving):
            continue
        path = Path(last)
        if path == target or path.parent != target.parent:
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
    """Lightning ``CheckpointIO`` writing and reading this project's checkpoint format.

    Each checkpoint is a directory at the path Lightning chooses (``…/epoch=0-step=8.ckpt``).
    ``async_save=True`` overlaps the write with training; staging copies the
    tensors first, so training may go on at once.
    """

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
        self._drain()  # none of this plugin's own saves is in flight there
        recover_beside(directory, stacklevel=4)
        self._cleaned.add(directory)

    def load_checkpoint(
        self,
        path: str | os.PathLike[str],
        map_location: Any = None,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """The checkpoint dict as Lightning wrote it; never unpickled, whatever ``weights_only``."""
        target = Path(path)
        self._wait(target)
        loaded = to_python(restore(target, device=_device(map_location)))
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

    def _wait(self, path: Path) -> None:
        """Wait for the saves up to the last one that writes ``path``."""
        for paths, pending in reversed(self._jobs):
            if path in paths:
                pending.exception()
                break
        self._reap()

    def _drain(self) -> None:
        if self._jobs:
            self._jobs[-1][1].exception()
        self._reap()

    def _reap(self) -> None:
        """Forget finished saves (they finish in call order); a failed one is raised now."""
        while self._jobs and self._jobs[0][1].done():
            _, pending = self._jobs.pop(0)
            pending.result()
