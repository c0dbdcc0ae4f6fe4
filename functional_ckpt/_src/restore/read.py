"""Reading matched entries: new tensors (or ``out``'s), every byte checked, the tree rebuilt.

The destination of a tensor is a new tensor shaped by its template leaf (its
dtype and device), so a restore never writes what it was given; only an explicit
in-place restore (``out=``) reads into the given tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict

from functional_ckpt._src import codec
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import Chunk, TensorEntry
from functional_ckpt._src.state.allocation import host_empty
from functional_ckpt._src.state.tree import Leaf, unflatten
from functional_ckpt._src.storage import committed, shards
from functional_ckpt._src.storage.committed import open_vetted
from functional_ckpt._src.text import short_repr
from functional_ckpt.errors import CorruptCheckpoint, UnregisteredType

CPU = torch.device("cpu")


def vetted_view(path: Path, *, rank: int | None = 0) -> ParsedManifest:
    """Authenticate and validate a committed checkpoint, seen from ``rank``."""
    with open_vetted(path) as ck:
        return committed.parsed(ck).view(rank)


@dataclass(slots=True)
class Target:
    """Where one saved tensor goes: the tensor returned, and the bytes' landing place."""

    entry: TensorEntry
    dest: torch.Tensor
    buf: torch.Tensor  # dest itself when possible, else a staging tensor of the saved dtype
    staged: bool = False  # buf is a staging tensor, copied into dest once read
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def materialize(
    entry: TensorEntry, target: torch.Tensor | None, *, inplace: bool, device: torch.device
) -> Target:
    """Decide where a tensor's bytes land.

    A new tensor is allocated with the template leaf's dtype on its device (``device``
    for ``meta`` leaves and leaves without a template), and the bytes land in it
    directly when it is host memory of the saved dtype. Only ``inplace`` restores
    (``out=``) land in the template's own tensors.
    """
    if not inplace and target is not None and target.is_cpu and target.dtype == entry.dtype:
        dest = host_empty(entry.shape, entry.dtype)  # the common case, decided at once
        return Target(entry, dest, dest)
    if inplace and target is not None and not target.is_meta:
        direct = (
            target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
        )
        if direct:
            return Target(entry, target, target.detach())
        return Target(entry, target, host_empty(entry.shape, entry.dtype), True)
    dtype = entry.dtype if target is None else target.dtype
    where = device if target is None or target.is_meta else target.device
    direct = where.type == "cpu" and dtype == entry.dtype
    dest = (
        host_empty(entry.shape, dtype)
        if direct
        else torch.empty(entry.shape, dtype=dtype, device=where)
    )
    if direct:
        return Target(entry, dest, dest)
    return Target(entry, dest, host_empty(entry.shape, entry.dtype), True)


