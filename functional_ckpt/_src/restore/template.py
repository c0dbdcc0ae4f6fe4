"""Matching a checkpoint against the template, every mismatch listed in one error. Per-rank
subtrees are this rank's, or mapped by ``reshard`` when the world size changed."""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from itertools import compress, islice
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch

from functional_ckpt._src.distributed.topology import Topology, is_dtensor
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.view import ParsedCheckpoint
from functional_ckpt._src.restore.read import Request, mismatch, read_leaves, rebuild, spec_problem
from functional_ckpt._src.state.tree import (
    ATOMS,
    Leaf,
    as_state,
    is_subtree,
    leaves_of,
    root_record,
)
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import TemplateMismatch

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

_PATH_KIND = itemgetter(0, 1)

#: ``reshard(saved, rank, world_size)``: this rank's per-rank subtrees from every saving rank's.
Reshard = Callable[[list["TensorDict"], int, int], Any]


@dataclass
class Template:
    """``like`` or ``out`` as given, and its root's record (never rebuilt as a tree)."""

    state: Any  # None: made from ``known`` leaves
    root: dict[str, Any] | None = None
    known: list[Leaf] | None = None

    @classmethod
    def of(cls, state: TensorDictBase | Mapping[str, Any]) -> Template:
        return cls(state, root_record(state))

    @property
    def leaves(self) -> list[Leaf]:
        if self.known is None:
            self.known = leaves_of(self.state)
        return self.known

    @property
    def has_dtensor(self) -> bool:
        """Whether a leaf is a DTensor (its shards are read collectively)."""
        if "torch.distributed.tensor" not in sys.modules:  # no DTensor was ever made
            return False
        if self.known is None and isinstance(self.state, Mapping) and _plain(self.state):
            return False
        return any(lf.kind == "tensor" and is_dtensor(lf.value) for lf in self.leaves)

    def without(self, roots: list[KeyPath]) -> Template:
        """The template minus the subtrees under ``roots``' first keys (per-rank state)."""
        names = {r[0] for r in roots}
        return Template(None, self.root, [lf for lf in self.leaves if lf.path[0] not in names])


def _plain(state: Mapping[str, Any]) -> bool:
    """Whether a tree of Python containers surely holds no DTensor (nor a TensorDict)."""
    td = sys.modules.get("tensordict")
    stack, seen = [state], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue  # a container that contains itself: refused by the walk
        seen.add(id(node))
        values = list(node.values()) if isinstance(node, Mapping) else node
        types = set(map(type, values))
        for t in types - _SAFE:
            if t.__name__ == "DTensor" or (td and issubclass(t, td.TensorDictBase)):
                return False
        if not types.isdisjoint(_NESTED):
            stack.extend(compress(values, map(_NESTED.__contains__, map(type, values))))
    return True


_NESTED = frozenset({dict, OrderedDict, list, tuple})
_SAFE = _NESTED | ATOMS | {torch.Tensor}


def _saved_tree(state: Any, order: list[tuple[KeyPath, str]]) -> dict[KeyPath, Any] | None:
    """The tensors of a template of plain dicts holding the saved tree key for key, else None."""
    entries, targets = iter(order), dict[KeyPath, Any]()

    def walk(node: dict[str, Any], depth: int) -> bool:
        # as many saved entries as the node has items (fewer left: ValueError, below)
        for (name, v), (p, kind) in zip(node.items(), islice(entries, len(node)), strict=True):
            if len(p) != depth or p[-1] != name:
                return False
            if kind == "tensor":
                if not isinstance(v, torch.Tensor):
                    return False
                targets[p] = v
            elif kind == "node":
                if type(v) is not dict or not walk(v, depth + 1):
                    return False
            elif name == NODE_KEY or (type(v) not in ATOMS and is_subtree(v)):
                return False
        return True

    try:
        plain = type(state) is dict and walk(state, 1) and next(entries, None) is None
    except ValueError:  # the template has more than was saved
        return None
    return targets if plain else None


