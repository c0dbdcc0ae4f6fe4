"""A decoded manifest validated once, and every rank's view of it. The manifest is untrusted:
every field is checked against the file table before a byte is allocated.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from copy import copy
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from functional_ckpt._src.format import naming
from functional_ckpt._src.format import parts as split_rule
from functional_ckpt._src.format.entries import (
    ParsedManifest,
    add_entry,
    add_table,
    checked_chunk,
    checked_int,
    entry_path,
    is_table,
    node_info,
)
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.manifest import Chunk, Entry, NodeEntry, TensorEntry, ValueEntry
from functional_ckpt._src.format.segments import FIELD as SEGMENTS
from functional_ckpt._src.format.segments import Segment, parse_segments
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint


def _files(
    manifest: dict[str, Any], root: Path, src: str
) -> tuple[dict[str, int], dict[str, tuple[Segment, ...]]]:
    """The file table: safe names, sizes, run checksums; one naming marker or manifest is forged."""
    files = manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{src}: missing file table")
    sizes: dict[str, int] = {}
    runs: dict[str, tuple[Segment, ...]] = {}
    for name, info in files.items():
        naming.safe_member(root, name)
        if name in (naming.COMMIT_MARKER, naming.MANIFEST):
            raise CorruptCheckpoint(f"{src}: the file table lists {name!r}, which it may not")
        if not isinstance(info, dict):
            raise CorruptCheckpoint(f"{src}: bad entry for file {name!r}")
        sizes[name] = checked_int(info.get("size"), src, f"size of {name!r}")
        if SEGMENTS in info:
            runs[name] = parse_segments(info[SEGMENTS], sizes[name], f"{src} file {name!r}")
    return sizes, runs


#: Reads, authenticates and decodes part ``rank`` of a split manifest.
PartLoader = Callable[[int], Any]


@dataclass
class _Part:
    """A validated part: a rank's per-rank entries, its chunk of every split tensor."""

    entries: list[Any]
    chunks: dict[KeyPath, Chunk]


#: What a rank's view adds to (copies of) the shared tree's.
_GROWN = ("tensors", "values", "nodes", "node_info", "inner", "split")


@dataclass
class ParsedCheckpoint:
    """A manifest validated once: the shared tree, and every rank's view (checked when needed)."""

    shared: ParsedManifest  # the view of ``rank=None``: per-rank subtrees left out
    ranks: list[list[Any]]  # each rank's per-rank entries, as decoded (one manifest)
    markers: list[tuple[int, KeyPath]]  # where in ``shared.order`` each per-rank subtree stands
    src: str
    load_part: PartLoader | None = None
    loaded: dict[int, _Part] = field(default_factory=dict)
    complete: bool = False  # every split tensor of ``shared`` holds its chunks
    views: dict[tuple[int, bool], ParsedManifest] = field(default_factory=dict)  # by complete

    @property
    def world_size(self) -> int:
        return self.shared.world_size

    def view(self, rank: int | None, parts: Iterable[int] | None = None) -> ParsedManifest:
        """The tree as ``rank`` sees it (None: no per-rank subtree), of ``parts`` only if given."""
        if parts is None:
            self._complete()
        if rank is not None and (rank, self.complete) not in self.views:
            self.views[(rank, self.complete)] = self._view(rank)
        got = self.shared if rank is None else self.views[(rank, self.complete)]
        return got if parts is None else self.filled(got, parts)

    def filled(self, view: ParsedManifest, parts: Iterable[int]) -> ParsedManifest:
        """``view`` with its evenly split tensors holding the chunks of ``parts``."""
        split = self.shared.split
        if not split:
            return view
        loaded = [self.part(r).chunks for r in sorted(set(parts)) if 0 <= r < self.world_size]
        tensors = dict(view.tensors)
        for p in split:
            tensors[p] = tensors[p].with_chunks(tuple(got[p] for got in loaded))
        for p, e in view.tensors.items():
            if e.alias is not None and e.alias in split:
                tensors[p] = e.with_chunks(tensors[e.alias].chunks)
        return replace(view, tensors=tensors)

    def part(self, rank: int) -> _Part:
        """Part ``rank`` of a split manifest, read and validated once."""
        if rank not in self.loaded:
            name = naming.part_name(rank)
            where = f"{Path(self.src).parent / name}"
            if self.load_part is None:
                raise CorruptCheckpoint(f"{where}: this reader was given no way to read it")
            own = self.shared.raw.get("version", 0) >= naming.PART_FILES_VERSION  # checks itself
            if not own and name not in self.shared.file_sizes:
                raise CorruptCheckpoint(f"{self.src}: the file table does not list {name}")
            self.loaded[rank] = validated_part(self.load_part(rank), rank, self.shared, where)
        return self.loaded[rank]

    def _complete(self) -> None:
        """Give every split tensor of the shared tree all its chunks (every part read)."""
        if not self.complete and self.shared.split:
            # every part's chunk is the rule's box: together they cover each tensor once
            self.shared.tensors.update(self.filled(self.shared, range(self.world_size)).tensors)
        self.complete = True

    def all_views(self) -> list[ParsedManifest]:
        """Every saving rank's view, in rank order."""
        return [self.view(r) for r in range(self.world_size)]

    def groups(self) -> list[list[TensorEntry]]:
        """:func:`tensor_groups` of this manifest (shared, then each rank's own)."""
        shared = self.shared.tensors
        mine = [[e for p, e in one.tensors.items() if p not in shared] for one in self.all_views()]
        return [list(shared.values()), *mine]

    def _view(self, rank: int) -> ParsedManifest:
        base = self.shared
        out = replace(base, rank=rank, order=[], **{f: copy(getattr(base, f)) for f in _GROWN})
        if base.parts:  # ``rank``'s per-rank entries, as decoded (None: beyond the world)
            mine = self.part(rank).entries if rank < base.parts else None
            src = f"{Path(self.src).parent / naming.part_name(rank)}"
        else:
            mine = self.ranks[rank] if rank < len(self.ranks) else None
            src = f"{self.src} rank {rank}"
        if mine is None:
            out.order = list(base.order)
            return out
        prev = 0
        for pos, path in self.markers:
            out.order += base.order[prev:pos]
            prev = pos
            for j, sub in enumerate(mine):
                wsub = f"{src} entry {j}"
                p = entry_path(sub, wsub) if isinstance(sub, dict) else ()
                if p[: len(path)] == path:
                    add_entry(out, sub, wsub)
        out.order += base.order[prev:]
        if len(out.split) != len(base.split):
            raise CorruptCheckpoint(f"{src}: a per-rank tensor declares a split")
        return out


