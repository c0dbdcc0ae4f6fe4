"""save, restore, inspect, verify: the pure functions between a state and a directory.

save:    state -> flatten -> write shards -> DCP metadata -> manifest -> commit
restore: manifest -> check template -> read into target tensors -> unflatten -> lock
"""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt import codec, format, shards
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CorruptCheckpoint,
    TemplateMismatch,
    UnsafeCheckpoint,
    UnsupportedValue,
)
from functional_ckpt.manifest import (
    ParsedManifest,
    TensorEntry,
    dtype_name,
    element_size,
    parse,
)
from functional_ckpt.tree import KeyPath, Leaf, as_state, format_path, iter_leaves, unflatten

PathLike = str | os.PathLike[str]
SHARD_FILE = "__0_0.distcp"


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many short-lived objects.

    A state with thousands of tensors makes each generational collection walk the
    whole heap; collections triggered by our own bookkeeping cost more than the
    disk writes of small tensors.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class CheckpointInfo:
    """What a finished save produced."""

    path: Path
    nbytes: int  # bytes on disk, all files
    tensor_bytes: int
    num_tensors: int
    num_values: int
    created: float  # seconds since the epoch
    duration: float  # seconds spent in save
    metadata: Any = None


# --------------------------------------------------------------------------- save


def _fqn_of(path: KeyPath) -> str:
    return ".".join(path)


def _check_tensor(t: torch.Tensor, path: KeyPath) -> None:
    where = f"state[{format_path(path)}]"
    if t.is_meta:
        raise UnsupportedValue(f"{where}: meta tensors hold no data and cannot be saved")
    if t.layout != torch.strided:
        raise UnsupportedValue(f"{where}: {t.layout} tensors are not supported; convert to dense")
    if t.is_quantized or t.is_nested:
        raise UnsupportedValue(f"{where}: quantized and nested tensors are not supported")


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor: itself when it already is one, else a copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t if t.is_contiguous() else t.contiguous()


def _alias_key(t: torch.Tensor) -> tuple[Any, ...] | None:
    """Identity of a tensor's bytes: two leaves with the same key are one tensor."""
    if t.is_meta or t.numel() == 0:
        return None
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)


@dataclass
class _Plan:
    """The flattened state ready to be written."""

    entries: list[dict[str, Any]] = field(default_factory=list)
    sources: list[torch.Tensor] = field(default_factory=list)  # the caller's tensors, to write
    tensor_entries: list[int] = field(default_factory=list)  # entry index of each source
    keys: list[KeyPath] = field(default_factory=list)
    num_values: int = 0


def plan_save(state: TensorDictBase | Mapping[str, Any]) -> _Plan:
    """Flatten a state into manifest entries and the tensors to write."""
    td = as_state(state)
    plan = _Plan()
    fqns: dict[str, KeyPath] = {}
    seen: dict[tuple[Any, ...], int] = {}
    for leaf in iter_leaves(td):
        entry: dict[str, Any] = {"path": list(leaf.path), "kind": leaf.kind}
        if leaf.kind == "value":
            entry["value"] = leaf.value
            plan.num_values += 1
        elif leaf.kind == "tensor":
            t: torch.Tensor = leaf.value
            fqn = _fqn_of(leaf.path)
            other = fqns.get(fqn)
            if other is not None:
                raise UnsupportedValue(
                    f"state[{format_path(leaf.path)}] and state[{format_path(other)}] map to the "
                    f"same DCP key {fqn!r}; rename one of them"
                )
            fqns[fqn] = leaf.path
            entry.update(
                fqn=fqn,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                requires_grad=bool(t.requires_grad),
            )
            key = _alias_key(t)
            if key is not None and key in seen:
                entry["alias"] = seen[key]
            else:
                if key is not None:
                    seen[key] = len(plan.entries)
                _check_tensor(t, leaf.path)
                plan.sources.append(t)
                plan.tensor_entries.append(len(plan.entries))
                plan.keys.append(leaf.path)
        plan.entries.append(entry)
    _check_values(plan.entries)
    return plan


def _check_values(entries: list[dict[str, Any]]) -> None:
    """Fail before any byte is written if a value cannot be stored exactly."""
    values = [e["value"] for e in entries if e["kind"] == "value"]
    try:
        codec.check_encodable(values)
    except UnsupportedValue:
        for e in entries:
            if e["kind"] == "value":
                codec.check_encodable(e["value"], where=f"state[{format_path(tuple(e['path']))}]")
        raise


