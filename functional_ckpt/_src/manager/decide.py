"""The decision of one ``maybe_save`` event: what every policy says, as one value.

The save policy, the export policy and the rollback rule each vote on the event, and
each advances its state from the outcome; under ``torch.distributed`` every rank then
adopts the coordinator's decision (clocks and metrics differ between ranks, and half
the ranks saving would deadlock the collective save). Nothing here writes anything.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from functional_ckpt._src.manager.collective import coordinator_decides
from functional_ckpt._src.manager.rollback_rule import Watch
from functional_ckpt._src.policy import Event, PolicyState, SavePolicy


@dataclass(frozen=True)
class Decision:
    """What to do on ``event`` and the policy states after it (stored with its save)."""

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
) -> Decision:
    """Every policy's vote on ``event``, and under ``torch.distributed`` the coordinator's."""
    saved = save.decide(save_state, event) or force
    policy_state = save.update(save_state, event, saved)
    exported = False
    if export is not None:
        exported = export.decide(export_state, event)
        export_state = export.update(export_state, event, exported)
    rolls, rule_state = watch.vote(event, saved)
    if distributed:  # one decision for all ranks: the coordinator's
        decided = (saved, policy_state, exported, export_state, event.time, rolls, rule_state)
        saved, policy_state, exported, export_state, now, rolls, rule_state = coordinator_decides(
            decided
        )
        event = dataclasses.replace(event, time=now)
    return Decision(event, saved, policy_state, exported, export_state, rolls, rule_state)
