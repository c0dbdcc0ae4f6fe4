"""Lightning checkpoints in this format: a ``CheckpointIO`` on ``fc.save``/``fc.restore``.

``Trainer(plugins=[FunctionalCheckpointIO()])`` makes every checkpoint Lightning
writes (``ModelCheckpoint``, ``trainer.save_checkpoint``) a directory in this
project's format instead of a pickle, and ``trainer.fit(ckpt_path=...)`` resume
from one. Lightning's checkpoint dict is saved as it is: hyper-parameters holding
paths, namespaces, enums, datetimes or (registered) dataclasses round-trip as
tagged plain data. Loading rebuilds the dict from the manifest alone (no
template, nothing unpickled). Pruned checkpoints are removed through
:func:`functional_ckpt.checkpoint.remove`, crash-safely.

With ``async_save=True`` a save returns once the tensors are staged (copied), the
write and commit run in the background, and ``teardown`` (end of ``fit``) waits
for them; a background failure is raised by the next call.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.root.delete import remove_checkpoint
from functional_ckpt._src.save.api import save, save_async
from functional_ckpt._src.save.staging import PendingSave
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


def _detached(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """A copy of the dict's containers and values that shares its tensors.

    An async save encodes plain values when it writes, after Lightning may have
    changed objects the dict refers to (hyper-parameters, callback state).
    """
    tensors: dict[int, Any] = {}
    stack: list[Any] = [checkpoint]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            tensors[id(item)] = item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return copy.deepcopy(checkpoint, memo=tensors)


class FunctionalCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing and reading this project's checkpoint format.

    Each checkpoint is a directory at the path Lightning chooses (``…/epoch=0-step=8.ckpt``).
    ``async_save=True`` overlaps the write with training; staging copies the
    tensors first, so training may go on at once.
    """

    def __init__(self, *, async_save: bool = False) -> None:
        super().__init__()
        self.async_save = async_save
        self._pending: dict[Path, PendingSave] = {}

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
        self._wait(target)  # two saves to one path commit in call order
        if not self.async_save:
            save(target, checkpoint, overwrite=True)
            return
        pending = save_async(target, _detached(checkpoint), overwrite=True)
        self._pending[target] = pending
        pending.wait_staged()

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
        self._wait(target)
        if target.is_symlink():  # ``save_last="link"``: the checkpoint it names stays
            target.unlink()
            return
        remove_checkpoint(target, missing_ok=True)

    def teardown(self) -> None:
        """Wait for every background save; raise the first failure."""
        pending, self._pending = self._pending, {}
        errors = [e for p in pending.values() if (e := p.exception()) is not None]
        if errors:
            raise errors[0]

    def _wait(self, path: Path) -> None:
        pending = self._pending.pop(path, None)
        if pending is not None:
            pending.result()

    def _reap(self) -> None:
        """Forget finished saves; a failed one is raised now rather than never."""
        for path, pending in list(self._pending.items()):
            if pending.done():
                del self._pending[path]
                pending.result()
