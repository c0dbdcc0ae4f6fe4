"""The save-policy protocol: ``Event``, ``SavePolicy``, its state, and the combinators
(here because ``SavePolicy``'s ``|``, ``&`` and ``~`` build them)."""

from __future__ import annotations

import copy
import math
import operator
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from functional_ckpt.errors import PolicyError

PolicyState: TypeAlias = (
    "bool | int | float | str | list[PolicyState] | dict[str, PolicyState] | None"
)
"""Plain data that round-trips through msgpack exactly: lists, never tuples; str keys."""

PolicySpec: TypeAlias = str | dict[str, Any] | list[Any]
"""A policy in configuration form, every argument spelled (``{"every_steps": {"n": 5,
"offset": 0}}``, ``"on_final"``, ``{"any": [...]}``, a list for a retention union)."""


@dataclass(frozen=True)
class Event:
    """One point in training at which the caller asks "should I save now?". ``time`` is
    *running* seconds; ``epoch`` is the loop's own count, recorded, read by no policy."""

    step: int
    epoch: int | None = None
    metrics: Mapping[str, float] | None = None
    is_final: bool = False
    time: float | None = None
    epoch_end: bool = False

    def __post_init__(self) -> None:
        # numpy/torch integer scalars stored as plain ints: nothing else leaks into a state
        object.__setattr__(self, "step", as_int(self.step, "Event(step=...)"))
        if self.epoch is not None:
            object.__setattr__(self, "epoch", as_int(self.epoch, "Event(epoch=...)"))
        if self.metrics is not None and not isinstance(self.metrics, Mapping):
            raise TypeError(f"Event(metrics={self.metrics!r}): metrics must be a mapping or None")
        for name in ("is_final", "epoch_end"):
            if not isinstance(value := getattr(self, name), bool):
                raise TypeError(f"Event({name}={value!r}): {name} must be a bool")
        if self.time is not None:
            if isinstance(self.time, bool) or not isinstance(self.time, int | float):
                raise TypeError(f"Event(time={self.time!r}): time must be a number of seconds")
            if not math.isfinite(self.time):
                raise ValueError(f"Event(time={self.time!r}): time must be finite")
            object.__setattr__(self, "time", float(self.time))


class SavePolicy(ABC):
    """Decides, event by event, whether to save; ``decide`` and ``update`` never mutate
    the state given, so a caller can keep an old one (the one stored with a checkpoint)."""

    @abstractmethod
    def init(self) -> PolicyState:
        """The state of a run that has seen no events yet."""

    @abstractmethod
    def decide(self, state: PolicyState, event: Event) -> bool:
        """This policy's vote on ``event``, from ``(state, event)`` alone."""

    @abstractmethod
    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        """The state after ``event``, given whether a save actually happened on it."""

    @property
    def spec(self) -> PolicySpec:
        """Its configuration form, which a checkpoint records (one defined outside this
        package gives its type and repr: enough to recognise its state, not to rebuild it)."""
        return custom_spec(self)

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        """``(save?, new_state)`` for a policy that decides alone: its vote is the outcome."""
        saved = self.decide(state, event)
        return saved, self.update(state, event, saved)

    def __or__(self, other: object) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return AnyOf(_flatten(AnyOf, (self, other)))

    def __and__(self, other: object) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return AllOf(_flatten(AllOf, (self, other)))

    def __invert__(self) -> SavePolicy:
        return Not(self)


def custom_spec(policy: object) -> PolicySpec:
    """The spec of a policy defined outside this package: its type and repr."""
    return {"custom": {"type": type(policy).__qualname__, "repr": repr(policy)}}


def call_text(kind: str, args: Mapping[str, Any], shown: int, defaults: Iterable[Any]) -> str:
    """The call that makes a policy: the first ``shown`` arguments by position, the rest
    by name unless at their default (``defaults``: (name, value) pairs)."""
    defaults = dict(defaults)
    parts = [
        repr(v) if i < shown else f"{k}={v!r}"
        for i, (k, v) in enumerate(args.items())
        if i < shown or k not in defaults or defaults[k] != v
    ]
    return f"{kind}({', '.join(parts)})"


class LeafPolicy(SavePolicy):
    """A policy made of its ``params`` (in order), whose spec is ``{kind: {param:
    attribute}}`` (``kind`` alone without params), whose repr is the call that made it
    (see :func:`call_text`) and whose state is a dict of the keys of ``initial``."""

    kind = ""
    params: tuple[str, ...] = ()
    shown = 1
    defaults: tuple[tuple[str, Any], ...] = ()
    initial: tuple[tuple[str, Any], ...] | None = None  # the state's keys and first values

    def __init__(self, *args: Any) -> None:
        for name, value in zip(self.params, args, strict=True):
            setattr(self, name, value)

    def init(self) -> PolicyState:
        return None if self.initial is None else copy.deepcopy(dict(self.initial))

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        self.fields(state)  # a stateless policy's update, checked; the others define theirs
        return state

    def fields(self, state: PolicyState) -> dict[str, Any]:
        """``state``, checked to be of this policy's shape (stateless: None): one written
        under another policy fails."""
        if self.initial is None:
            if state is not None:
                raise misfit(self, state, "None")
            return {}
        keys = {k for k, _ in self.initial}
        if not isinstance(state, dict) or set(state) != keys:
            raise misfit(self, state, f"a dict with keys {sorted(keys)}")
        return state

    def _args(self) -> dict[str, Any]:  # a list copied: editing a spec leaves the policy
        return {p: list(v) if isinstance(v := getattr(self, p), list) else v for p in self.params}

    @property
    def spec(self) -> PolicySpec:
        return {self.kind: self._args()} if self.params else self.kind

    def __repr__(self) -> str:
        return call_text(self.kind, self._args(), self.shown, self.defaults)


