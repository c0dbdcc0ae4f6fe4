"""Read backends: a checkpoint opened and vetted once, then matched and read through one
interface, whether it is this format's, stock DCP's (its hardened ``.metadata``), or
read into DTensor templates (DCP's load planner, serving from the manifest)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import torch

from functional_ckpt._src.distributed.topology import Topology, topology
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.kind import is_stock_dcp
from functional_ckpt._src.format.view import ParsedCheckpoint
from functional_ckpt._src.restore.read import CPU, read_leaves
from functional_ckpt._src.restore.stock_dcp import StockFiles, StockMatch, match_dcp, read_dcp
from functional_ckpt._src.restore.template import Reshard, Template, rank_view, select
from functional_ckpt._src.state.tree import Leaf, iter_leaves
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.committed import open_vetted
from functional_ckpt.errors import CheckpointError


@dataclass(frozen=True)
class Request:
    """How the caller asked for a restore (everything but the path and the template)."""

    partial: bool = False
    cast: bool = False
    reshard: Reshard | None = None
    inplace: bool = False
    device: torch.device = CPU
    placeholders: bool = False  # keep values of unregistered classes (readers that only look)


@dataclass
class Match:
    """The template matched against a checkpoint: what will be read, and the tree's root."""

    root: dict[str, Any] | None
    parsed: ParsedManifest | None = None
    selected: list[tuple[KeyPath, str]] = field(default_factory=list)
    wanted: dict[KeyPath, torch.Tensor] = field(default_factory=dict)
    no_template: bool = True  # no template: requires_grad comes from the manifest
    resharded: list[Leaf] = field(default_factory=list)  # per-rank leaves mapped by ``reshard``
    stock: StockMatch | None = None


class Opened(Protocol):
    """A checkpoint opened and vetted once; every file is read through it."""

    path: Path

    def match(self, template: Template | None, req: Request) -> Match: ...

    def read(self, match: Match, req: Request) -> list[Leaf]: ...

    def close(self) -> None: ...


class _Manifested:
    """A checkpoint of this format: opened, vetted and its manifest parsed, once."""

    def __init__(self, ck: committed.Checkpoint, topo: Topology, *, sparse: bool = False) -> None:
        self.ck = ck
        self.path = ck.path
        self.topo = topo
        self.parsed: ParsedCheckpoint = committed.parsed(ck)
        # a collective restore matches without the split tensors' chunks, then reads
        # the parts its shards meet (``_Planned.read``)
        self.sparse = sparse

    def match(self, template: Template | None, req: Request) -> Match:
        view = rank_view(
            self.ck,
            self.parsed,
            template,
            partial=req.partial,
            reshard=req.reshard,
            rank=self.topo.rank,
            world=self.topo.world,
            parts=frozenset() if self.sparse else None,
        )
        selected, wanted = select(
            view.parsed, view.template, partial=req.partial, cast=req.cast, specs=self.sparse
        )  # read_leaves checks the tensors' specs; a collective read has DTensors it does not
        extra = [] if view.mine is None else list(iter_leaves(view.mine))
        return Match(view.parsed.root, view.parsed, selected, wanted, view.template is None, extra)

    def read(self, match: Match, req: Request) -> list[Leaf]:
        assert match.parsed is not None
        leaves = read_leaves(
            self.ck,
            match.parsed,
            match.selected,
            match.wanted,
            match.no_template,
            inplace=req.inplace,
            device=req.device,
            placeholders=req.placeholders,
            cast=req.cast,
        )
        return leaves + match.resharded

    def close(self) -> None:
        self.ck.close()


class _Stock:
    def __init__(self, files: StockFiles) -> None:
        self.files = files
        self.path = files.root
        self.md = files.metadata()

    def match(self, template: Template | None, req: Request) -> Match:
        stock = match_dcp(self.files, self.md, template, partial=req.partial, cast=req.cast)
        return Match(stock.root, stock=stock)

    def read(self, match: Match, req: Request) -> list[Leaf]:
        assert match.stock is not None
        return read_dcp(self.files, match.stock, inplace=req.inplace, device=req.device)

    def close(self) -> None:
        self.files.close()


class _Planned:
    """A checkpoint of this format read collectively: the ranks agree on every step.

    A rank that fails to open, vet or match fails every rank together, so no
    rank is left waiting in DCP's load.
    """

    def __init__(self, path: Path, topo: Topology, group: Any) -> None:
        self.path = path
        self.group = group
        self.inner: _Manifested | None = None
        self.error: BaseException | None = None
        try:
            self.inner = _Manifested(open_vetted(path), topo, sparse=True)
        except BaseException as e:
            self.error = e

    def match(self, template: Template | None, req: Request) -> Match:
        from functional_ckpt._src.distributed.groups import agree

        got: Match | None = None
        error = self.error
        if self.inner is not None and error is None:
            try:
                got = self.inner.match(template, req)
            except BaseException as e:
                error = e
        agree(error, self.group, f"restore {self.path}")
        assert got is not None
        return got

    def read(self, match: Match, req: Request) -> list[Leaf]:
        from functional_ckpt._src.restore.dtensor import parts_needed, read_sharded

        assert self.inner is not None and match.parsed is not None
        error: BaseException | None = None
        try:  # each rank reads the parts its shards meet: one may fail where others do not
            needed = parts_needed(match.parsed, match.selected, match.wanted)
            match = replace(match, parsed=self.inner.parsed.filled(match.parsed, needed))
        except BaseException as e:
            error = e  # agreed on with the reads, so no rank waits for this one
        assert match.parsed is not None
        sharded = read_sharded(
            self.inner.ck, match.parsed, match.wanted, self.group, inplace=req.inplace, error=error
        )
        rest = Match(
            match.root,
            match.parsed,
            [(p, k) for p, k in match.selected if p not in sharded],
            {p: t for p, t in match.wanted.items() if p not in sharded},
            False,
        )
        values = {leaf.path: leaf for leaf in self.inner.read(rest, req)}
        leaves: list[Leaf] = []
        for p, _ in match.selected:
            if p in sharded:
                leaves.append(Leaf(p, "tensor", sharded[p]))
            elif p in values:
                leaves.append(values[p])
        return leaves + match.resharded

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


def open_for_restore(path: Path, template: Template | None) -> Opened:
    """``path`` opened and vetted, read as its kind and ``template`` ask."""
    if is_stock_dcp(path):
        files = StockFiles(path)
        try:
            return _Stock(files)
        except BaseException:
            files.close()
            raise
    topo = topology()
    if template is not None and template.has_dtensor:
        from functional_ckpt._src.distributed.groups import checkpoint_group

        if not topo.initialized:
            raise CheckpointError(
                "restoring into DTensor templates needs an initialized process group"
            )
        return _Planned(path, topo, checkpoint_group())
    ck = open_vetted(path)
    try:
        return _Manifested(ck, topo)
    except BaseException:
        ck.close()
        raise
