"""save, restore, inspect, verify: the pure functions between a state and a directory.

save:    state -> flatten -> write shards -> DCP metadata -> manifest -> commit
restore: manifest -> match ``like`` -> read into new tensors (or ``out``'s) -> unflatten -> lock
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt import dcpbytes, dcpmeta, format, shards
from functional_ckpt.checksum import crc32
from functional_ckpt.dcpbytes import ByteEntry
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, UnsafeCheckpoint
from functional_ckpt.manifest import Chunk, TensorEntry, groups_of, parse_checkpoint
from functional_ckpt.pipeline.incremental import sharing
from functional_ckpt.pipeline.restore import is_stock_dcp
from functional_ckpt.pipeline.restore import restore as pipeline_restore
from functional_ckpt.pipeline.save import save as pipeline_save
from functional_ckpt.reader import Reshard, classify_metadata, open_checkpoint
from functional_ckpt.summary import CheckpointSummary, TensorSpec, insert, node_of
from functional_ckpt.tree import format_path
from functional_ckpt.writer import (
    DEFAULT_PER_RANK,
    CheckpointInfo,
    PathLike,
)


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


# --------------------------------------------------------------------------- inspect


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
    """Recompute every checksum over every byte; raise only if ``path`` is no checkpoint.

    ``.metadata`` is recomputed from the manifest and must match byte for byte
    (or, if another torch version wrote it, field for field): a ``.metadata``
    that would send stock ``dcp.load`` elsewhere than the manifest is damage.
    """
    src = Path(path)
    report = VerifyReport(src, True, [])
    failed: list[tuple[str, CheckpointError]] = []
    try:  # CheckpointNotFound / IncompleteCheckpoint propagate
        ck = format.open_checkpoint(src, problems=failed)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.ok = False
        report.problems.append(Problem(format.MANIFEST, str(err)))
        return report
    with ck:
        _verify_open(ck, failed, report)
    report.ok = not report.problems
    return report


def _verify_open(
    ck: format.Checkpoint, failed: list[tuple[str, CheckpointError]], report: VerifyReport
) -> None:
    src, manifest = ck.path, ck.manifest
    try:
        once = parse_checkpoint(manifest, src)
        shared, parsed = once.shared, once.all_views()
        blobs = dcpbytes.parse(manifest, shared.file_sizes, src)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.problems.append(Problem(format.MANIFEST, str(err)))
        return
    report.problems += [Problem(name, str(err)) for name, err in failed]
    files = manifest["files"]
    listed = set(files) | {format.MANIFEST, format.COMMIT_MARKER}
    for child in format.iter_names(ck.dir_fd):
        if child not in listed:
            report.problems.append(Problem(child, "unexpected file in the checkpoint"))
    _verify_metadata(ck, groups_of(shared, parsed), blobs, report)
    by_file: dict[str, dict[int, tuple[str, Chunk | ByteEntry]]] = {}
    for one in parsed:
        for e in one.tensors.values():
            if e.alias is None:
                for c in e.chunks:
                    by_file.setdefault(c.file, {})[c.offset] = (format_path(e.path), c)
    for b in blobs:
        by_file.setdefault(b.file, {})[b.offset] = (f"DCP byte entry {b.fqn!r}", b)
    for name in files:
        if name != format.DCP_METADATA and name in ck.fds:
            _verify_file(ck, name, sorted(by_file.get(name, {}).items()), parsed[0], report)


def _verify_metadata(
    ck: format.Checkpoint,
    groups: list[list[TensorEntry]],
    blobs: list[ByteEntry],
    report: VerifyReport,
) -> None:
    """``.metadata`` is intact and says exactly what the manifest says."""
    name = format.DCP_METADATA
    info = ck.manifest["files"].get(name)
    if not isinstance(info, dict):
        report.problems.append(Problem(name, "not recorded in the manifest"))
        return
    if name not in ck.fds:
        return  # already reported: missing, wrong size or not a regular file
    where = ck.path / name
    if ck.sizes[name] != info.get("size"):
        report.problems.append(Problem(name, str(classify_metadata(ck))))
        return
    raw = format.read_exact(ck.fds[name], ck.sizes[name], where)
    report.files_checked += 1
    report.bytes_checked += len(raw)
    if crc32(raw) != info.get("crc32"):
        report.problems.append(Problem(name, str(classify_metadata(ck))))
        return
    try:
        expected = dcpmeta.derive(groups, blobs)
    except Exception as err:  # a manifest that parse accepted but that cannot describe DCP
        report.problems.append(Problem(name, f"cannot be derived from the manifest ({err})"))
        return
    if raw == expected:
        return
    # Another torch version may pickle the same metadata differently: compare fields.
    try:
        found = dcpmeta.load_foreign(raw, where)
    except (CorruptCheckpoint, UnsafeCheckpoint) as err:
        report.problems.append(Problem(name, str(err)))
        return
    for diff in dcpmeta.compare(found, dcpmeta.build(groups, blobs)):
        report.problems.append(
            Problem(name, f"disagrees with the manifest (stock dcp.load would misread): {diff}")
        )


def _verify_file(
    ck: format.Checkpoint,
    name: str,
    chunks: list[tuple[int, tuple[str, Chunk | ByteEntry]]],
    parsed: Any,
    report: VerifyReport,
) -> None:
    """Every byte of a shard file belongs to exactly one blob whose checksums hold.

    A file reused from a base (incremental saves) may also hold blobs this
    checkpoint no longer uses: gaps are expected there, overlaps are not.
    """
    report.files_checked += 1
    pos = 0
    fd = ck.fds[name]
    info = parsed.raw.get("files", {}).get(name)
    gaps = isinstance(info, dict) and info.get("reused") is True
    for _, (key, c) in chunks:
        if c.offset != pos and not (gaps and c.offset > pos):
            report.problems.append(Problem(name, f"bytes {pos}..{c.offset} are not accounted for"))
        if isinstance(c, ByteEntry):  # a value's bytes for stock readers: one checksum
            crc, n = shards.crc_range(fd, c.offset, c.length)
            report.bytes_checked += n
            if crc != c.crc32:
                report.problems.append(Problem(key, f"bytes in {name} fail their checksum"))
            pos = c.offset + c.length
            continue
        hcrc, n1 = shards.crc_range(fd, c.offset, c.data_offset - c.offset)
        crc, n2 = shards.crc_range(fd, c.data_offset, c.nbytes)
        end = c.data_offset + c.nbytes
        hcrc, n3 = shards.crc_range(fd, end, c.offset + c.length - end, hcrc)
        report.bytes_checked += n1 + n2 + n3
        if crc != c.crc32:
            report.problems.append(Problem(key, f"tensor data in {name} fails its checksum"))
        if hcrc != c.hcrc32:
            report.problems.append(Problem(key, f"blob headers in {name} fail their checksum"))
        pos = c.offset + c.length
    if pos != parsed.file_sizes[name] and not (gaps and pos < parsed.file_sizes[name]):
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