def select(
    parsed: ParsedManifest,
    template: Template | None,
    req: Request,
    *,
    specs: bool = True,
) -> tuple[list[tuple[KeyPath, str]], dict[KeyPath, torch.Tensor]]:
    """Match saved entries to the template; every mismatch is listed in one error. Without
    ``specs`` a template of the saved tree is matched by its keys alone (the read checks)."""
    if template is None:
        return parsed.order, {}
    tensors = parsed.tensors
    found = None if template.known is not None else _saved_tree(template.state, parsed.order)
    if found is None and list(map(_PATH_KIND, template.leaves)) == parsed.order:
        found = {p: t for p, k, t in template.leaves if k == "tensor"}  # compared in C above
    if found is not None:  # the tree that was saved
        targets: dict[KeyPath, torch.Tensor] = found
        if specs and (
            bad := [x for p, t in targets.items() if (x := spec_problem(tensors[p], t, req.cast))]
        ):
            raise mismatch(bad)
        return parsed.order, targets
    leaves = template.leaves
    tleaves = {leaf.path: leaf for leaf in leaves}
    # the empty nodes, filled from the checkpoint: a node's children follow it at once
    fill = [
        lf.path
        for i, lf in enumerate(leaves)
        if lf.kind == "node" and (i + 1 == len(leaves) or leaves[i + 1].path[:-1] != lf.path)
    ]
    saved_kinds = dict(parsed.order)
    problems: list[str] = []
    targets = {}
    for p, leaf in tleaves.items():
        kind = saved_kinds.get(p)
        if kind is None and p[-1] == NODE_KEY:
            continue  # the checkpoint's own container kind (a plain dict, say) is kept
        if kind is None:
            problems.append(f"  {format_path(p)}: missing from the checkpoint")
        elif kind != leaf.kind:
            problems.append(f"  {format_path(p)}: saved as a {kind}, template has a {leaf.kind}")
        elif kind == "tensor":
            problem = spec_problem(tensors[p], leaf.value, req.cast)
            if problem is None:
                targets[p] = leaf.value
            else:
                problems.append(problem)

    def wanted(p: KeyPath) -> bool:
        if p in tleaves or any(p[: len(f)] == f for f in fill):
            return True
        # a container record says how the saved subtree was built (an OrderedDict, a
        # list): a template written as plain dicts asks for it all the same
        return p[-1] == NODE_KEY and (len(p) == 1 or p[:-1] in tleaves)

    selected: list[tuple[KeyPath, str]] = []
    extra: list[KeyPath] = []
    for p, k in parsed.order:  # each saved entry asked once
        if wanted(p):
            selected.append((p, k))
        else:
            extra.append(p)
    if not req.partial:
        problems += [
            f"  {format_path(p)}: in the checkpoint but not in the template (pass partial=True "
            "to restore a subset)"
            for p in extra[:50]
        ]
        if len(extra) > 50:
            problems.append(f"  ... and {len(extra) - 50} more")
    if problems:
        raise mismatch(problems)
    return selected, targets


def rank_view(
    src: committed.Checkpoint,
    parsed: ParsedCheckpoint,
    template: Template | None,
    req: Request,
    topo: Topology,
    parts: frozenset[int] | None = None,
) -> tuple[ParsedManifest, Template | None, TensorDict | None]:
    """The checkpoint as this rank restores it, its template, and the per-rank subtrees
    ``reshard`` maps on a new world size; ``parts`` limits the split tensors' chunks read."""
    rank, world, reshard = topo.rank, topo.world, req.reshard
    mine_parsed = parsed.view(rank, parts)
    if mine_parsed.world_size == world or not mine_parsed.per_rank_roots:
        return mine_parsed, template, None  # the common case
    saved_world = parsed.shared
    roots = saved_world.per_rank_roots
    if reshard is not None:  # every saving rank's per-rank subtrees, one TensorDict each
        names = {r[0] for r in roots}
        saved = []
        for r in range(parsed.world_size):
            one = parsed.view(r, ())  # per-rank entries only: no split tensor is read
            sel = [(p, k) for p, k in one.order if p[0] in names]
            saved.append(rebuild(read_leaves(src, one, sel, {}, True), one.root, src.path))
        mine = as_state(reshard(saved, rank, world))
        return saved_world, None if template is None else template.without(roots), mine
    asked = roots if template is None else [lf.path for lf in template.leaves]
    hit = [r for r in roots if any(p[: len(r)] == r for p in asked)]
    if hit and (template is not None or not req.partial):
        raise TemplateMismatch(
            f"per-rank state {', '.join(format_path(r) for r in hit)} was saved by "
            f"{parsed.world_size} ranks but this run has {world}; pass reshard=fn to map it "
            "(see the multi-rank guide), or leave it out of the template with partial=True"
        )
    return saved_world, template, None
