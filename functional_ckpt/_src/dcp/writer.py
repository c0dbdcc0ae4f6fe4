"""A DCP ``StorageWriter`` whose checkpoints are this project's.

DCP's planning still runs, but the bytes are written by ``fc.save`` (in ``write_data``,
where DCP hands every rank's state over at once), the one writer that keeps the commit
protocol, the CRC32s and the manifest: there is no second writer to keep in step.
Non-tensor values are encoded by the codec or refused, naming the key: nothing is pickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from functional_ckpt._src.dcp.reader import Chosen
from functional_ckpt._src.save.api import save
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.storage.zstd import level_of
from functional_ckpt.errors import CheckpointError


class Writer(Chosen, StorageWriter):
    """Where ``dcp.save`` / ``dcp.async_save`` write a checkpoint of this format.

    ``path`` (or ``checkpoint_id=``), ``overwrite``, ``metadata`` and ``compression`` are
    ``fc.save``'s. Under ``torch.distributed`` create it on every rank: its checkpoint
    group is made there, on the calling thread. ``info`` is what the last save returned.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        overwrite: bool = False,
        metadata: Mapping[str, Any] | None = None,
        compression: str | None = None,
    ) -> None:
        super().__init__()
        level_of(compression, "Writer")  # a bad argument fails here, not in dcp.save
        self.compression = compression
        self.path = None if path is None else Path(path)
        self.overwrite = overwrite
        self.metadata = None if metadata is None else dict(metadata)
        self.info: CheckpointInfo | None = None
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            from functional_ckpt._src.distributed.groups import checkpoint_group

            checkpoint_group()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.path is None:
            raise CheckpointError(
                "functional_ckpt.integrations.dcp.Writer: no checkpoint path; pass Writer(path) "
                "or dcp.save(..., checkpoint_id=path)"
            )

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        assert self.path is not None  # set_up_storage_writer checked it
        self.info = save(
            self.path,
            planned_state(planner),
            overwrite=self.overwrite,
            metadata=self.metadata,
            per_rank=(),
            compression=self.compression,
        )
        done: Future[list[WriteResult]] = Future()
        done.set_result([])
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Nothing: ``write_data``'s save committed the checkpoint on every rank."""


def planned_state(planner: SavePlanner) -> dict[str, Any]:
    """The state DCP's planner holds, as the nested tree the caller passed to ``dcp.save``."""
    from torch.distributed.checkpoint._nested_dict import unflatten_state_dict

    flat = getattr(planner, "state_dict", None)
    if not isinstance(flat, Mapping):
        raise CheckpointError(
            f"functional_ckpt.integrations.dcp.Writer: the planner {type(planner).__name__} "
            "holds no state_dict; use DefaultSavePlanner (or a subclass of it)"
        )
    mappings = getattr(planner, "mappings", None)
    if getattr(planner, "flatten_state_dict", False) and mappings:
        return dict(unflatten_state_dict(dict(flat), mappings))
    return dict(flat)
