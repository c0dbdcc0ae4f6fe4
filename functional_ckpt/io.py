"""save, restore, inspect, verify: the pure functions between a state and a directory.

save:    state -> flatten -> write shards -> DCP metadata -> manifest -> commit
restore: manifest -> match ``like`` -> read into new tensors (or ``out``'s) -> unflatten -> lock
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.storage.usage import sharing
from functional_ckpt.errors import CheckpointError
from functional_ckpt.pipeline.restore import is_stock_dcp
from functional_ckpt.pipeline.restore import restore as pipeline_restore
from functional_ckpt.pipeline.save import save as pipeline_save
from functional_ckpt.reader import Reshard, open_checkpoint
from functional_ckpt.summary import CheckpointSummary, TensorSpec, insert, node_of
from functional_ckpt.writer import DEFAULT_PER_RANK, CheckpointInfo


def save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
    base: PathLike | None = None,
) -> CheckpointInfo:
    """Write ``state`` to the directory ``path``, atomically and durably.

    When this returns, the checkpoint is on disk (fsynced) and complete; before it
    returns, ``path`` is either absent or still the previous checkpoint. Under an
    initialized process group every rank calls it with its own state (see the
    multi-rank guide); ``per_rank`` names the top-level subtrees stored per rank.
    With ``base`` (a committed checkpoint), bytes unchanged since the base are
    not written again but shared with it; the result is still self-contained.
    """
    return pipeline_save(
        path, state, metadata=metadata, overwrite=overwrite, per_rank=per_rank, base=base
    )


State = TensorDictBase | Mapping[str, Any]


def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    allow_pickle: bool = False,
    reshard: Reshard | None = None,
    template: State | None = None,
) -> TensorDict:
    """Read a checkpoint back as a new locked TensorDict.

    A pure function of the files and ``like``: ``like`` only says which keys to read
    and each tensor's dtype and device (``meta`` leaves land on ``device``, default
    CPU; DTensor leaves get fresh shards on their mesh and placements). Nothing
    ``like`` refers to is ever written, also when the restore fails, so a state
    captured from a live model stays the model's until ``fc.apply``. Without
    ``like`` the whole tree is rebuilt from the manifest.

    ``out=state`` is the explicit in-place mode for memory-tight restores: bytes go
    straight into ``out``'s tensors and the result holds them; if it fails, their
    contents are unspecified. ``template=`` is the deprecated spelling of ``like=``.
    """
    like = like_argument(like, out, template, "fc.restore")
    return pipeline_restore(
        Path(path),
        like,
        out=out,
        device=device,
        partial=partial,
        cast=cast,
        allow_pickle=allow_pickle,
        reshard=reshard,
    )


def like_argument(
    like: State | None, out: State | None, template: State | None, what: str
) -> State | None:
    """Check that at most one of ``like``/``out`` is given; accept ``template=`` as ``like=``."""
    if template is not None:
        like = _deprecated_template(like, template, what)
    if like is not None and out is not None:
        raise CheckpointError(
            f"{what}: pass like= (a new state is returned) or out= (restore in place), not both"
        )
    return like


def _deprecated_template(like: State | None, template: State, what: str) -> State:
    warnings.warn(
        f"{what}(template=...) is deprecated: pass like= (a new state is returned, the "
        "template is not written) or out= (restore in place)",
        DeprecationWarning,
        stacklevel=4,
    )
    if like is not None:
        raise CheckpointError(f"{what}: pass like= or its old name template=, not both")
    return template


def inspect(path: PathLike) -> CheckpointSummary:
    """Describe a checkpoint without reading any tensor data."""
    src = Path(path)
    if is_stock_dcp(src):
        from functional_ckpt.foreign import inspect_dcp

        summary: CheckpointSummary = inspect_dcp(src)
        return summary
    parsed = open_checkpoint(src)
    tree: dict[str, Any] = node_of(parsed.root)
    tensor_bytes = 0
    for p, kind in parsed.order:
        if kind == "node":
            insert(tree, p, node_of(parsed.node_info.get(p)))
        elif kind == "value":
            insert(tree, p, parsed.values[p])
        else:
            e = parsed.tensors[p]
            tensor_bytes += e.nbytes if e.alias is None else 0
            insert(tree, p, TensorSpec(e.dtype, e.shape, e.nbytes))
    raw = parsed.raw
    shared, added = sharing(src, raw.get("files"))
    created = raw.get("created")  # a time only if it is a number (re-signed manifests lie)
    number = isinstance(created, float | int) and not isinstance(created, bool)
    return CheckpointSummary(
        path=src,
        format_version=raw.get("version"),
        created=created if number else None,
        metadata=raw.get("metadata"),
        tree=tree,
        num_tensors=len(parsed.tensors),
        num_values=len(parsed.values),
        tensor_bytes=tensor_bytes,
        file_bytes=sum(parsed.file_sizes.values()),
        world_size=parsed.world_size,
        shared_bytes=shared,
        added_bytes=added,
    )


from functional_ckpt._src.storage.verify import Problem, VerifyReport, verify  # noqa: E402

__all__ = [
    "CheckpointInfo",
    "CheckpointSummary",
    "Problem",
    "TensorSpec",
    "VerifyReport",
    "inspect",
    "restore",
    "save",
    "verify",
]