def _os_error(e: OSError, where: Path) -> CheckpointError:
    if e.errno == errno.ENOSPC:
        return CheckpointError(f"{where}: no space left on the device while saving ({e})")
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return CheckpointError(f"{where}: permission denied while saving ({e})")
    return CheckpointError(f"{where}: saving failed: {e}")


def _check_destination(path: Path, overwrite: bool) -> None:
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise CheckpointExists(f"{path}: the destination exists and is not a checkpoint directory")
    if path.exists() and not overwrite:
        raise CheckpointExists(
            f"{path}: a checkpoint already exists here; pass overwrite=True to replace it"
        )
    if format.is_temporary_name(path.name):
        raise CheckpointError(
            f"{path}: names containing {format.TMP_INFIX!r} or {format.TRASH_INFIX!r} are reserved"
        )


def auto_metadata() -> dict[str, Any]:
    """What every checkpoint records about where it came from."""
    from functional_ckpt import __version__

    return {
        "hostname": socket.gethostname(),
        "torch": str(torch.__version__),
        "functional_ckpt": __version__,
        "pid": os.getpid(),
    }


def write_checkpoint(
    path: Path,
    plan: _Plan,
    tensors: Sequence[torch.Tensor],
    *,
    metadata: Any,
    overwrite: bool,
    after_each: Callable[[int], None] | None = None,
    before_commit: Callable[[], None] | None = None,
) -> CheckpointInfo:
    """Write a planned state into ``path`` with the full commit protocol.

    ``tensors`` are the bytes to write for ``plan.sources`` (the sources themselves,
    or staged copies), each contiguous and on the CPU. ``after_each(i)`` runs once
    tensor ``i`` is written; ``before_commit()`` may raise to refuse the commit.
    """
    t0 = time.perf_counter()
    created = time.time()
    tmp = format.tmp_sibling(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
        records = shards.write_shard(tmp / SHARD_FILE, tensors, after_each=after_each)
        by_index = {}
        for rec, idx in zip(records, plan.tensor_entries, strict=True):
            plan.entries[idx].update(
                file=rec.file,
                offset=rec.offset,
                length=rec.length,
                data_offset=rec.data_offset,
                nbytes=rec.nbytes,
                crc32=rec.crc,
                hcrc32=rec.hcrc,
            )
            by_index[idx] = rec
        md, results = shards.dcp_metadata(
            [
                (
                    e["fqn"],
                    tuple(e["path"]),
                    getattr(torch, e["dtype"]),
                    tuple(e["shape"]),
                    by_index[e.get("alias", i)],
                )
                for i, e in enumerate(plan.entries)
                if e["kind"] == "tensor"
            ]
        )
        shards.write_dcp_metadata(tmp, md, results)
        md_size, md_crc = format.crc32_file(tmp / format.DCP_METADATA)
        shard_size = (tmp / SHARD_FILE).stat().st_size
        manifest = {
            "format": format.FORMAT_NAME,
            "version": format.FORMAT_VERSION,
            "created": created,
            "world_size": 1,
            "metadata": metadata,
            "files": {
                SHARD_FILE: {"size": shard_size},
                format.DCP_METADATA: {"size": md_size, "crc32": md_crc},
            },
            "entries": plan.entries,
        }
        manifest_bytes = codec.encode(manifest, where="manifest")
        format.write_file_durably(tmp / format.MANIFEST, manifest_bytes)
        if before_commit is not None:
            before_commit()
        format.write_commit_marker(tmp, manifest_bytes)
        format.commit(tmp, path, overwrite=overwrite)
    except OSError as e:
        format.remove_tree(tmp)
        raise _os_error(e, path) from e
    except BaseException:
        format.remove_tree(tmp)
        raise
    tensor_bytes = sum(r.nbytes for r in records)
    return CheckpointInfo(
        path=path,
        nbytes=shard_size + md_size + len(manifest_bytes),
        tensor_bytes=tensor_bytes,
        num_tensors=len(by_index),
        num_values=plan.num_values,
        created=created,
        duration=time.perf_counter() - t0,
        metadata=metadata,
    )


def prepare_save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
) -> tuple[Path, _Plan, dict[str, Any]]:
    """Everything a save checks before writing a byte: destination, metadata, tree."""
    dest = Path(path)
    _check_destination(dest, overwrite)
    meta = {**auto_metadata(), **dict(metadata or {})}
    codec.check_encodable(meta, where="metadata")
    return dest, plan_save(state), meta


