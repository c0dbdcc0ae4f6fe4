"""Reading matched entries into new tensors shaped by their template leaves, every byte
checked: a restore never writes what it was given, except ``out=``'s tensors."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

import torch

from functional_ckpt._src import codec
from functional_ckpt._src.format.blobs import lands_raw
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import Chunk, TensorEntry, dtype_name, torch_dtype
from functional_ckpt._src.format.segments import Segment
from functional_ckpt._src.state.allocation import PREFAULT_BYTES, Prefaulter, host_empty
from functional_ckpt._src.state.tree import Leaf, unflatten, unflatten_python
from functional_ckpt._src.storage import committed, shards
from functional_ckpt._src.storage.committed import open_checkpoint
from functional_ckpt._src.text import short_repr
from functional_ckpt.errors import CorruptCheckpoint, TemplateMismatch, UnregisteredType

CPU = torch.device("cpu")


@dataclass(frozen=True)
class Request:
    """How the caller asked for a restore (everything but the path and the template)."""

    partial: bool = False
    cast: bool = False
    reshard: Callable[[list[Any], int, int], Any] | None = None  # ``template.Reshard``
    inplace: bool = False
    device: torch.device = CPU
    placeholders: bool = False  # keep values of unregistered classes (readers that only look)


def vetted_view(path: Path, *, rank: int | None = 0) -> ParsedManifest:
    """Authenticate and validate a committed checkpoint, seen from ``rank``."""
    with open_checkpoint(path) as ck:
        return committed.parsed(ck).view(rank)


@dataclass(slots=True)
class Reads:
    """The reads of one restore by file (a run of blobs per call), and the copies once checked."""

    #: Per file, its blobs (where each lands) and whose tensor each is.
    by_file: dict[str, tuple[list[shards.ReadJob], list[KeyPath]]] = field(default_factory=dict)
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    #: Template leaves that cannot receive their tensor (:func:`spec_problem`).
    problems: list[str] = field(default_factory=list)
    #: New large tensors read whole from one blob (its file and offset): their pages
    #: are faulted in beside the reads (:class:`~..state.allocation.Prefaulter`).
    fresh: list[tuple[str, int, torch.Tensor]] = field(default_factory=list)

    def _read(self, path: KeyPath, chunk: Chunk, land: shards.Landing) -> None:
        found = self.by_file.get(chunk.file)
        if found is None:
            found = self.by_file[chunk.file] = ([], [])
        found[0].append((chunk, land))
        found[1].append(path)

    def add(
        self,
        entry: TensorEntry,
        target: torch.Tensor | None,
        inplace: bool,
        device: torch.device,
        cast: bool = False,
    ) -> torch.Tensor:
        """Plan the reads of ``entry`` into a new tensor of the template leaf's dtype and device
        (``inplace``: into the leaf); returns it. A misfit is listed in :attr:`problems`."""
        chunks = entry.chunks
        c = chunks[0] if len(chunks) == 1 else None
        saved = torch_dtype(entry.dtype_name)
        if (  # the common case, decided at once: a small host tensor read from one blob
            c is not None and c.nbytes < PREFAULT_BYTES and c.sizes == entry.shape
        ) and not any(c.offsets):
            t = None
            shape = entry.shape
            if not inplace:  # a new host tensor
                if (
                    device.type == "cpu"
                    if target is None
                    else target.dtype is saved and target.is_cpu and target.shape == shape
                ):  # the sizes unpacked: a tuple costs torch.empty half as much again
                    t = torch.empty(*shape, dtype=saved) if shape else torch.empty((), dtype=saved)
            elif target is not None and target.shape == shape and lands_raw(target, saved):
                t = target
            if t is not None:
                if c.nbytes:
                    self._read(entry.path, c, t)
                return t
        if target is not None and (problem := spec_problem(entry, target, cast)) is not None:
            self.problems.append(problem)
            return target
        whole = len(chunks) == 1 and chunks[0].sizes == entry.shape and chunks[0].whole
        made = True  # ``buf`` is new memory
        if inplace and target is not None and not target.is_meta:
            dest = target
            direct = lands_raw(target, saved)
            made = not direct
            buf = target.detach() if direct else host_empty(entry.shape, saved, fault=not whole)
        else:
            dtype = saved if target is None else target.dtype
            where = device if target is None or target.is_meta else target.device
            direct = where.type == "cpu" and dtype == saved
            if direct:
                dest = buf = host_empty(entry.shape, saved, fault=not whole)
            else:
                dest = torch.empty(entry.shape, dtype=dtype, device=where)
                buf = host_empty(entry.shape, saved, fault=not whole)
        if whole:
            if chunks[0].nbytes:  # the common case, in one step
                self._read(entry.path, chunks[0], buf)
                if made and chunks[0].nbytes >= PREFAULT_BYTES:
                    self.fresh.append((chunks[0].file, chunks[0].offset, buf))
        else:
            for chunk in chunks:
                if not chunk.nbytes:
                    continue
                part = region(buf, chunk.offsets, chunk.sizes)
                if part.is_contiguous():
                    land = part
                else:
                    land = torch.empty(chunk.sizes, dtype=saved)
                    self.copies.append((part, land))
                self._read(entry.path, chunk, land)
        if not direct:
            self.copies.append((dest, buf))
        return dest

    def run(self, src: committed.Checkpoint, segments: Mapping[str, Sequence[Segment]]) -> None:
        """Read and check every planned blob; one error lists all damage."""
        bad: list[str] = []
        files = {name: i for i, name in enumerate(self.by_file)}
        in_order = sorted(self.fresh, key=lambda f: (files[f[0]], f[1]))  # as they are read
        faults = Prefaulter([t for _, _, t in in_order])  # none: no thread is started
        ready = faults.ready if in_order else None
        try:
            for name, (jobs, paths) in self.by_file.items():  # a file at a time, closed once read
                try:
                    results = shards.read_tensors(
                        src.fd(name), jobs, segments.get(name, ()), ready=ready
                    )
                finally:
                    src.release(name)
                for path, res in zip(paths, results, strict=True):
                    if res is not None:
                        bad.append(f"  {format_path(path)} in {name}: {res}")
        finally:
            faults.close()
        if bad:
            raise CorruptCheckpoint(f"{src.path}: damaged tensor data:\n" + "\n".join(bad))
        with torch.no_grad():
            for region, land in self.copies:
                region.copy_(land)


def spec_problem(e: TensorEntry, t: torch.Tensor, cast: bool) -> str | None:
    """Why template leaf ``t`` cannot receive the saved tensor ``e`` (None: it can)."""
    if t.shape == e.shape and (cast or t.dtype == e.dtype):
        return None
    why = "shape differs" if t.shape != e.shape else "dtype differs; pass cast=True to convert"
    return f"  {format_path(e.path)}: saved {e.spec}, template {tensor_spec(t)} ({why})"


#: Where an ``out=`` leaf lies: its first byte, the byte past its last, itself, its key.
Span = tuple[int, int, torch.Tensor, KeyPath]


def refuse_unwritable(
    written: Iterable[tuple[KeyPath, torch.Tensor]],
    saved: Callable[[KeyPath], torch.Tensor],
    source: Callable[[KeyPath], KeyPath] = lambda p: p,
) -> None:
    """Refuse, by key, ``out=`` leaves that cannot receive the checkpoint, before a byte is
    written: sparse and nested ones (no dense buffer: torch's own error names no key), one
    overlapping itself (expanded), two sharing memory that are not one tensor, and one tensor
    under two keys (a tie) saved as two (``source``) of other bits (``saved``). Spans are
    compared, so views interleaved in one buffer count too."""
    problems: list[str] = []
    spans: dict[torch.device, list[Span]] = {CPU: []}
    on_cpu, strided = spans[CPU], torch.strided
    for p, t in written:
        if t.is_nested or t.layout is not strided:
            kind = "nested" if t.is_nested else t.layout
            problems.append(f"  {format_path(p)}: a {kind} tensor; pass a dense one")
            continue
        start = t.data_ptr()  # 0: a meta or empty tensor, or a DTensor (its shard is written)
        if not start and hasattr(t, "_local_tensor"):
            t = t._local_tensor
            start = t.data_ptr()
        if not start:
            continue
        if t.is_contiguous():
            end = start + t.nbytes
        elif (reach := _reach(t)) is None:
            problems.append(f"  {format_path(p)}: overlaps itself; pass a tensor of its own")
            continue
        else:
            end = start + t.element_size() * (1 + reach)
        (on_cpu if t.is_cpu else spans.setdefault(t.device, [])).append((start, end, t, p))
    for found in filter(None, spans.values()):
        found.sort(key=itemgetter(0))
        last = found[0]  # of the spans so far, the one ending last
        for b in found[1:]:
            if b[0] < last[1]:
                x, y, q, r = last[2], b[2], last[3], b[3]
                why = "shares memory with"
                if b[1] == last[1] and x.dtype == y.dtype and x.is_set_to(y):  # one tensor
                    ok = source(q) == source(r) or same_bits(saved(q), saved(r))
                    why = "" if ok else "holds other saved values than its tie"
                if why:
                    problems.append(f"  {format_path(r)} {why} {format_path(q)}")
            if b[1] > last[1]:
                last = b
    if problems:
        raise TemplateMismatch("out= cannot receive the checkpoint:\n" + "\n".join(problems))


def element_bytes(t: torch.Tensor) -> torch.Tensor:
    """Each element's bytes as one row, to compare any dtype bit for bit."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(torch.uint8).reshape(flat.numel(), t.element_size())


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` hold the same bits (NaNs and signed zeros too)."""
    return a.dtype == b.dtype and torch.equal(element_bytes(a), element_bytes(b))


def _reach(t: torch.Tensor) -> int | None:
    """How many elements past its first ``t`` reaches; None where two indices may meet:
    unless each stride, smallest first, steps past all the smaller ones reach (torch's
    own check answers only for expanded and dense tensors)."""
    reach = 0
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride(), strict=True) if n > 1):
        if stride <= reach:
            return None
        reach += (size - 1) * stride
    return reach


def tensor_spec(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)}{list(t.shape)}"


def mismatch(problems: list[str]) -> TemplateMismatch:
    return TemplateMismatch("the checkpoint does not fit the template:\n" + "\n".join(problems))


def region(t: torch.Tensor, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
    """The view of ``t`` at ``offsets``, of ``sizes``."""
    for dim, (off, size) in enumerate(zip(offsets, sizes, strict=True)):
        t = t.narrow(dim, off, size)
    return t


def rebuild(
    leaves: list[Leaf], root: dict[str, Any] | None, src: Path, *, plain: bool = False
) -> Any:
    """The locked tree of ``leaves`` (``plain``: as Python containers); a misfit is damage."""
    try:
        return unflatten_python(leaves) if plain else unflatten(leaves, root)
    except (RuntimeError, ValueError) as e:  # batch sizes that do not fit the tensors
        raise CorruptCheckpoint(f"{src}: the saved tree does not fit together: {e}") from None


def read_leaves(
    src: committed.Checkpoint,
    parsed: ParsedManifest,
    selected: list[tuple[KeyPath, str]],
    wanted: dict[KeyPath, torch.Tensor],
    no_template: bool,
    req: Request = Request(),
) -> list[Leaf]:
    """Read the selected entries into leaves of their ``wanted`` template leaf's dtype and device
    (``inplace``: its storage); every leaf that does not fit is named before anything is read.
    Unregistered classes' values are refused unless ``placeholders``."""
    inplace, device, cast = req.inplace, req.device, req.cast
    reads = Reads()
    tensors = parsed.tensors
    chosen: set[KeyPath] | None = None  # the tensors read: made when a tie is met
    results: dict[KeyPath, torch.Tensor] = {}
    aliases: list[tuple[int, TensorEntry]] = []  # (place in leaves, entry): made once read
    leaves: list[Leaf] = []
    new = tuple.__new__  # a leaf per entry: made without Leaf's __new__
    for p, kind in selected:  # one pass: the leaves are made as their reads are planned
        if kind == "node":
            leaves.append(Leaf(p, "node", parsed.node_info.get(p)))
        elif kind == "value":
            leaves.append(new(Leaf, (p, "value", parsed.values[p])))
        else:
            e = tensors[p]
            if e.alias is not None:
                if chosen is None:
                    chosen = {q for q, k in selected if k == "tensor"}
                if e.alias in chosen:
                    like = wanted.get(p)
                    if like is not None and (problem := spec_problem(e, like, cast)) is not None:
                        reads.problems.append(problem)
                    aliases.append((len(leaves), e))
                    leaves.append(Leaf(p, "tensor", None))
                    continue
            like = wanted.get(p)
            t = results[p] = reads.add(e, like, inplace, device, cast)
            require_grad(t, like, inplace, no_template and e.requires_grad)
            leaves.append(new(Leaf, (p, "tensor", t)))
    if reads.problems:
        raise mismatch(reads.problems)
    reads.run(src, parsed.segments)
    with torch.no_grad():
        for i, e in aliases:
            assert e.alias is not None
            like = wanted.get(e.path)
            t = _tied(results[e.alias], like, inplace, device)
            require_grad(t, like, inplace, no_template and e.requires_grad)
            leaves[i] = Leaf(e.path, "tensor", t)
    if src.unregistered and not req.placeholders:
        refuse_unregistered(src.path, parsed, selected)
    return leaves


def saved_value(src: committed.Checkpoint, view: Callable[[], ParsedManifest]) -> Any:
    """Read one saved tensor of ``view()``, as a restore without a template would."""
    return lambda p: read_leaves(src, view(), [(p, "tensor")], {}, True)[0].value


def require_grad(t: torch.Tensor, like: torch.Tensor | None, inplace: bool, saved: bool) -> None:
    """Make ``t`` require grad as its template leaf (else the saved tensor, ``saved``) did."""
    wants = like.requires_grad if like is not None and not inplace else saved
    if wants and not t.requires_grad and (t.is_floating_point() or t.is_complex()):
        t.requires_grad_(True)


def refuse_unregistered(
    src: Path, parsed: ParsedManifest, selected: list[tuple[KeyPath, str]]
) -> None:
    """Refuse a placeholder for an unregistered class: in a training state it would fail
    later, far from the cause, or be saved over the real value."""
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