def _region(buf: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    region = buf
    for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        region = region.narrow(dim, off, size)
    return region


def read_targets(src: committed.Checkpoint, targets: list[Target]) -> None:
    """Read every chunk of every target, checking CRC32s; one error lists all damage."""
    by_file: dict[str, list[tuple[Target, Chunk, torch.Tensor]]] = {}
    for tg in targets:
        chunks = tg.entry.chunks
        whole = len(chunks) == 1 and chunks[0].whole and chunks[0].sizes == tg.entry.shape
        if whole:  # the common case, in one step
            if chunks[0].nbytes:
                by_file.setdefault(chunks[0].file, []).append((tg, chunks[0], tg.buf))
            continue
        for chunk in chunks:
            if not chunk.nbytes:
                continue
            region = _region(tg.buf, chunk)
            if region.is_contiguous():
                land = region
            else:
                land = torch.empty(chunk.sizes, dtype=tg.entry.dtype)
                tg.copies.append((region, land))
            by_file.setdefault(chunk.file, []).append((tg, chunk, land))
    bad: list[str] = []
    for name, group in by_file.items():
        jobs: list[shards.ReadJob] = [(c, land) for _, c, land in group]
        results = shards.read_tensors(src.fd(name), jobs)
        for (tg, _, _), res in zip(group, results, strict=True):
            if res is not None:
                bad.append(f"  {format_path(tg.entry.path)} in {name}: {res}")
    if bad:
        raise CorruptCheckpoint(f"{src.path}: damaged tensor data:\n" + "\n".join(bad))
    with torch.no_grad():
        for tg in targets:
            for region, land in tg.copies:
                region.copy_(land)
            if tg.staged:
                tg.dest.copy_(tg.buf)


def read_tree(
    src: committed.Checkpoint,
    parsed: ParsedManifest,
    selected: list[tuple[KeyPath, str]],
    wanted: dict[KeyPath, torch.Tensor],
    fresh: bool,
    *,
    inplace: bool = False,
    device: torch.device = CPU,
) -> TensorDict:
    """Read the selected entries and rebuild their tree (see :func:`read_leaves`)."""
    leaves = read_leaves(src, parsed, selected, wanted, fresh, inplace=inplace, device=device)
    return rebuild(leaves, parsed.root, src.path)


def rebuild(leaves: list[Leaf], root: dict[str, Any] | None, src: Path) -> TensorDict:
    """The locked tree of ``leaves``; a saved tree that does not fit together is damage."""
    try:
        return unflatten(leaves, root)
    except (RuntimeError, ValueError) as e:  # batch sizes that do not fit the tensors
        raise CorruptCheckpoint(f"{src}: the saved tree does not fit together: {e}") from None


def read_leaves(
    src: committed.Checkpoint,
    parsed: ParsedManifest,
    selected: list[tuple[KeyPath, str]],
    wanted: dict[KeyPath, torch.Tensor],
    fresh: bool,
    *,
    inplace: bool = False,
    device: torch.device = CPU,
    placeholders: bool = False,
) -> list[Leaf]:
    """Read the selected entries into leaves, in the manifest's order.

    ``wanted`` maps key paths to template leaves: their dtype and device shape the
    result, and with ``inplace`` their storage receives it. A value of a class this
    process has not registered is refused unless ``placeholders`` (a reader that
    only looks) keeps it as it was read.
    """
    targets: dict[KeyPath, Target] = {}
    aliases: list[TensorEntry] = []
    chosen = {p for p, k in selected if k == "tensor"}
    for p in chosen:
        e = parsed.tensors[p]
        if e.alias is not None and e.alias in chosen:
            aliases.append(e)
        else:
            targets[p] = materialize(e, wanted.get(p), inplace=inplace, device=device)
    read_targets(src, list(targets.values()))
    results = {p: tg.dest for p, tg in targets.items()}
    with torch.no_grad():
        for e in aliases:
            assert e.alias is not None
            results[e.path] = _tied(results[e.alias], wanted.get(e.path), inplace, device)
    if src.unregistered and not placeholders:
        refuse_unregistered(src.path, parsed, selected)
    leaves: list[Leaf] = []
    for p, kind in selected:
        if kind == "node":
            leaves.append(Leaf(p, "node", parsed.node_info.get(p)))
        elif kind == "value":
            leaves.append(Leaf(p, "value", parsed.values[p]))
        else:
            t = results[p]
            like = wanted.get(p)
            if like is not None and not inplace:
                grad = like.requires_grad
            else:
                grad = fresh and parsed.tensors[p].requires_grad
            if grad and not t.requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            leaves.append(Leaf(p, "tensor", t))
    return leaves


def refuse_unregistered(
    src: Path, parsed: ParsedManifest, selected: list[tuple[KeyPath, str]]
) -> None:
    """Refuse to restore a placeholder for a class this process has not registered.

    A placeholder in a training state would only fail later, far from the cause
    (or be saved over the real value), so the restore stops here and says which
    class to register; ``fc.inspect`` shows such values as they are.
    """
    for p, kind in selected:
        if kind != "value":
            continue
        found = codec.find_unregistered(parsed.values[p])
        if found is not None:
            raise UnregisteredType(
                f"{src}: {format_path(p)} holds {short_repr(found, 120)}; "
                f"{codec.unknown_tag_problem(found.tag)}; or restore with a like= "
                "that leaves this key out (fc.inspect shows it without the class)"
            )


def _tied(
    source: torch.Tensor, like: torch.Tensor | None, inplace: bool, device: torch.device
) -> torch.Tensor:
    """A tensor saved as a tie of ``source``: the same tensor where dtype and device allow."""
    if like is None:
        return source
    if inplace and not like.is_meta:
        if like.data_ptr() != source.data_ptr():
            like.copy_(source)
        return like
    where = device if like.is_meta else like.device
    if source.dtype == like.dtype and source.device == where:
        return source
    return source.to(device=where, dtype=like.dtype, copy=True)