def save(
    path: PathLike,
    state: TensorDictBase | Mapping[str, Any],
    *,
    metadata: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Write ``state`` to the directory ``path``, atomically and durably.

    When this returns, the checkpoint is on disk (fsynced) and complete; before it
    returns, ``path`` is either absent or still the previous checkpoint.
    """
    with gc_paused():
        dest, plan, meta = prepare_save(path, state, metadata, overwrite)
        tensors = [host_copy(t) for t in plan.sources]
        return write_checkpoint(dest, plan, tensors, metadata=meta, overwrite=overwrite)


# --------------------------------------------------------------------------- restore


def open_checkpoint(path: Path) -> ParsedManifest:
    """Authenticate and validate a committed checkpoint's manifest and DCP metadata."""
    manifest = format.read_manifest(path)
    files = manifest.get("files")
    md_info = files.get(format.DCP_METADATA) if isinstance(files, dict) else None
    if isinstance(md_info, dict):
        try:
            size, crc = format.crc32_file(format.safe_member(path, format.DCP_METADATA))
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path / format.DCP_METADATA}: missing") from None
        if (size, crc) != (md_info.get("size"), md_info.get("crc32")):
            raise _classify_metadata(path)
    return parse(manifest, path)


def _classify_metadata(path: Path) -> CheckpointError:
    """A ``.metadata`` that fails its checksum: hostile, or merely damaged?"""
    try:
        format.read_dcp_metadata(path)
    except UnsafeCheckpoint as e:
        return e
    except CheckpointError:
        pass
    return CorruptCheckpoint(
        f"{path / format.DCP_METADATA}: does not match the checksum in the manifest"
    )


@dataclass
class _Target:
    entry: TensorEntry
    dest: torch.Tensor | None = None  # tensor returned to the caller
    buf: torch.Tensor | None = None  # where the bytes land (dest itself when possible)


def _template_leaves(template: TensorDictBase | Mapping[str, Any]) -> dict[KeyPath, Leaf]:
    return {leaf.path: leaf for leaf in iter_leaves(as_state(template))}


def _select(
    parsed: ParsedManifest,
    template: TensorDictBase | Mapping[str, Any] | None,
    *,
    partial: bool,
    cast: bool,
) -> tuple[list[tuple[KeyPath, str]], dict[KeyPath, torch.Tensor]]:
    """Match saved entries to the template; every mismatch is listed in one error."""
    if template is None:
        return parsed.order, {}
    tleaves = _template_leaves(template)
    children: set[KeyPath] = {p[:-1] for p in tleaves}
    fill = [p for p, leaf in tleaves.items() if leaf.kind == "node" and p not in children]
    problems: list[str] = []
    targets: dict[KeyPath, torch.Tensor] = {}
    saved_kinds = dict(parsed.order)
    for p, leaf in tleaves.items():
        kind = saved_kinds.get(p)
        if kind is None:
            problems.append(f"  {format_path(p)}: missing from the checkpoint")
        elif kind != leaf.kind:
            problems.append(f"  {format_path(p)}: saved as a {kind}, template has a {leaf.kind}")
        elif kind == "tensor":
            e = parsed.tensors[p]
            t: torch.Tensor = leaf.value
            if tuple(t.shape) != e.shape:
                problems.append(
                    f"  {format_path(p)}: saved {e.spec}, template "
                    f"{dtype_name(t.dtype)}{list(t.shape)} (shape differs)"
                )
            elif t.dtype != e.dtype and not cast:
                problems.append(
                    f"  {format_path(p)}: saved {e.spec}, template "
                    f"{dtype_name(t.dtype)}{list(t.shape)} "
                    "(dtype differs; pass cast=True to convert)"
                )
            else:
                targets[p] = t

    def wanted(p: KeyPath) -> bool:
        return p in tleaves or any(p[: len(f)] == f for f in fill)

    selected = [(p, k) for p, k in parsed.order if wanted(p)]
    if not partial:
        extra = [p for p, _ in parsed.order if not wanted(p)]
        problems += [
            f"  {format_path(p)}: in the checkpoint but not in the template (pass partial=True "
            "to restore a subset)"
            for p in extra[:50]
        ]
        if len(extra) > 50:
            problems.append(f"  ... and {len(extra) - 50} more")
    if problems:
        raise TemplateMismatch("the checkpoint does not fit the template:\n" + "\n".join(problems))
    return selected, targets


