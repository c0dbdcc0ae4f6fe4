"""save, restore, inspect, verify: the pure functions between a state and a directory.

save:    state -> flatten -> write shards -> DCP metadata -> manifest -> commit
restore: manifest -> match ``like`` -> read into new tensors (or ``out``'s) -> unflatten -> lock
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt import format, shards
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint
from functional_ckpt.manifest import Chunk, dtype_name, parse
from functional_ckpt.reader import (
    Reshard,
    classify_metadata,
    gc_paused,
    open_checkpoint,
    restore_local,
)
from functional_ckpt.tree import KeyPath, as_state, format_path, iter_leaves
from functional_ckpt.writer import (
    DEFAULT_PER_RANK,
    CheckpointInfo,
    PathLike,
    host_copy,
    is_dtensor,
    prepare_save,
    write_local,
)


def save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
    per_rank: Sequence[str] = DEFAULT_PER_RANK,
) -> CheckpointInfo:
    """Write ``state`` to the directory ``path``, atomically and durably.

    When this returns, the checkpoint is on disk (fsynced) and complete; before it
    returns, ``path`` is either absent or still the previous checkpoint. Under an
    initialized process group every rank calls it with its own state (see the
    multi-rank guide); ``per_rank`` names the top-level subtrees stored per rank.
    """
    state = as_state(state)
    if distributed_active() or _has_dtensor(state):
        from functional_ckpt.dist import save_distributed

        return save_distributed(
            path, state, metadata=metadata, overwrite=overwrite, per_rank=per_rank
        )
    with gc_paused():
        dest, plan, meta = prepare_save(path, state, metadata, overwrite, per_rank=per_rank)
        tensors = [host_copy(t) for t in plan.sources]
        return write_local(dest, plan, tensors, metadata=meta, overwrite=overwrite)


def is_stock_dcp(path: Path) -> bool:
    """A directory written by stock ``torch.distributed.checkpoint`` (no manifest)."""
    return (
        path.is_dir()
        and not (path / format.COMMIT_MARKER).exists()
        and not (path / format.MANIFEST).exists()
        and (path / format.DCP_METADATA).exists()
        and not format.is_temporary_name(path.name)
    )


def distributed_active() -> bool:
    """True under an initialized process group with more than one rank."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


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
    chosen = out if out is not None else like
    target = None if chosen is None else as_state(chosen)
    inplace = out is not None
    where = torch.device("cpu" if device is None else device)
    src = Path(path)
    if is_stock_dcp(src):
        from functional_ckpt.foreign import restore_dcp

        return restore_dcp(
            src,
            target,
            partial=partial,
            cast=cast,
            allow_pickle=allow_pickle,
            inplace=inplace,
            device=where,
        )
    if target is not None and _has_dtensor(target):
        from functional_ckpt.dist import restore_distributed

        return restore_distributed(
            src, target, partial=partial, cast=cast, reshard=reshard, inplace=inplace, device=where
        )
    with gc_paused():
        return restore_local(
            src,
            target,
            partial=partial,
            cast=cast,
            reshard=reshard,
            inplace=inplace,
            device=where,
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


def _has_dtensor(template: TensorDictBase | Mapping[str, Any]) -> bool:
    return any(
        leaf.kind == "tensor" and is_dtensor(leaf.value) for leaf in iter_leaves(as_state(template))
    )


# --------------------------------------------------------------------------- inspect


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}{list(self.shape)} ({self.nbytes} B)"


@dataclass
class CheckpointSummary:
    """What a checkpoint holds, read from its manifest alone."""

    path: Path
    format_version: int | None
    created: float | None
    metadata: Any
    tree: dict[str, Any]  # nested: key -> Node | TensorSpec | plain value
    num_tensors: int
    num_values: int
    tensor_bytes: int
    file_bytes: int
    foreign: bool = False
    world_size: int = 1  # ranks that wrote it; per-rank subtrees shown are rank 0's

    def __str__(self) -> str:
        lines = [
            f"{self.path}: {self.num_tensors} tensors ({self.tensor_bytes} B), "
            f"{self.num_values} values"
        ]

        def walk(node: dict[str, Any], indent: str) -> None:
            for k, v in node.items():
                if isinstance(v, Node):
                    batch = f" batch_size={list(v.batch_size)}" if v.batch_size else ""
                    lines.append(f"{indent}{k}/{batch}")
                    walk(v, indent + "  ")
                else:
                    lines.append(f"{indent}{k}: {_short(v)}")

        walk(self.tree, "  ")
        return "\n".join(lines)


class Node(dict[str, Any]):
    """A sub-tree in ``CheckpointSummary.tree`` (plain values that are dicts are not)."""

    batch_size: tuple[int, ...] = ()  # of the TensorDict it was saved from
    names: list[str | None] | None = None


def _node(record: Mapping[str, Any] | None) -> Node:
    node = Node()
    if record:
        node.batch_size = tuple(record["batch_size"])
        node.names = record.get("names")
    return node


def _short(value: Any, limit: int = 100) -> str:
    text = " ".join(str(value).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _insert(tree: dict[str, Any], path: KeyPath, value: Any) -> None:
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, Node())
    node[path[-1]] = value


