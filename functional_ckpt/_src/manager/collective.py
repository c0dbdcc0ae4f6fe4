"""What every rank of a job does together, on the training thread, around a save.

Each collective here is called by every rank in the same order, or the job hangs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src import codec
from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import is_dtensor
from functional_ckpt._src.manager.rollback_rule import Watch
from functional_ckpt._src.policy.base import Event, PolicyState, SavePolicy
from functional_ckpt._src.root.run import Run, cuts_of
from functional_ckpt._src.state.tree import Leaf, leaves_of, unflatten


def gathered(state: TensorDictBase | Mapping[str, Any], select: str | Sequence[str]) -> TensorDict:
    """The ``select`` subtree with every DTensor gathered (a collective) into a full tensor."""
    prefix = (select,) if isinstance(select, str) else tuple(select)
    leaves = []
    for leaf in leaves_of(state):
        if leaf.path[: len(prefix)] != prefix and leaf.path != prefix[: len(leaf.path)]:
            continue
        value = leaf.value
        if leaf.kind == "tensor" and is_dtensor(value):
            value = value.full_tensor()
        leaves.append(Leaf(leaf.path, leaf.kind, value))
    return unflatten(leaves)


def coordinator_decides(decision: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every rank adopts rank 0's decision and policy states: clocks and metrics differ
    between ranks, and half the ranks saving would deadlock the collective save."""
    group = groups.checkpoint_group(purpose="control")
    payload = codec.encode(list(decision))
    chosen = codec.decode(groups.all_gather_bytes(payload, group)[0])
    assert isinstance(chosen, list)
    return tuple(chosen)


def share_run(run: tuple[Run, bool] | None) -> tuple[Run, bool]:
    """Every rank adopts the run the coordinator found (or made) in the root, its cuts too."""
    rid, secret, made, cuts = coordinator_decides(
        (run[0].id, run[0].secret, run[1], run[0].cuts) if run is not None else ("", "", False, ())
    )
    return Run(str(rid), str(secret), cuts=cuts_of(cuts)), bool(made)


class Votes(NamedTuple):
    """Every policy's vote on one event (save, export, roll back) and its state after it."""

    event: Event
    saved: bool
    policy_state: PolicyState
    exported: bool
    export_state: PolicyState
    rolls: bool
    rule_state: PolicyState


def decide(
    event: Event,
    *,
    force: bool,
    save: SavePolicy,
    save_state: PolicyState,
    export: SavePolicy | None,
    export_state: PolicyState,
    watch: Watch,
    distributed: bool,
) -> Votes:
    """The votes on ``event``; in a job, the coordinator's (its clock's time too)."""
    saved = save.decide(save_state, event) or force
    policy_state = save.update(save_state, event, saved)
    exported = False
    if export is not None:
        exported = export.decide(export_state, event)
        export_state = export.update(export_state, event, exported)
    votes = Votes(event, saved, policy_state, exported, export_state, *watch.vote(event, saved))
    if not distributed:
        return votes
    *chosen, now = coordinator_decides((*votes[1:], event.time))
    return Votes(dataclasses.replace(event, time=now), *chosen)


def together(distributed: bool, what: str, check: Callable[..., Any], *args: Any, **kw: Any) -> Any:
    """``check(...)``, its value: failed on any rank, failed on all (:func:`groups.agree`)."""
    if not distributed:
        return check(*args, **kw)
    error = value = None
    try:
        value = check(*args, **kw)
    except Exception as e:
        error = e
    groups.agree(error, groups.checkpoint_group(purpose="control"), what)
    return value