def _materialize(entry: TensorEntry, target: torch.Tensor | None) -> _Target:
    if target is None:
        dest = torch.empty(entry.shape, dtype=entry.dtype)
        return _Target(entry, dest, dest)
    if target.is_meta:
        dest = torch.empty(entry.shape, dtype=target.dtype)
        buf = dest if target.dtype == entry.dtype else torch.empty(entry.shape, dtype=entry.dtype)
        return _Target(entry, dest, buf)
    direct = target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
    buf = target.detach() if direct else torch.empty(entry.shape, dtype=entry.dtype)
    return _Target(entry, target, buf)


def _read(path: Path, targets: list[_Target]) -> None:
    by_file: dict[str, list[_Target]] = {}
    for tg in targets:
        if tg.entry.nbytes:
            by_file.setdefault(tg.entry.file, []).append(tg)
    bad: list[str] = []
    for name, group in by_file.items():
        jobs = []
        for tg in group:
            assert tg.buf is not None
            jobs.append((tg.entry.data_offset, shards.byte_view(tg.buf), tg.entry.crc32))
        results = shards.read_tensors(path / name, jobs)
        for tg, res in zip(group, results, strict=True):
            if res is not None:
                what = "checksum mismatch" if res < 0 else f"only {res} of {tg.entry.nbytes} bytes"
                bad.append(f"  {format_path(tg.entry.path)} in {name}: {what}")
    if bad:
        raise CorruptCheckpoint(f"{path}: damaged tensor data:\n" + "\n".join(bad))
    with torch.no_grad():
        for tg in targets:
            if (
                tg.dest is not None
                and tg.buf is not None
                and tg.buf.numel()
                and tg.buf.data_ptr() != tg.dest.data_ptr()
            ):
                tg.dest.copy_(tg.buf)


def restore(
    path: PathLike,
    template: TensorDictBase | Mapping[str, Any] | None = None,
    *,
    partial: bool = False,
    cast: bool = False,
    allow_pickle: bool = False,
) -> TensorDict:
    """Read a checkpoint back as a new locked TensorDict.

    With a template, bytes are read straight into the template's tensors (in place,
    like ``dcp.load``: no second copy of the state in memory); ``meta`` tensors in
    the template are allocated on the CPU; without a template the whole tree is
    rebuilt from the manifest. On failure the template tensors' contents are
    unspecified.
    """
    with gc_paused():
        return _restore(Path(path), template, partial=partial, cast=cast, allow_pickle=allow_pickle)


def _restore(
    src: Path,
    template: TensorDictBase | Mapping[str, Any] | None,
    *,
    partial: bool,
    cast: bool,
    allow_pickle: bool,
) -> TensorDict:
    if (
        src.is_dir()
        and not (src / format.COMMIT_MARKER).exists()
        and not (src / format.MANIFEST).exists()
        and (src / format.DCP_METADATA).exists()
        and not format.is_temporary_name(src.name)
    ):
        from functional_ckpt.foreign import restore_dcp

        return restore_dcp(src, template, partial=partial, cast=cast, allow_pickle=allow_pickle)
    parsed = open_checkpoint(src)
    selected, wanted = _select(parsed, template, partial=partial, cast=cast)
    targets: dict[KeyPath, _Target] = {}
    aliases: list[tuple[KeyPath, TensorEntry]] = []
    by_index = {e.index: e for e in parsed.tensors.values()}
    for p, kind in selected:
        if kind != "tensor":
            continue
        e = parsed.tensors[p]
        if e.alias is not None:
            aliases.append((p, e))
            src_path = by_index[e.alias].path
            if src_path not in targets and any(q == src_path for q, _ in selected):
                continue
            if src_path not in targets:
                # the alias target was not selected: read the bytes for the alias itself
                targets[p] = _materialize(e, wanted.get(p))
            continue
        targets[p] = _materialize(e, wanted.get(p))
    _read(src, list(targets.values()))
    with torch.no_grad():
        for p, e in aliases:
            if p in targets:
                continue
            source = targets[by_index[e.alias].path]  # type: ignore[index]
            assert source.dest is not None
            dest = wanted.get(p)
            if dest is None or dest.is_meta:
                targets[p] = _Target(e, source.dest, None)
            else:
                if dest.data_ptr() != source.dest.data_ptr():
                    dest.copy_(source.dest)
                targets[p] = _Target(e, dest, None)
    leaves: list[Leaf] = []
    for p, kind in selected:
        if kind == "node":
            leaves.append(Leaf(p, "node"))
        elif kind == "value":
            leaves.append(Leaf(p, "value", parsed.values[p]))
        else:
            tg = targets[p]
            t = tg.dest
            assert t is not None
            if template is None and tg.entry.requires_grad and t.is_floating_point():
                t.requires_grad_(True)
            leaves.append(Leaf(p, "tensor", t))
    return unflatten(leaves)


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

    def __str__(self) -> str:
        lines = [
            f"{self.path}: {self.num_tensors} tensors ({self.tensor_bytes} B), "
            f"{self.num_values} values"
        ]

        def walk(node: dict[str, Any], indent: str) -> None:
            for k, v in node.items():
                if isinstance(v, Node):
                    lines.append(f"{indent}{k}/")
                    walk(v, indent + "  ")
                else:
                    lines.append(f"{indent}{k}: {_short(v)}")

        walk(self.tree, "  ")
        return "\n".join(lines)


