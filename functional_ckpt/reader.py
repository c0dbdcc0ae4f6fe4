"""From committed files to a state: authenticate, match the template, read, rebuild.

The manifest is authenticated by the commit marker and validated against the
files before anything is allocated. Tensor bytes are read straight into their
destination, checked against their CRC32 on the way, and a new locked TensorDict
is built around them. The destination is a new tensor shaped by the ``like``
leaf (its dtype and device), so a restore never writes what it was given; only
an explicit in-place restore (``out=``) reads into the given tensors.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import mmap
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src.format import blobs
from functional_ckpt._src.format.coverage import numel
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.manifest import Chunk, TensorEntry, dtype_name, element_size
from functional_ckpt._src.format.view import ParsedCheckpoint, ParsedManifest, parse
from functional_ckpt._src.storage import checkpoint, shards
from functional_ckpt._src.storage.checkpoint import open_vetted
from functional_ckpt.errors import (
    CorruptCheckpoint,
    TemplateMismatch,
)
from functional_ckpt.tree import Leaf, as_state, iter_leaves, node_record, unflatten

Reshard = Callable[[list[TensorDict], int, int], Any]

CPU = torch.device("cpu")


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic GC while building many short-lived objects.

    A state with thousands of tensors makes each generational collection walk the
    whole heap; collections triggered by our own bookkeeping cost more than the
    disk I/O of small tensors.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def open_checkpoint(path: Path, *, rank: int | None = 0) -> ParsedManifest:
    """Authenticate and validate a committed checkpoint, seen from ``rank``."""
    with open_vetted(path) as ck:
        return parse(ck.manifest, path, rank=rank)


@dataclass
class Target:
    """Where one saved tensor goes: the tensor returned, and the bytes' landing place."""

    entry: TensorEntry
    dest: torch.Tensor
    buf: torch.Tensor  # dest itself when possible, else a staging tensor of the saved dtype
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


def _template_leaves(template: TensorDictBase | Mapping[str, Any]) -> dict[KeyPath, Leaf]:
    return {leaf.path: leaf for leaf in iter_leaves(as_state(template))}


