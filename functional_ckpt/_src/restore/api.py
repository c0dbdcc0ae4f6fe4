"""``fc.restore``: open and vet once, match the template, read, unflatten, as the kind asks:
this format's, stock DCP's, or into DTensor templates."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch

from functional_ckpt._src.arguments import flag, require
from functional_ckpt._src.distributed.topology import Topology, topology
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.kind import is_stock_dcp
from functional_ckpt._src.format.naming import step_in_name
from functional_ckpt._src.format.view import ParsedCheckpoint
from functional_ckpt._src.log import done, logger, phase
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.restore import read
from functional_ckpt._src.restore.read import Request, read_leaves, rebuild
from functional_ckpt._src.restore.stock_dcp import StockFiles, StockMatch, match_dcp, read_dcp
from functional_ckpt._src.restore.template import Reshard, Template, rank_view, select
from functional_ckpt._src.state.tree import Leaf, State, gc_paused, is_tensordict, iter_leaves
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.committed import open_checkpoint
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

_LOG = logger("restore")


def check_like_or_out(like: State | None, out: State | None, what: str) -> None:
    """At most one of ``like`` (a new state is returned) and ``out`` (in place)."""
    if like is not None and out is not None:
        raise CheckpointError(
            f"{what}: pass like= (a new state is returned) or out= (restore in place), not both"
        )


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


class _Manifested:
    """A checkpoint of this format: opened, vetted and its manifest parsed, once."""

    def __init__(self, ck: committed.Checkpoint, topo: Topology, *, sparse: bool = False) -> None:
        self.ck = ck
        self.topo = topo
        self.parsed: ParsedCheckpoint = committed.parsed(ck)
        self.sparse = sparse  # match without split chunks: ``_Planned`` reads what it needs

    def match(self, template: Template | None, req: Request) -> Match:
        parts = frozenset[int]() if self.sparse else None
        parsed, template, mine = rank_view(self.ck, self.parsed, template, req, self.topo, parts)
        # read_leaves checks the tensors' specs; a collective read has DTensors it does not
        selected, wanted = select(parsed, template, req, specs=self.sparse)
        if req.inplace:
            saved = read.saved_value(
                self.ck, lambda: self.parsed.filled(parsed, range(parsed.parts))
            )
            read.refuse_unwritable(wanted.items(), saved, lambda p: parsed.tensors[p].alias or p)
        extra = [] if mine is None else list(iter_leaves(mine))
        return Match(parsed.root, parsed, selected, wanted, template is None, extra)

    def read(self, match: Match, req: Request) -> list[Leaf]:
        assert match.parsed is not None
        leaves = read_leaves(
            self.ck, match.parsed, match.selected, match.wanted, match.no_template, req
        )
        return leaves + match.resharded

    def close(self) -> None:
        self.ck.close()


class _Stock(StockFiles):
    def match(self, template: Template | None, req: Request) -> Match:
        stock = match_dcp(self, template, req)
        if req.inplace:  # stock DCP records no ties: a tie's saved bits decide
            items = {i.leaf.path: i for i in stock.items if i.fqn and i.leaf.kind == "tensor"}
            read.refuse_unwritable(
                ((p, i.leaf.value) for p, i in items.items()), lambda p: self.saved(items[p])
            )
        return Match(stock.root, stock=stock)

    def read(self, match: Match, req: Request) -> list[Leaf]:
        assert match.stock is not None
        return read_dcp(self, match.stock, inplace=req.inplace, device=req.device)


class _Planned:
    """A checkpoint of this format read collectively: a rank that fails fails every rank."""

    def __init__(self, path: Path, topo: Topology, group: Any) -> None:
        self.path = path
        self.group = group
        self.inner: _Manifested | None = None
        self.error: BaseException | None = None
        try:
            self.inner = _Manifested(open_checkpoint(path), topo, sparse=True)
        except BaseException as e:
            self.error = e

    def match(self, template: Template | None, req: Request) -> Match:
        from functional_ckpt._src.distributed.groups import agree

        got: Match | None = None
        error = self.error
        if self.inner is not None:  # opened: no error yet
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


#: A checkpoint opened and vetted once; every file is read through it.
Opened = _Manifested | _Stock | _Planned


def open_for_restore(path: Path, template: Template | None) -> Opened:
    """``path`` opened and vetted, read as its kind and ``template`` ask."""
    if is_stock_dcp(path):
        return _Stock(path)
    topo = topology()
    if template is not None and template.has_dtensor:
        from functional_ckpt._src.distributed.groups import checkpoint_group

        if not topo.initialized:
            raise CheckpointError(
                "restoring into DTensor templates needs an initialized process group"
            )
        return _Planned(path, topo, checkpoint_group(purpose="control"))
    ck = open_checkpoint(path)
    try:
        return _Manifested(ck, topo)
    except BaseException:
        ck.close()
        raise


@overload
def restore(
    path: PathLike,
    like: TensorDictBase | None = None,
    *,
    out: TensorDictBase | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict: ...
@overload
def restore(
    path: PathLike,
    like: dict[str, Any] | None = None,
    *,
    out: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> dict[str, Any]: ...
@overload
def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict: ...
def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> Any:
    """Read a checkpoint back as a new state: a locked TensorDict, or plain containers
    for a template of plain containers (such a restore never loads tensordict).

    A pure function of the files and ``like``, which only says which keys to read and
    each tensor's dtype and device (``meta`` leaves land on ``device``, default CPU;
    DTensor leaves get fresh shards on their mesh and placements); nothing it refers to
    is written, also when the restore fails. Without ``like`` the whole tree is rebuilt
    from the manifest. ``out=state`` restores in place, for memory-tight restores: the
    result holds ``out``'s tensors, whose contents are unspecified if it fails.
    """
    check_like_or_out(like, out, "fc.restore")
    require(reshard is None or callable(reshard), reshard, "reshard", "fc.restore", "a function")
    partial, cast = flag(partial, "partial", "fc.restore"), flag(cast, "cast", "fc.restore")
    req = Request(partial, cast, reshard, out is not None, device=_device(device))
    return _restore(path, like if out is None else out, req)


def _device(device: torch.device | str | None) -> torch.device:
    """``device=`` as a device this process can make tensors on (``cuda`` needs a GPU)."""
    try:
        dev = torch.device("cpu" if device is None else device)
        torch.empty(0, device=dev)
    except Exception as e:  # torch says no in many ways: RuntimeError, AssertionError...
        raise ValueError(f"fc.restore(device={device!r}): not a device here ({e})") from None
    return dev


def restore_for_viewing(path: PathLike) -> Any:
    """The whole state, unregistered classes' values as ``Unregistered`` placeholders."""
    return _restore(path, None, Request(placeholders=True))


def _restore(path: PathLike, chosen: State | None, req: Request) -> Any:
    with gc_paused():  # the manifest's parse and the template's walk make many objects
        template = None if chosen is None else Template.of(chosen)
        src, t0 = Path(path), time.perf_counter()
        with phase(_LOG, "open", src):
            opened = open_for_restore(src, template)
        try:
            with phase(_LOG, "match", src):
                match = opened.match(template, req)
            with phase(_LOG, "read", src):
                leaves = opened.read(match, req)
            plain = chosen is not None and not is_tensordict(chosen)
            result = rebuild(leaves, match.root, src, plain=plain)
        finally:
            opened.close()
        if _LOG.isEnabledFor(logging.INFO):
            nbytes = sum(v.nbytes for _, kind, v in leaves if kind == "tensor")
            seconds, step = time.perf_counter() - t0, step_in_name(src.name)
            done(_LOG, "restored", src, seconds=seconds, nbytes=nbytes, step=step, to="from")
        # Freed while collection is paused, the manifest's and the template's many
        # small objects are never walked by the collection that re-enabling triggers.
        del opened, match, leaves, template
    return result