class Node(dict[str, Any]):
    """A sub-tree in ``CheckpointSummary.tree`` (plain values that are dicts are not)."""


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
    if (
        src.is_dir()
        and not (src / format.COMMIT_MARKER).exists()
        and not (src / format.MANIFEST).exists()
        and (src / format.DCP_METADATA).exists()
    ):
        from functional_ckpt.foreign import inspect_dcp

        summary: CheckpointSummary = inspect_dcp(src)
        return summary
    parsed = open_checkpoint(src)
    tree: dict[str, Any] = Node()
    tensor_bytes = 0
    for p, kind in parsed.order:
        if kind == "node":
            _insert(tree, p, Node())
        elif kind == "value":
            _insert(tree, p, parsed.values[p])
        else:
            e = parsed.tensors[p]
            n = 1
            for d in e.shape:
                n *= d
            nbytes = n * element_size(e.dtype)
            tensor_bytes += nbytes if e.alias is None else 0
            _insert(tree, p, TensorSpec(e.dtype, e.shape, nbytes))
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
    format.check_committed(src)  # raises CheckpointNotFound / IncompleteCheckpoint
    report = VerifyReport(src, True, [])
    try:
        manifest = format.read_manifest(src)
        parsed = parse(manifest, src)
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
            report.problems.append(Problem(format.DCP_METADATA, str(_classify_metadata(src))))
    by_file: dict[str, list[TensorEntry]] = {}
    for e in parsed.tensors.values():
        if e.alias is None:
            by_file.setdefault(e.file, []).append(e)
    for name in files:
        if name == format.DCP_METADATA:
            continue
        entries = sorted(by_file.get(name, []), key=lambda e: e.offset)
        report.files_checked += 1
        pos = 0
        fd = os.open(src / name, os.O_RDONLY)
        try:
            for e in entries:
                if e.offset != pos:
                    report.problems.append(
                        Problem(name, f"bytes {pos}..{e.offset} are not accounted for")
                    )
                hcrc, n1 = shards.crc_range(fd, e.offset, e.data_offset - e.offset)
                crc, n2 = shards.crc_range(fd, e.data_offset, e.nbytes)
                end = e.data_offset + e.nbytes
                hcrc, n3 = shards.crc_range(fd, end, e.offset + e.length - end, hcrc)
                report.bytes_checked += n1 + n2 + n3
                if crc != e.crc32:
                    report.problems.append(
                        Problem(format_path(e.path), f"tensor data in {name} fails its checksum")
                    )
                if hcrc != e.hcrc32:
                    report.problems.append(
                        Problem(format_path(e.path), f"blob headers in {name} fail their checksum")
                    )
                pos = e.offset + e.length
            if pos != parsed.file_sizes[name]:
                report.problems.append(
                    Problem(name, f"bytes {pos}..{parsed.file_sizes[name]} are not accounted for")
                )
        finally:
            os.close(fd)
    report.ok = not report.problems
    return report


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