def parse_checkpoint(
    manifest: dict[str, Any], root: Path, *, parts: PartLoader | None = None
) -> ParsedCheckpoint:
    """Validate a decoded manifest against its directory ``root`` once; ``parts`` reads parts."""
    src = str(root / "manifest.msgpack")
    out = ParsedManifest(manifest)
    n = manifest.get("parts", 0)  # per-rank parts of a split manifest (0: one manifest)
    if n != 0 and (type(n) is not int or not 2 <= n <= LIMITS.chunks_per_tensor):
        raise CorruptCheckpoint(f"{src}: invalid number of manifest parts {n!r}")
    out.parts = int(n)
    order = manifest.get("byteorder", "little")
    if order != sys.byteorder:
        raise CorruptCheckpoint(
            f"{src}: tensor bytes are {order}-endian; this machine is {sys.byteorder}-endian"
        )
    out.file_sizes, out.segments = _files(manifest, root, src)
    root_record = manifest.get("root", {})
    if not isinstance(root_record, dict):
        raise CorruptCheckpoint(f"{src}: invalid root record")
    out.root = node_info(root_record, f"{src} root")
    entries = manifest.get("entries")
    if not isinstance(entries, list):
        raise CorruptCheckpoint(f"{src}: missing entries")
    ranks = [] if out.parts else manifest.get("ranks", [])
    if not isinstance(ranks, list) or not all(
        isinstance(r, dict) and isinstance(r.get("entries"), list) for r in ranks
    ):
        raise CorruptCheckpoint(f"{src}: invalid per-rank table")
    out.world_size = out.parts or max(1, len(ranks))
    markers: list[tuple[int, KeyPath]] = []
    for i, e in enumerate(entries):
        where = f"{src} entry {i}"
        if isinstance(e, dict) and e.get("kind") == "per_rank":
            path = entry_path(e, where)
            out.per_rank_roots.append(path)
            markers.append((len(out.order), path))
        elif is_table(e):  # many plain tensors at once (a rank's own entries hold none)
            add_table(out, e, where)
        else:
            add_entry(out, e, where)
    return ParsedCheckpoint(out, [r["entries"] for r in ranks], markers, src, load_part=parts)


def validated_part(raw: object, rank: int, shared: ParsedManifest, where: str) -> _Part:
    """Validate part ``rank`` of a split manifest against its index's tree."""
    if not isinstance(raw, dict) or raw.get("part") != rank:
        raise CorruptCheckpoint(f"{where}: not part {rank} of this manifest")
    entries = raw.get("entries")
    rows = raw.get("chunks")
    split = shared.split
    if not isinstance(entries, list):
        raise CorruptCheckpoint(f"{where}: missing per-rank entries")
    if shared.raw.get("version", 0) >= naming.PART_FILES_VERSION:
        _add_files(raw, shared, where)
    if not isinstance(rows, list) or len(rows) != len(split):
        raise CorruptCheckpoint(
            f"{where}: {len(rows) if isinstance(rows, list) else 'no'} chunk rows for "
            f"{len(split)} split tensors"
        )
    chunks: dict[KeyPath, Chunk] = {}
    for i, (values, (p, dim)) in enumerate(zip(rows, split.items(), strict=True)):
        entry = shared.tensors[p]
        box = split_rule.split_box(entry.shape, dim, shared.parts, rank)
        plain = split_rule.row_plain(values, box)
        if plain is None:
            raise CorruptCheckpoint(f"{where}: invalid chunk row {i} ({format_path(p)})")
        chunks[p] = checked_chunk(plain, entry, shared, f"{where} row {i}")
    return _Part(entries, chunks)


def _add_files(part: dict[str, Any], shared: ParsedManifest, where: str) -> None:
    """Add the files a part lists to the checkpoint's table; no other table may list one."""
    if part.get("created") != shared.raw.get("created"):
        raise CorruptCheckpoint(f"{where}: a part of another save than its index")
    sizes, runs = _files(part, Path(where).parent, where)
    known = shared.raw["files"]
    for name in sizes:
        if name in known or name == naming.DCP_METADATA or naming.parse_part(name) is not None:
            raise CorruptCheckpoint(f"{where}: lists {name!r}, which only one table may list")
    known.update(part["files"])
    shared.file_sizes.update(sizes)
    shared.segments.update(runs)


def parse_planned(plain: object, where: str) -> list[Entry]:
    """Entries of a save in progress from their plain form, by the one parser."""
    if not isinstance(plain, list):
        raise CorruptCheckpoint(f"{where}: not a list of entries")
    out = ParsedManifest({}, planned=True)
    for i, e in enumerate(plain):
        add_entry(out, e, f"{where} entry {i}")
    return [
        NodeEntry(p, out.node_info.get(p))
        if kind == "node"
        else ValueEntry(p, out.values[p])
        if kind == "value"
        else out.tensors[p]
        for p, kind in out.order
    ]
