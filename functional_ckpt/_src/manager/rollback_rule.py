"""Rolling back on degradation: the manager's side of a rollback rule (``rollback=``).

When the rule fires, ``maybe_save`` rolls back and returns the state in a :class:`SaveResult`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from functional_ckpt._src.log import warn
from functional_ckpt._src.manager.provenance import stored_state
from functional_ckpt._src.policy.base import AllOf, AnyOf, Event, Not, PolicyState, SavePolicy
from functional_ckpt._src.policy.degrade import OnDegrade
from functional_ckpt._src.policy.retention import best_steps
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt.errors import CheckpointWarning

#: Where a checkpoint's record keeps the rollback rule's spec and state.
RECORD_KEY = "rollback"


@dataclass(frozen=True)
class Rollback:
    """A rollback ``maybe_save`` made on ``step``: continue from ``state`` at ``to_step``
    (``branch``: where the newer checkpoints went; None if none or not the coordinator)."""

    step: int
    to_step: int
    state: TensorDict = field(repr=False)
    branch: str | None = None


class SaveResult(int):
    """``maybe_save``'s 1 or 0, as the ``bool`` it was, and the :class:`Rollback` made."""

    rollback: Rollback | None

    def __new__(cls, saved: bool, rollback: Rollback | None = None) -> SaveResult:
        result = super().__new__(cls, bool(saved))
        result.rollback = rollback
        return result

    @property
    def saved(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        if self.rollback is None:
            return repr(bool(self))
        return f"SaveResult(saved={bool(self)}, rollback={self.rollback!r})"


def _leaves(rule: SavePolicy) -> Iterator[SavePolicy]:
    if isinstance(rule, AnyOf | AllOf):
        for child in rule.children:
            yield from _leaves(child)
    elif isinstance(rule, Not):
        yield from _leaves(rule.child)
    else:
        yield rule


def choose_target(rule: OnDegrade, infos: Sequence[StepInfo]) -> int | None:
    """The kept checkpoint a rollback returns to (None if no kept one has the metric):
    the best (ties to the newer), or for ``"last_good"`` the newest not degraded from it."""
    ranked = best_steps(infos, rule.metric, rule.mode)
    if not ranked or rule.to == "best":
        return next(iter(ranked), None)
    best = float(next(i for i in infos if i.step == ranked[0]).metrics[rule.metric])
    for info in reversed(infos):
        value = info.metrics.get(rule.metric)
        if value is not None and not rule.degraded(float(value), best):
            return info.step
    return ranked[0]


class Watch:
    """A rollback rule and its state (``next``: after the current event, stored with its
    checkpoint; ``state`` once the event is through)."""

    def __init__(self, rule: object) -> None:
        self.rule: SavePolicy | None = None
        self.target: OnDegrade | None = None
        self.state: PolicyState = None
        self.next: PolicyState = None
        if rule is None:
            return
        if isinstance(rule, SavePolicy):
            self.target = next((p for p in _leaves(rule) if isinstance(p, OnDegrade)), None)
        if self.target is None:
            raise TypeError(
                f"CheckpointManager(rollback={rule!r}): a rollback rule is a policy holding "
                "an fc.policy.on_degrade(...) (it says which metric ranks the checkpoints)"
            )
        assert isinstance(rule, SavePolicy)
        self.rule = rule
        self.state = self.next = rule.init()

    def vote(self, event: Event, saved: bool) -> tuple[bool, PolicyState]:
        """(roll back?, the state after ``event``), given whether it saved."""
        if self.rule is None:
            return False, None
        return self.rule.decide(self.state, event), self.rule.update(self.state, event, saved)

    def entry(self) -> dict[str, Any]:
        """What a checkpoint's record stores of the rule: its spec and state."""
        if self.rule is None:
            return {}
        return {RECORD_KEY: {"spec": self.rule.spec, "state": self.next}}

    def resume(self, record: Mapping[str, Any], path: Path) -> None:
        """Continue from the state stored with a restored checkpoint."""
        if self.rule is not None:
            self.state = self.next = stored_state(self.rule, record, RECORD_KEY, path)


def roll_back(
    watch: Watch,
    event: Event,
    saved: bool,
    infos: Sequence[StepInfo],
    root: Path,
    rollback_to: Callable[[int, Mapping[str, Any]], tuple[TensorDict, str | None]],
) -> SaveResult:
    """The rule fired on ``event``: continue from the kept checkpoint it points to."""
    assert watch.target is not None
    target = choose_target(watch.target, infos)
    if target is None:
        warn(
            f"{root}: {watch.rule!r} fired at step {event.step}, but no kept checkpoint "
            f"records {watch.target.metric!r}; nothing to roll back to, the run goes on",
            CheckpointWarning,
            stacklevel=3,
        )
        return SaveResult(saved)
    metrics = dict(event.metrics or {})  # as ``metadata["rollbacks"]`` records the reason
    state, branch = rollback_to(
        target, {"rule": repr(watch.rule), "at_step": event.step, "metrics": metrics}
    )
    return SaveResult(saved, Rollback(event.step, target, state, branch))
