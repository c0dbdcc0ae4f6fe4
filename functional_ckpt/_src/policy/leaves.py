"""The leaf save policies: constant, step, epoch, running-time and metric policies."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from functional_ckpt._src.policy.base import (
    Event,
    LeafPolicy,
    PolicyState,
    SavePolicy,
    better,
    finite_number,
    metric_and_mode,
    metric_value,
    positive_int,
)
from functional_ckpt.errors import PolicyError


class _Stateless(LeafPolicy):
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def decide(self, state: PolicyState, event: Event) -> bool:
        self.fields(state)
        return self.kind == "always" or (self.kind == "on_final" and event.is_final)


def always() -> SavePolicy:
    """Save on every event (useful in tests and as the neutral element of ``&``)."""
    return _Stateless("always")


def never() -> SavePolicy:
    """Never save (the neutral element of ``|``)."""
    return _Stateless("never")


def on_final() -> SavePolicy:
    """Save on every event with ``is_final=True`` (the end of a run)."""
    return _Stateless("on_final")


class _EverySteps(LeafPolicy):
    kind, params, defaults = "every_steps", ("n", "offset"), (("offset", 0),)
    initial = (("last_saved_step", None),)
    n: int
    offset: int

    def decide(self, state: PolicyState, event: Event) -> bool:
        last, step = self.fields(state)["last_saved_step"], event.step
        return step >= self.offset and (step - self.offset) % self.n == 0 and step != last

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        last = self.fields(state)["last_saved_step"]
        return {"last_saved_step": event.step if saved else last}


def every_steps(n: int, offset: int = 0) -> SavePolicy:
    """Save at steps ``offset, offset + n, ...`` (step 0 too: ``offset=n`` skips it),
    once per step, and again after a rollback of the step counter."""
    n = positive_int(n, "n", f"every_steps(n={n!r})")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"every_steps(offset={offset!r}): offset must be an int")
    return _EverySteps(n, offset)


class _EveryEpochs(LeafPolicy):
    kind, params = "every_epochs", ("n",)
    initial = (("ended", 0), ("end_step", None), ("saved", False))
    n: int

    def _fields(self, state: PolicyState) -> tuple[int, int | None, bool]:
        if isinstance(state, dict) and set(state) == {"last_epoch", "owed"}:
            state = self.init()  # the state of the former epoch-counter policy: counts anew
        fields = self.fields(state)
        return int(fields["ended"]), fields["end_step"], bool(fields["saved"])

    def decide(self, state: PolicyState, event: Event) -> bool:
        ended, end_step, saved = self._fields(state)
        if not event.epoch_end:
            return False
        if event.step == end_step:  # the same end again: saves if it has not yet
            return not saved and ended % self.n == 0
        return (ended + 1) % self.n == 0

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        ended, end_step, saved_then = self._fields(state)
        if not event.epoch_end:
            return {"ended": ended, "end_step": end_step, "saved": saved_then}
        if event.step == end_step:
            return {"ended": ended, "end_step": end_step, "saved": saved_then or saved}
        return {"ended": ended + 1, "end_step": event.step, "saved": saved}


def every_epochs(n: int) -> SavePolicy:
    """Save on every ``n``-th event marked ``epoch_end=True``; the state counts the ends
    (an end sent twice for one step counts once), so a restored run goes on counting."""
    return _EveryEpochs(positive_int(n, "n", f"every_epochs(n={n!r})"))


class _AtSteps(LeafPolicy):
    kind, params = "at_steps", ("steps",)
    initial: tuple[tuple[str, Any], ...] = (("fired", []),)
    steps: list[int]  # sorted, each once

    def decide(self, state: PolicyState, event: Event) -> bool:
        fired = self.fields(state)["fired"]
        return event.step in self.steps and event.step not in fired

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        fired = self.fields(state)["fired"]
        if not saved or event.step not in self.steps or event.step in fired:
            return state
        return {"fired": sorted([*fired, event.step])}


def at_steps(steps: Iterable[int]) -> SavePolicy:
    """Save at each of the given steps, once each: the state remembers the steps saved,
    so a restored run does not save again at one it has passed."""
    try:
        items = list(steps)
    except TypeError:
        raise TypeError(f"at_steps(steps={steps!r}): steps must be an iterable of ints") from None
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"at_steps(steps={steps!r}): steps must be ints, got {s!r}")
    return _AtSteps(sorted(set(items)))


class _EverySecs(LeafPolicy):
    kind, params = "every_secs", ("secs",)
    initial = (("since", None),)
    secs: float

    def _since(self, state: PolicyState, event: Event) -> tuple[float | None, float]:
        since = self.fields(state)["since"]
        if event.time is None:
            raise PolicyError(
                f"{self!r}: Event(step={event.step}) has no time; this policy needs the "
                "running time in seconds: pass Event(..., time=seconds) (a "
                "CheckpointManager supplies it)"
            )
        return (None if since is None else float(since)), event.time

    def decide(self, state: PolicyState, event: Event) -> bool:
        since, now = self._since(state, event)
        return since is not None and now - since >= self.secs

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        since, now = self._since(state, event)
        if saved or since is None or now < since:
            return {"since": now}
        return state


def every_secs(secs: float) -> SavePolicy:
    """Save once ``secs`` seconds of running time (``event.time``, required) passed since
    the first event or the last save (time going backwards restarts the timer too)."""
    return _EverySecs(finite_number(secs, "secs", f"every_secs(secs={secs!r})", positive=True))


class _OnImprove(LeafPolicy):
    kind, params = "on_improve", ("metric", "mode", "min_delta")
    defaults = (("mode", "min"), ("min_delta", 0.0))
    initial = (("best", None),)
    metric: str
    mode: str
    min_delta: float

    def _best(self, state: PolicyState) -> float | None:
        best = self.fields(state)["best"]
        return None if best is None else float(best)

    def decide(self, state: PolicyState, event: Event) -> bool:
        best, value = self._best(state), metric_value(event, self.metric)
        return value is not None and better(value, best, self.mode, self.min_delta)

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        best, value = self._best(state), metric_value(event, self.metric)
        if saved and value is not None and better(value, best, self.mode):
            return {"best": value}
        return state


def on_improve(metric: str, mode: str = "min", min_delta: float = 0.0) -> SavePolicy:
    """Save when ``metrics[metric]`` beats the best *saved* value (so slow improvements
    add up) by more than ``min_delta``; the first value votes yes, NaN or none is ignored.
    """
    metric, mode = metric_and_mode(metric, mode, "on_improve")
    min_delta = finite_number(min_delta, "min_delta", f"on_improve(min_delta={min_delta!r})")
    return _OnImprove(metric, mode, min_delta)
