"""Matching a checkpoint against the template: what is read, and into what.

``like``/``out`` say which keys to read and each tensor's dtype and device; every
mismatch is listed in one error. Per-rank subtrees (random generators, data
positions) are this rank's, or mapped by ``reshard`` when the world size changed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import itemgetter
from typing import TYPE_CHECKING, Any

import torch

from functional_ckpt._src.distributed.topology import is_dtensor
from functional_ckpt._src.format.entries import ParsedManifest
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.view import ParsedCheckpoint
from functional_ckpt._src.restore.read import mismatch, read_leaves, rebuild, spec_problem
from functional_ckpt._src.state.tree import Leaf, as_state, leaves_of, root_record
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import TemplateMismatch

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

_PATH_KIND, _VALUE = itemgetter(0, 1), itemgetter(2)

#: ``reshard(saved, rank, world_size)``: this rank's per-rank subtrees from every saving rank's.
Reshard = Callable[[list["TensorDict"], int, int], Any]


@dataclass(frozen=True)
class Template:
    """``like`` or ``out`` as a restore uses it: its leaves, walked once, and its root's record.

    A restore only matches and reads by key path, so the template is never rebuilt
    as a tree: a ``state_dict`` of plain containers is walked as it is.
    """

    leaves: list[Leaf]
    root: dict[str, Any] | None = None

    @classmethod
    def of(cls, state: TensorDictBase | Mapping[str, Any]) -> Template:
        return cls(leaves_of(state), root_record(state))

    @property
    def has_dtensor(self) -> bool:
        """Whether a leaf is a DTensor (its shards are read collectively)."""
        if "torch.distributed.tensor" not in sys.modules:  # no DTensor was ever made
            return False
        # the leaves' types first: a set made in C, where a per-leaf test is not
        if not any(t.__name__ == "DTensor" for t in set(map(type, map(_VALUE, self.leaves)))):
            return False
        return any(lf.kind == "tensor" and is_dtensor(lf.value) for lf in self.leaves)

    def without(self, roots: list[KeyPath]) -> Template:
        """The template minus the subtrees under ``roots``' first keys (per-rank state)."""
        names = {r[0] for r in roots}
        return Template([lf for lf in self.leaves if lf.path[0] not in names], self.root)


def select(
    parsed: ParsedManifest,
    template: Template | None,
    *,
    partial: bool,
    cast: bool,
    specs: bool = True,
) -> tuple[list[tuple[KeyPath, str]], dict[KeyPath, torch.Tensor]]:
    """Match saved entries to the template; every mismatch is listed in one error.

    Without ``specs`` a template of the tree that was saved is matched by its keys
    alone: :func:`~.read.read_leaves` checks each tensor's dtype and shape where
    it looks at the template leaf anyway.
    """
    if template is None:
        return parsed.order, {}
    leaves, tensors = template.leaves, parsed.tensors
    if len(leaves) == len(parsed.order) and list(map(_PATH_KIND, leaves)) == parsed.order:
        targets: dict[KeyPath, torch.Tensor] = {p: t for p, k, t in leaves if k == "tensor"}
        if specs and (
            bad := [x for p, t in targets.items() if (x := spec_problem(tensors[p], t, cast))]
        ):
            raise mismatch(bad)
        return list(parsed.order), targets
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
            problem = spec_problem(tensors[p], leaf.value, cast)
            if problem is None:
                targets[p] = leaf.value
            else:
                problems.append(problem)

    def wanted(p: KeyPath) -> bool:
        if p in tleaves or any(p[: len(f)] == f for f in fill):
            return True
        # A container record describes how the saved subtree was built (an
        # OrderedDict state_dict, a list); a template written as plain dicts asks
        # for that subtree all the same.
        return p[-1] == NODE_KEY and (len(p) == 1 or p[:-1] in tleaves)

    selected: list[tuple[KeyPath, str]] = []
    extra: list[KeyPath] = []
    for p, k in parsed.order:  # each saved entry asked once
        if wanted(p):
            selected.append((p, k))
        else:
            extra.append(p)
    if not partial:
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
    template: Template | None
    mine: TensorDict | None = None  # per-rank subtrees mapped by ``reshard``


def rank_view(
    src: committed.Checkpoint,
    parsed: ParsedCheckpoint,
    template: Template | None,
    *,
    partial: bool,
    reshard: Reshard | None,
    rank: int,
    world: int,
    parts: frozenset[int] | None = None,
) -> RankView:
    """Pick this rank's per-rank state, or map it with ``reshard`` on a new world size.

    Without ``reshard`` a different world size refuses per-rank state the caller
    asks for (explicitly by the template, or implicitly by a template-free, full
    restore). Every view comes from the one parse ``parsed``; ``parts`` limits the
    chunks of a split manifest's evenly split tensors to those parts' (none: every
    chunk), so that only the parts a rank reads are read.
    """
    mine_parsed = parsed.view(rank, parts)
    if mine_parsed.world_size == world or not mine_parsed.per_rank_roots:
        return RankView(mine_parsed, template)  # the common case
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
        return RankView(saved_world, None if template is None else template.without(roots), mine)
    if template is None and not partial:
        per_rank_check(saved_world, [(r, "node") for r in roots], world)
    if template is not None:
        per_rank_check(saved_world, [(lf.path, lf.kind) for lf in template.leaves], world)
    return RankView(saved_world, template)