def select(
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
        if kind is None and p[-1] == NODE_KEY:
            continue  # the checkpoint's own container kind (a plain dict, say) is kept
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
        if p in tleaves or any(p[: len(f)] == f for f in fill):
            return True
        # A container record describes how the saved subtree was built (an
        # OrderedDict state_dict, a list); a template written as plain dicts asks
        # for that subtree all the same.
        return p[-1] == NODE_KEY and (len(p) == 1 or p[:-1] in tleaves)

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


#: Host tensors from this size on are allocated with their pages faulted in up front.
PREFAULT_BYTES = 4 << 20

#: ``madvise`` advice that faults a whole range in with one call (Linux 5.14+).
MADV_POPULATE_WRITE = 23


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor whose pages are already faulted in.

    A restore writes every byte of its new tensors once; faulting fresh memory in
    4 KiB at a time while reading costs more than the read itself (far more under
    virtualisation), and one ``MADV_POPULATE_WRITE`` call over the tensor's own
    allocation does the same work with one trap (Linux only; on older kernels the
    advice fails and the read faults the pages in). The tensor is an ordinary one
    from torch's allocator. Huge pages are deliberately not asked for: with the
    common ``defrag=madvise`` setting the kernel would compact memory synchronously,
    evicting the very page cache being read.
    """
    tensor = torch.empty(shape, dtype=dtype)
    nbytes = numel(shape) * element_size(dtype)
    if nbytes >= PREFAULT_BYTES and _MADVISE is not None:
        start = (tensor.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
        end = (tensor.data_ptr() + nbytes) & ~(_PAGE - 1)
        if end > start:
            _MADVISE(start, end - start, MADV_POPULATE_WRITE)  # best effort: -1 is harmless
    return tensor


def _libc_madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()

_PAGE = mmap.PAGESIZE


def materialize(
    entry: TensorEntry, target: torch.Tensor | None, *, inplace: bool, device: torch.device
) -> Target:
    """Decide where a tensor's bytes land.

    A new tensor is allocated with the template leaf's dtype on its device (``device``
    for ``meta`` leaves and leaves without a template), and the bytes land in it
    directly when it is host memory of the saved dtype. Only ``inplace`` restores
    (``out=``) land in the template's own tensors.
    """
    if inplace and target is not None and not target.is_meta:
        direct = (
            target.device.type == "cpu" and target.dtype == entry.dtype and target.is_contiguous()
        )
        buf = target.detach() if direct else torch.empty(entry.shape, dtype=entry.dtype)
        return Target(entry, target, buf)
    dtype = entry.dtype if target is None else target.dtype
    where = device if target is None or target.is_meta else target.device
    direct = where.type == "cpu" and dtype == entry.dtype
    dest = (
        host_empty(entry.shape, dtype)
        if direct
        else torch.empty(entry.shape, dtype=dtype, device=where)
    )
    buf = dest if direct else torch.empty(entry.shape, dtype=entry.dtype)
    return Target(entry, dest, buf)


def _region(buf: torch.Tensor, chunk: Chunk) -> torch.Tensor:
    region = buf
    for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
        region = region.narrow(dim, off, size)
    return region


def read_targets(src: checkpoint.Checkpoint, targets: list[Target]) -> None:
    """Read every chunk of every target, checking CRC32s; one error lists all damage."""
    by_file: dict[str, list[tuple[Target, Chunk, torch.Tensor]]] = {}
    for tg in targets:
        for chunk in tg.entry.chunks:
            if not chunk.nbytes:
                continue
            if len(tg.entry.chunks) == 1 and chunk.whole:
                land = tg.buf
            else:
                region = _region(tg.buf, chunk)
                if region.is_contiguous():
                    land = region
                else:
                    land = torch.empty(chunk.sizes, dtype=tg.entry.dtype)
                    tg.copies.append((region, land))
            by_file.setdefault(chunk.file, []).append((tg, chunk, land))
    bad: list[str] = []
    for name, group in by_file.items():
        jobs = [(c, blobs.byte_view(land)) for _, c, land in group]
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
            if tg.buf.numel() and tg.buf.data_ptr() != tg.dest.data_ptr():
                tg.dest.copy_(tg.buf)


def per_rank_check(parsed: ParsedManifest, selected: list[tuple[KeyPath, str]], world: int) -> None:
    roots = parsed.per_rank_roots
    if not roots or parsed.world_size == world:
        return
    hit = [r for r in roots if any(p[: len(r)] == r for p, _ in selected)]
    if hit:
        raise TemplateMismatch(
            f"per-rank state {', '.join(format_path(r) for r in hit)} was saved by "
            f"{parsed.world_size} ranks but this run has {world}; pass reshard=fn to map it "
            "(see the multi-rank guide), or leave it out of the template with partial=True"
        )


@dataclass
class RankView:
    """A checkpoint as this rank restores it: what it shares, and its own per-rank part."""

    parsed: ParsedManifest
    template: TensorDictBase | None
    mine: TensorDict | None = None  # per-rank subtrees mapped by ``reshard``


def rank_view(
    src: checkpoint.Checkpoint,
    parsed: ParsedCheckpoint,
    template: TensorDictBase | None,
    *,
    partial: bool,
    reshard: Reshard | None,
    rank: int,
    world: int,
) -> RankView:
    """Pick this rank's per-rank state, or map it with ``reshard`` on a new world size.

    Without ``reshard`` a different world size refuses per-rank state the caller
    asks for (explicitly by the template, or implicitly by a template-free, full
    restore). Every view comes from the one parse ``parsed``.
    """
    mine_parsed = parsed.view(rank)
    if mine_parsed.world_size == world or not mine_parsed.per_rank_roots:
        return RankView(mine_parsed, template)  # the common case
    saved_world = parsed.shared
    roots = saved_world.per_rank_roots
    if reshard is not None:
        mine = resharded_per_rank(src, parsed, reshard, rank, world)
        return RankView(
            saved_world, None if template is None else without_roots(template, roots), mine
        )
    if template is None and not partial:
        per_rank_check(saved_world, [(r, "node") for r in roots], world)
    if template is not None:
        per_rank_check(saved_world, [(lf.path, lf.kind) for lf in iter_leaves(template)], world)
    return RankView(saved_world, template)


def build(
    src: checkpoint.Checkpoint,
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
    src: checkpoint.Checkpoint,
    parsed: ParsedManifest,
    selected: list[tuple[KeyPath, str]],
    wanted: dict[KeyPath, torch.Tensor],
    fresh: bool,
    *,
    inplace: bool = False,
    device: torch.device = CPU,
) -> list[Leaf]:
    """Read the selected entries into leaves, in the manifest's order.

    ``wanted`` maps key paths to template leaves: their dtype and device shape the
    result, and with ``inplace`` their storage receives it.
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


def resharded_per_rank(
    src: checkpoint.Checkpoint, parsed: ParsedCheckpoint, reshard: Reshard, rank: int, world: int
) -> TensorDict:
    """This rank's per-rank subtrees, mapped by the user from every saving rank's.

    ``reshard(saved, rank, world_size)`` gets one TensorDict per saving rank with
    its per-rank subtrees and returns this rank's.
    """
    roots = {r[0] for r in parsed.shared.per_rank_roots}
    saved = []
    for r in range(parsed.world_size):
        one = parsed.view(r)
        sel = [(p, k) for p, k in one.order if p[0] in roots]
        saved.append(build(src, one, sel, {}, True))
    return as_state(reshard(saved, rank, world))


def without_roots(template: TensorDictBase, roots: list[KeyPath]) -> TensorDict:
    """The template minus the per-rank subtrees (they come from ``reshard``)."""
    names = {r[0] for r in roots}
    kept = [leaf for leaf in iter_leaves(template) if leaf.path[0] not in names]
    return unflatten(kept, node_record(template))