def as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}: expected an int, got {type(value).__name__} {value!r}") from None


def finite_number(value: object, name: str, what: str, *, positive: bool = False) -> float:
    """``value`` as a finite float (``positive``: > 0, else >= 0), or an error naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{what}: {name} must be a number")
    if not (math.isfinite(value) and (value > 0 if positive else value >= 0)):
        rule = "a positive, finite number" if positive else "finite and >= 0"
        raise ValueError(f"{what}: {name} must be {rule}")
    return float(value)


def metric_and_mode(metric: object, mode: object, what: str) -> tuple[str, str]:
    """A metric's name and ``"min"`` or ``"max"``, as ``what`` takes them."""
    if not isinstance(metric, str):
        raise TypeError(f"{what}(metric={metric!r}): metric must be a str")
    if mode not in ("min", "max"):
        raise ValueError(f"{what}(mode={mode!r}): mode must be 'min' or 'max'")
    return metric, str(mode)


def better(value: float, than: float | None, mode: str, by: float = 0.0) -> bool:
    """``value`` beats ``than`` (None: anything does) by more than ``by`` ("min": lower)."""
    return than is None or (value < than - by if mode == "min" else value > than + by)


def positive_int(value: object, name: str, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{what}: {name} must be a positive int, got {value!r}")
    return value


def misfit(policy: SavePolicy, state: PolicyState, expected: str) -> PolicyError:
    return PolicyError(
        f"{policy!r}: state={state!r} does not fit this policy (expected {expected}); "
        "was it saved under a different policy? Use policy.init() to start over."
    )


def metric_value(event: Event, name: str, nan: bool = False) -> float | None:
    """The event's value of ``name`` as a float; None when missing or NaN (ignored, but
    kept when ``nan``: a diverged run is degraded)."""
    if event.metrics is None or name not in event.metrics:
        return None
    value = float(event.metrics[name])
    return None if math.isnan(value) and not nan else value


def _flatten(kind: type[AnyOf | AllOf], children: Iterable[SavePolicy]) -> list[SavePolicy]:
    """Merge nested nodes of the same kind, so ``a | b | c`` is one Any with 3 children."""
    return [g for c in children for g in (c.children if type(c) is kind else (c,))]


def _wrap(policy: SavePolicy, inside: type[SavePolicy]) -> str:
    """repr of a child, parenthesised only where Python's precedence needs it."""
    loose = isinstance(policy, AnyOf) and inside in (AllOf, Not)
    return (
        f"({policy!r})" if loose or (isinstance(policy, AllOf) and inside is Not) else repr(policy)
    )


class _Combinator(SavePolicy):
    """Any and All: a list state, one entry per child."""

    _symbol, _kind = "", ""

    def __init__(self, children: list[SavePolicy]) -> None:
        self.children: tuple[SavePolicy, ...] = tuple(children)

    def init(self) -> PolicyState:
        return [child.init() for child in self.children]

    def _states(self, state: PolicyState) -> list[PolicyState]:
        if not isinstance(state, list) or len(state) != len(self.children):
            raise misfit(self, state, f"a list of {len(self.children)} child states")
        return state

    def decide(self, state: PolicyState, event: Event) -> bool:
        # Every child votes (no short-circuit): on_signal's flag is consumed either way.
        states = self._states(state)
        votes = [c.decide(s, event) for c, s in zip(self.children, states, strict=True)]
        return any(votes) if self._kind == "any" else all(votes)

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        # Every child advances from the combined outcome, not from its own vote.
        states = self._states(state)
        return [c.update(s, event, saved) for c, s in zip(self.children, states, strict=True)]

    @property
    def spec(self) -> PolicySpec:
        return {self._kind: [c.spec for c in self.children]}

    def __repr__(self) -> str:
        return f" {self._symbol} ".join(_wrap(c, type(self)) for c in self.children)


class AnyOf(_Combinator):
    """``p | q | ...``: saves when any child votes yes."""

    _symbol, _kind = "|", "any"


class AllOf(_Combinator):
    """``p & q & ...``: saves when every child votes yes."""

    _symbol, _kind = "&", "all"


class Not(SavePolicy):
    """Negation; its state is the child's state, unchanged in shape."""

    def __init__(self, child: SavePolicy) -> None:
        self.child = child

    def init(self) -> PolicyState:
        return self.child.init()

    def decide(self, state: PolicyState, event: Event) -> bool:
        return not self.child.decide(state, event)

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        return self.child.update(state, event, saved)

    @property
    def spec(self) -> PolicySpec:
        return {"not": self.child.spec}

    def __invert__(self) -> SavePolicy:
        return self.child  # ~~p is p, state shape included.

    def __repr__(self) -> str:
        return f"~{_wrap(self.child, Not)}"


def run_policy(
    policy: SavePolicy, events: Iterable[Event], state: PolicyState = None
) -> list[bool]:
    """``policy``'s decisions on ``events``, from ``state`` (None: ``policy.init()``)."""
    current = policy.init() if state is None else state
    decisions: list[bool] = []
    for event in events:
        decision, current = policy.should_save(current, event)
        decisions.append(decision)
    return decisions
