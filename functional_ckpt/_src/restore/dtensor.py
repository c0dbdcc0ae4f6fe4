"""Restores into DTensor templates at any world size: DCP's load planner maps saved chunks
onto shards, served here from the manifest (no pickle), every byte checked."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.groups import as_checkpoint_error
from functional_ckpt._src.distributed.topology import is_dtensor
from functional_ckpt._src.format import dcp_metadata, parts
from functional_ckpt._src.format.blobs import lands_raw
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.manifest import Chunk, TensorEntry
from functional_ckpt._src.restore.read import region, require_grad
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.shards import read_tensors
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint


class ManifestChunks:
    """Serves DCP's load plans with chunks read as the manifest's ``entries`` place them."""

    def __init__(self, root: committed.Checkpoint, entries: Iterable[TensorEntry]) -> None:
        self.root = root
        self.chunks: dict[MetadataIndex, Chunk] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        for e in entries:
            self.dtypes[e.fqn] = e.dtype
            for c in e.chunks:
                self.chunks[MetadataIndex(e.fqn, torch.Size(c.offsets))] = c

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> None:
        """Read the chunks, file after file: each file is closed once its reads are done."""
        by_chunk: dict[int, tuple[Chunk, list[Any]]] = {}
        for req in plan.items:
            chunk = self.chunks[req.storage_index]
            by_chunk.setdefault(id(chunk), (chunk, []))[1].append(req)
        ordered = sorted(by_chunk.values(), key=lambda c: (c[0].file, c[0].data_offset))
        last = None
        try:
            for chunk, reqs in ordered:
                if last is not None and chunk.file != last:
                    self.root.release(last)
                last = chunk.file
                fqn = reqs[0].storage_index.fqn
                dtype = self.dtypes.get(fqn)
                if dtype is None:
                    raise CorruptCheckpoint(f"{self.root.path}: no tensor {fqn!r}")
                if len(reqs) == 1:  # the common case: the shard is the chunk saved
                    whole = _whole_target(chunk, reqs[0], planner, dtype)
                    if whole is not None:
                        read_chunk(self.root, chunk, dtype, fqn, out=whole)
                        planner.commit_tensor(reqs[0], whole)
                        continue
                data = read_chunk(self.root, chunk, dtype, fqn)
                for req in reqs:
                    target = planner.resolve_tensor(req).detach()
                    target.copy_(region(data, req.storage_offsets, req.lengths))
                    planner.commit_tensor(req, target)
        finally:
            self.root.release_all()


def _whole_target(
    chunk: Chunk, req: Any, planner: LoadPlanner, dtype: torch.dtype
) -> torch.Tensor | None:
    """Where ``req`` lands, if it is the whole of ``chunk`` and can be read straight into it."""
    if any(req.storage_offsets) or tuple(req.lengths) != tuple(chunk.sizes):
        return None
    target: torch.Tensor = planner.resolve_tensor(req).detach()
    usable = lands_raw(target, dtype) and tuple(target.shape) == tuple(chunk.sizes)
    return target if usable else None


def parts_needed(
    parsed: ParsedManifest,
    selected: Sequence[tuple[KeyPath, str]],
    wanted: Mapping[KeyPath, torch.Tensor],
) -> set[int]:
    """The parts of a split manifest this rank's DTensor shards meet (every part: a whole read)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    boxes: list[tuple[KeyPath, parts.Box | None]] = []
    for p, kind in selected:
        like = wanted.get(p)
        if kind != "tensor":
            continue
        if like is None or not is_dtensor(like):
            boxes.append((p, None))
            continue
        sizes, offsets = compute_local_shape_and_global_offset(
            like.shape,
            like.device_mesh,  # type: ignore[attr-defined]
            like.placements,  # type: ignore[attr-defined]
        )
        boxes.append((p, (tuple(offsets), tuple(sizes))))
    return parts_meeting(parsed, boxes)


def parts_meeting(
    parsed: ParsedManifest, boxes: Sequence[tuple[KeyPath, parts.Box | None]]
) -> set[int]:
    """The parts holding the chunks of split tensors these boxes meet (None: the whole tensor)."""
    split, n = parsed.split, parsed.parts
    need: set[int] = set()
    for p, box in boxes:
        e = parsed.tensors.get(p)
        source = None if e is None else (e.alias or p)
        if e is None or source not in split:
            continue
        if box is None:
            return set(range(n))
        offsets, sizes = box
        if all(sizes):
            dim = split[source]
            need.update(parts.overlapping(e.shape[dim], n, offsets[dim], sizes[dim]))
    return need


def read_sharded(
    ck: committed.Checkpoint,
    parsed: ParsedManifest,
    wanted: Mapping[KeyPath, torch.Tensor],
    group: Any,
    *,
    inplace: bool,
    error: BaseException | None = None,
) -> dict[KeyPath, torch.Tensor]:
    """The DTensor leaves of ``wanted`` read collectively; every rank calls it, with ``error``."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    what = f"restore {ck.path}"
    sharded: dict[KeyPath, torch.Tensor] = {}
    try:  # every step a rank can fail in is agreed on below, so none waits for it
        if error is not None:
            raise error
        sharded = {
            p: t if inplace else _fresh_dtensor(t) for p, t in wanted.items() if is_dtensor(t)
        }
        state_dict = {parsed.tensors[p].fqn: t for p, t in sharded.items()}
        if not all(t.dtype == parsed.tensors[p].dtype for p, t in sharded.items()):
            raise CheckpointError(f"{ck.path}: cast=True is not supported for DTensor leaves")
        # DCP's load needs no coordinator (its global plan is the local ones): each rank
        # plans and reads its own shards, without dcp.load's two object all-gathers
        entries = list(parsed.tensors.values())
        metadata = dcp_metadata.metadata_for([entries])
        planner = DefaultLoadPlanner()
        planner.set_up_planner(state_dict, metadata, dist.get_rank(group) == 0)
        (plan,) = planner.create_global_plan([planner.create_local_plan()])
        ManifestChunks(ck, entries).read_data(planner.finish_plan(plan), planner)
    except BaseException as e:
        error = as_checkpoint_error(e, what)
    groups.agree(error, group, what)  # every rank read its shards, or all fail
    for p, t in sharded.items():
        require_grad(t, wanted[p], inplace, False)
    return sharded


def _fresh_dtensor(like: Any) -> torch.Tensor:
    """A new, uninitialised DTensor with the mesh, placements and global shape of ``like``."""
    from torch.distributed.tensor import DTensor

    local = torch.empty_like(like.to_local(), requires_grad=False)
    mesh, placements = like.device_mesh, like.placements
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def read_chunk(
    root: committed.Checkpoint,
    chunk: Chunk,
    dtype: torch.dtype,
    what: str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One stored chunk as a new tensor, or read straight into ``out``, every byte checked."""
    data = torch.empty(chunk.sizes, dtype=dtype) if out is None else out
    if chunk.nbytes:
        res = read_tensors(root.fd(chunk.file), [(chunk, data)])[0]
        if res is not None:
            raise CorruptCheckpoint(
                f"{root.path}: damaged tensor data for {what!r} in {chunk.file}: {res}"
            )
    return data