def inspect(path: PathLike) -> CheckpointSummary:
    """Describe a checkpoint without reading any tensor data."""
    src = Path(path)
    if is_stock_dcp(src):
        from functional_ckpt.foreign import inspect_dcp

        summary: CheckpointSummary = inspect_dcp(src)
        return summary
    parsed = open_checkpoint(src)
    tree: dict[str, Any] = _node(parsed.root)
    tensor_bytes = 0
    for p, kind in parsed.order:
        if kind == "node":
            _insert(tree, p, _node(parsed.node_info.get(p)))
        elif kind == "value":
            _insert(tree, p, parsed.values[p])
        else:
            e = parsed.tensors[p]
            tensor_bytes += e.nbytes if e.alias is None else 0
            _insert(tree, p, TensorSpec(e.dtype, e.shape, e.nbytes))
    raw = parsed.raw
    return CheckpointSummary(
        path=src,
        format_version=raw.get("version"),
        created=raw.get("created"),
        metadata=raw.get("metadata"),
        tree=tree,
        num_tensors=len(parsed.tensors),
        num_values=len(parsed.values),
        tensor_bytes=tensor_bytes,
        file_bytes=sum(parsed.file_sizes.values()),
        world_size=parsed.world_size,
    )


# --------------------------------------------------------------------------- verify


@dataclass(frozen=True)
class Problem:
    where: str  # a file name or a key path
    detail: str

    def __str__(self) -> str:
        return f"{self.where}: {self.detail}"


@dataclass
class VerifyReport:
    """The outcome of re-reading every byte of a checkpoint."""

    path: Path
    ok: bool
    problems: list[Problem]
    files_checked: int = 0
    bytes_checked: int = 0

    def __str__(self) -> str:
        head = (
            f"{self.path}: {'OK' if self.ok else 'DAMAGED'} ({self.files_checked} files, "
            f"{self.bytes_checked} bytes)"
        )
        return "\n".join([head, *(f"  {p}" for p in self.problems)])


def verify(path: PathLike) -> VerifyReport:
    """Recompute every checksum over every byte; raise only if ``path`` is no checkpoint."""
    src = Path(path)
    report = VerifyReport(src, True, [])
    try:
        format.check_committed(src)  # CheckpointNotFound / IncompleteCheckpoint propagate
        manifest = format.read_manifest(src)
        ranks = parse(manifest, src, rank=None).world_size
        parsed = [parse(manifest, src, rank=r) for r in range(ranks)]
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.ok = False
        report.problems.append(Problem(format.MANIFEST, str(err)))
        return report
    files = manifest["files"]
    listed = set(files) | {format.MANIFEST, format.COMMIT_MARKER}
    for child in sorted(os.listdir(src)):
        if child not in listed:
            report.problems.append(Problem(child, "unexpected file in the checkpoint"))
    md = files.get(format.DCP_METADATA)
    if isinstance(md, dict):
        size, crc = format.crc32_file(src / format.DCP_METADATA)
        report.files_checked += 1
        report.bytes_checked += size
        if crc != md.get("crc32"):
            report.problems.append(Problem(format.DCP_METADATA, str(classify_metadata(src))))
        else:  # intact, but would stock dcp.load run anything in it?
            try:
                format.read_dcp_metadata(src)
            except (CorruptCheckpoint, UnsafeCheckpoint) as err:
                report.problems.append(Problem(format.DCP_METADATA, str(err)))
    by_file: dict[str, dict[int, tuple[KeyPath, Chunk]]] = {}
    for one in parsed:
        for e in one.tensors.values():
            if e.alias is None:
                for c in e.chunks:
                    by_file.setdefault(c.file, {})[c.offset] = (e.path, c)
    for name in files:
        if name != format.DCP_METADATA:
            _verify_file(src, name, sorted(by_file.get(name, {}).items()), parsed[0], report)
    report.ok = not report.problems
    return report


def _verify_file(
    src: Path,
    name: str,
    chunks: list[tuple[int, tuple[KeyPath, Chunk]]],
    parsed: Any,
    report: VerifyReport,
) -> None:
    """Every byte of a shard file belongs to exactly one blob whose checksums hold."""
    report.files_checked += 1
    pos = 0
    fd = os.open(src / name, os.O_RDONLY)
    try:
        for _, (key, c) in chunks:
            if c.offset != pos:
                report.problems.append(
                    Problem(name, f"bytes {pos}..{c.offset} are not accounted for")
                )
            hcrc, n1 = shards.crc_range(fd, c.offset, c.data_offset - c.offset)
            crc, n2 = shards.crc_range(fd, c.data_offset, c.nbytes)
            end = c.data_offset + c.nbytes
            hcrc, n3 = shards.crc_range(fd, end, c.offset + c.length - end, hcrc)
            report.bytes_checked += n1 + n2 + n3
            if crc != c.crc32:
                report.problems.append(
                    Problem(format_path(key), f"tensor data in {name} fails its checksum")
                )
            if hcrc != c.hcrc32:
                report.problems.append(
                    Problem(format_path(key), f"blob headers in {name} fail their checksum")
                )
            pos = c.offset + c.length
    finally:
        os.close(fd)
    if pos != parsed.file_sizes[name]:
        report.problems.append(
            Problem(name, f"bytes {pos}..{parsed.file_sizes[name]} are not accounted for")
        )


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
