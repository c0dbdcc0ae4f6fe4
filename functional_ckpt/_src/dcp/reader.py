"""A DCP ``StorageReader`` of this project's checkpoints.

DCP's ``Metadata`` is derived from the authenticated manifest, so ``.metadata`` is never
unpickled; tensor chunks are served CRC-checked. DCP's planner unpickles a value's bytes,
so it is handed bytes made from the manifest's value, never bytes read from the files.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from functional_ckpt._src.format import dcp_metadata
from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.restore.dtensor import ManifestChunks
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint


class Chosen:
    """What the reader and the writer share: a checkpoint chosen by name, DCP's plans kept."""

    path: Path | None

    @property
    def checkpoint_id(self) -> Path | None:
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = Path(checkpoint_id)

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False  # chosen by name, never guessed from a path


class Reader(Chosen, StorageReader):
    """Where ``dcp.load`` reads a checkpoint of this format, vetted once per load."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        super().__init__()
        self.path = None if path is None else Path(path)
        self._tensors: ManifestChunks | None = None
        self._values: Callable[[str], bytes | None] = lambda fqn: None
        self._metadata: Metadata | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._close()
        super().reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._open()

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._open()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._open()
        tensors = self._tensors
        assert tensors is not None
        try:
            wanted = []
            for req in plan.items:
                if req.type != LoadItemType.BYTE_IO:
                    wanted.append(req)
                elif (data := self._values(req.storage_index.fqn)) is not None:
                    planner.load_bytes(req, io.BytesIO(data))
                else:
                    raise CorruptCheckpoint(
                        f"{tensors.root.path}: .metadata lists the value "
                        f"{req.storage_index.fqn!r}, which the manifest does not hold"
                    )
            tensors.read_data(LoadPlan(wanted), planner)
        finally:
            self._close()
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _open(self) -> Metadata:
        """Open and vet the checkpoint (once per load); its ``Metadata``, derived."""
        if self._tensors is not None and self._metadata is not None:
            return self._metadata
        if self.path is None:
            raise CheckpointError(
                "functional_ckpt.integrations.dcp.Reader: no checkpoint path; pass Reader(path) "
                "or dcp.load(..., checkpoint_id=path)"
            )
        ck = committed.open_checkpoint(self.path)
        try:
            parsed = committed.parsed(ck)
            groups = parsed.groups()
            values = dcpbytes.parse_byte_entries(ck.manifest, parsed.shared.file_sizes, ck.path)
            reader = ManifestChunks(ck, (e for group in groups for e in group))
            self._metadata = dcp_metadata.metadata_for(groups, values)
            shared = parsed.shared
            self._values = dcpbytes.from_manifest(
                [(p, shared.values[p]) for p, kind in shared.order if kind == "value"],
                set(reader.dtypes),
            )
        except BaseException:
            ck.close()
            raise
        self._tensors = reader
        return self._metadata

    def _close(self) -> None:
        if self._tensors is not None:
            self._tensors.root.close()
        self._tensors = None
        self._metadata = None
