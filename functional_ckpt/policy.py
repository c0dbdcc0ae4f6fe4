"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy is a value made of pure functions, like an optax gradient transformation.
The object holds only configuration; everything that changes over a run lives in an
explicit ``PolicyState`` that the caller threads through::

    state = policy.init()
    for event in events:
        save = policy.decide(state, event)        # the vote, from (state, event) only
        state = policy.update(state, event, save)  # what happened: did a save occur?

``should_save(state, event) -> (save, new_state)`` is the two composed, for a policy
that decides alone. The split is what makes combinators exact: ``p | q`` first
combines the children's votes, then advances *every* leaf from the event and the
combined outcome, so ``on_improve`` compares with the best value actually saved,
``every_secs`` counts from the last actual save, and ``~(p | q)`` and ``~p & ~q``
move every leaf through the very same states.

Time comes in through the event (``Event(step, time=running_seconds)``); no policy
reads a clock, so equal inputs give equal decisions and a restart is exact. The
state is plain data (it goes through msgpack unchanged) and every policy has a
plain-data :attr:`~SavePolicy.spec` that :func:`policy_from_spec` rebuilds it from:
a stored state is only ever handed back to the policy of the same spec.

The one deliberate exception to purity is :func:`on_signal`, whose "a signal
arrived" flag is process state: a signal is an event of this process, not of the
run, and must not be replayed after a restore.
"""

from __future__ import annotations

import math
import operator
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeAlias

from functional_ckpt.errors import CheckpointError

__all__ = [
    "Event",
    "PolicyError",
    "PolicySpec",
    "PolicyState",
    "SavePolicy",
    "SignalPolicy",
    "always",
    "at_steps",
    "every_epochs",
    "every_secs",
    "every_steps",
    "never",
    "on_final",
    "on_improve",
    "on_signal",
    "policy_from_spec",
    "run_policy",
]

PolicyState: TypeAlias = (
    "bool | int | float | str | list[PolicyState] | dict[str, PolicyState] | None"
)
"""Plain data only: it is written into msgpack manifests and must round-trip exactly.

Lists, never tuples (msgpack reads tuples back as lists); dict keys are strings.
"""

PolicySpec: TypeAlias = dict[str, Any]
"""``{"kind": name, **arguments}``, nested for combinators; plain data like a state."""


class PolicyError(CheckpointError, ValueError):
    """A policy was given a state, event or spec it cannot use."""


@dataclass(frozen=True)
class Event:
    """One point in training at which the caller asks "should I save now?".

    ``step`` is required because every policy can at least count steps; ``epoch``,
    ``metrics`` and ``time`` are needed only by the policies that read them.
    ``time`` is *running* time in seconds (the manager supplies it, continued across
    restarts; a loop driving policies by hand passes its own). ``is_final`` marks the
    last event of a run (see :func:`on_final`).
    """

    step: int
    epoch: int | None = None
    metrics: Mapping[str, float] | None = None
    is_final: bool = False
    time: float | None = None

    def __post_init__(self) -> None:
        # Accept numpy/torch integer scalars (anything with __index__) but store a plain
        # int, so that nothing non-plain can leak into a policy state.
        object.__setattr__(self, "step", _as_int(self.step, "Event(step=...)"))
        if self.epoch is not None:
            object.__setattr__(self, "epoch", _as_int(self.epoch, "Event(epoch=...)"))
        if self.metrics is not None and not isinstance(self.metrics, Mapping):
            raise TypeError(f"Event(metrics={self.metrics!r}): metrics must be a mapping or None")
        if not isinstance(self.is_final, bool):
            raise TypeError(f"Event(is_final={self.is_final!r}): is_final must be a bool")
        if self.time is not None:
            if isinstance(self.time, bool) or not isinstance(self.time, int | float):
                raise TypeError(f"Event(time={self.time!r}): time must be a number of seconds")
            if not math.isfinite(self.time):
                raise ValueError(f"Event(time={self.time!r}): time must be finite")
            object.__setattr__(self, "time", float(self.time))


class SavePolicy(ABC):
    """Decides, event by event, whether to save; pure apart from :func:`on_signal`.

    Subclasses implement :meth:`init`, :meth:`decide`, :meth:`update` and
    :attr:`spec`. Neither ``decide`` nor ``update`` mutates the state it is given,
    so a caller can keep an old state (e.g. the one stored with a checkpoint).
    """

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
        """Kind and arguments as plain data; :func:`policy_from_spec` rebuilds the policy.

        A policy defined outside this module describes itself by type and repr, which
        is enough to tell whether a stored state is its own, but cannot be rebuilt.
        """
        return {"kind": "custom", "type": type(self).__qualname__, "repr": repr(self)}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        """``(save?, new_state)`` for a policy that decides alone: its vote is the outcome."""
        saved = self.decide(state, event)
        return saved, self.update(state, event, saved)

    def __or__(self, other: object) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return _Any(_flatten(_Any, (self, other)))

    def __and__(self, other: object) -> SavePolicy:
        if not isinstance(other, SavePolicy):
            return NotImplemented
        return _All(_flatten(_All, (self, other)))

    def __invert__(self) -> SavePolicy:
        return _Not(self)


# ---------------------------------------------------------------------------------------
# Helpers


def _as_int(value: object, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what}: expected an int, got bool {value!r}")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what}: expected an int, got {type(value).__name__} {value!r}") from None


def _positive_int(value: object, name: str, call: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{call}: {name} must be a positive int, got {value!r}")
    return value


def _state_dict(policy: SavePolicy, state: PolicyState, keys: Iterable[str]) -> dict[str, Any]:
    """Check that a (possibly restored) state has this policy's shape, and return it.

    A state that does not fit was written under a different policy; failing loudly
    beats silently misreading it.
    """
    expected = set(keys)
    if not isinstance(state, dict) or set(state) != expected:
        raise PolicyError(
            f"{policy!r}: state={state!r} does not fit this policy (expected a dict with "
            f"keys {sorted(expected)}); was it saved under a different policy? "
            "Use policy.init() to start over."
        )
    return state


def _no_state(policy: SavePolicy, state: PolicyState) -> None:
    if state is not None:
        raise PolicyError(
            f"{policy!r}: state={state!r} does not fit this stateless policy (expected "
            "None); was it saved under a different policy? Use policy.init() to start over."
        )


def _metric(event: Event, name: str) -> float | None:
    """The event's value of ``name`` as a float; None when missing or NaN (ignored)."""
    if event.metrics is None or name not in event.metrics:
        return None
    value = float(event.metrics[name])
    return None if math.isnan(value) else value


# ---------------------------------------------------------------------------------------
# Combinators


def _flatten(kind: type[_Any | _All], children: Iterable[SavePolicy]) -> list[SavePolicy]:
    """Merge nested nodes of the same kind, so ``a | b | c`` is one Any with 3 children."""
    out: list[SavePolicy] = []
    for child in children:
        if type(child) is kind:
            out.extend(child.children)
        else:
            out.append(child)
    return out


def _wrap(policy: SavePolicy, inside: type[SavePolicy]) -> str:
    """repr of a child, parenthesised only where Python's precedence needs it."""
    text = repr(policy)
    if isinstance(policy, _Any) and inside in (_All, _Not):
        return f"({text})"
    if isinstance(policy, _All) and inside is _Not:
        return f"({text})"
    return text


class _Combinator(SavePolicy):
    """Shared machinery of Any and All: a list state, one entry per child."""

    _symbol = ""
    _kind = ""

    def __init__(self, children: list[SavePolicy]) -> None:
        self.children: tuple[SavePolicy, ...] = tuple(children)

    def init(self) -> PolicyState:
        return [child.init() for child in self.children]

    def _states(self, state: PolicyState) -> list[PolicyState]:
        if not isinstance(state, list) or len(state) != len(self.children):
            raise PolicyError(
                f"{self!r}: state={state!r} does not fit this policy (expected a list of "
                f"{len(self.children)} child states); was it saved under a different "
                "policy? Use policy.init() to start over."
            )
        return state

    def _votes(self, state: PolicyState, event: Event) -> list[bool]:
        # Every child votes (no short-circuit): on_signal's flag is consumed either way.
        states = self._states(state)
        return [c.decide(s, event) for c, s in zip(self.children, states, strict=True)]

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        # Every child advances from the combined outcome, not from its own vote.
        states = self._states(state)
        return [c.update(s, event, saved) for c, s in zip(self.children, states, strict=True)]

    @property
    def spec(self) -> PolicySpec:
        return {"kind": self._kind, "children": [c.spec for c in self.children]}

    def __repr__(self) -> str:
        return f" {self._symbol} ".join(_wrap(c, type(self)) for c in self.children)


class _Any(_Combinator):
    _symbol = "|"
    _kind = "any"

    def decide(self, state: PolicyState, event: Event) -> bool:
        return any(self._votes(state, event))


class _All(_Combinator):
    _symbol = "&"
    _kind = "all"

    def decide(self, state: PolicyState, event: Event) -> bool:
        return all(self._votes(state, event))


class _Not(SavePolicy):
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
        return {"kind": "not", "child": self.child.spec}

    def __invert__(self) -> SavePolicy:
        return self.child  # ~~p is p, state shape included.

    def __repr__(self) -> str:
        return f"~{_wrap(self.child, _Not)}"


# ---------------------------------------------------------------------------------------
# Stateless policies


class _Stateless(SavePolicy):
    _name = ""

    def init(self) -> PolicyState:
        return None

    def decide(self, state: PolicyState, event: Event) -> bool:
        _no_state(self, state)
        return self._vote(event)

    def _vote(self, event: Event) -> bool:
        raise NotImplementedError

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        _no_state(self, state)
        return None

    @property
    def spec(self) -> PolicySpec:
        return {"kind": self._name}

    def __repr__(self) -> str:
        return f"{self._name}()"


class _Always(_Stateless):
    _name = "always"

    def _vote(self, event: Event) -> bool:
        return True


class _Never(_Stateless):
    _name = "never"

    def _vote(self, event: Event) -> bool:
        return False


class _OnFinal(_Stateless):
    _name = "on_final"

    def _vote(self, event: Event) -> bool:
        return event.is_final


def always() -> SavePolicy:
    """Save on every event (useful in tests and as the neutral element of ``&``)."""
    return _Always()


def never() -> SavePolicy:
    """Never save (the neutral element of ``|``)."""
    return _Never()


def on_final() -> SavePolicy:
    """Save on every event with ``is_final=True`` (the end of a run)."""
    return _OnFinal()


# ---------------------------------------------------------------------------------------
# Step and epoch counting


class _EverySteps(SavePolicy):
    def __init__(self, n: int, offset: int) -> None:
        self.n = n
        self.offset = offset

    def init(self) -> PolicyState:
        return {"last_saved_step": None}

    def decide(self, state: PolicyState, event: Event) -> bool:
        last = _state_dict(self, state, ["last_saved_step"])["last_saved_step"]
        step = event.step
        return step >= self.offset and (step - self.offset) % self.n == 0 and step != last

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        last = _state_dict(self, state, ["last_saved_step"])["last_saved_step"]
        return {"last_saved_step": event.step if saved else last}

    @property
    def spec(self) -> PolicySpec:
        return {"kind": "every_steps", "n": self.n, "offset": self.offset}

    def __repr__(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        return f"every_steps({self.n}{extra})"


def every_steps(n: int, offset: int = 0) -> SavePolicy:
    """Save at steps ``offset, offset + n, offset + 2n, ...``.

    Votes yes when ``step >= offset``, ``(step - offset) % n == 0`` and no save
    happened at this very step last time, so an event repeated for the same step (a
    retried iteration, a second call at the end of a step) saves only once. Steps
    need not increase: after the step counter is rolled back it fires again at the
    next matching step. With the default offset it fires at step 0 if you send an
    event for step 0; pass ``offset=n`` to skip that save.
    """
    n = _positive_int(n, "n", f"every_steps(n={n!r})")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"every_steps(offset={offset!r}): offset must be an int")
    return _EverySteps(n, offset)


class _EveryEpochs(SavePolicy):
    def __init__(self, n: int) -> None:
        self.n = n

    def init(self) -> PolicyState:
        # A run starts in epoch 0, so entering epoch 0 is not an advance and never saves.
        return {"last_epoch": 0, "owed": False}

    def _fields(self, state: PolicyState) -> tuple[int, bool]:
        fields = _state_dict(self, state, ["last_epoch", "owed"])
        return fields["last_epoch"], bool(fields["owed"])

    def decide(self, state: PolicyState, event: Event) -> bool:
        last, owed = self._fields(state)
        epoch = event.epoch
        if epoch is None:
            return False
        return (epoch > last and epoch % self.n == 0) or (epoch == last and owed)

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        last, owed = self._fields(state)
        epoch = event.epoch
        if epoch is None:
            return state
        if epoch > last:
            owed = epoch % self.n == 0
        elif epoch < last:
            owed = False
        return {"last_epoch": epoch, "owed": owed and not saved}

    @property
    def spec(self) -> PolicySpec:
        return {"kind": "every_epochs", "n": self.n}

    def __repr__(self) -> str:
        return f"every_epochs({self.n})"


def every_epochs(n: int) -> SavePolicy:
    """Save once on entering each epoch that is a positive multiple of ``n``.

    Votes yes when ``event.epoch`` is higher than the epoch of the previous event
    that had one (initially 0) and ``epoch % n == 0``, and keeps voting yes during
    that epoch until a save actually happens (inside ``&`` the other side may say
    no at first). Events with ``epoch=None`` are ignored and leave the state as it
    is. Works both for per-step events and for one event per finished epoch counted
    from 1. A jump over a multiple (epoch 1 to 3 with ``n=2``) does not save; an
    epoch that goes down is recorded, so counting up again saves again.
    """
    return _EveryEpochs(_positive_int(n, "n", f"every_epochs(n={n!r})"))


class _AtSteps(SavePolicy):
    def __init__(self, steps: frozenset[int]) -> None:
        self.steps = steps

    def init(self) -> PolicyState:
        return {"fired": []}

    def decide(self, state: PolicyState, event: Event) -> bool:
        fired = _state_dict(self, state, ["fired"])["fired"]
        return event.step in self.steps and event.step not in fired

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        fired = _state_dict(self, state, ["fired"])["fired"]
        if not saved or event.step not in self.steps or event.step in fired:
            return state
        return {"fired": sorted([*fired, event.step])}

    @property
    def spec(self) -> PolicySpec:
        return {"kind": "at_steps", "steps": sorted(self.steps)}

    def __repr__(self) -> str:
        return f"at_steps({sorted(self.steps)!r})"


def at_steps(steps: Iterable[int]) -> SavePolicy:
    """Save at each of the given steps, once each (a step already saved is skipped).

    The state remembers at which of them a save happened, so a run restored from a
    checkpoint does not save again at a listed step it has passed.
    """
    try:
        items = list(steps)
    except TypeError:
        raise TypeError(f"at_steps(steps={steps!r}): steps must be an iterable of ints") from None
    for s in items:
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"at_steps(steps={steps!r}): steps must be ints, got {s!r}")
    return _AtSteps(frozenset(items))


# ---------------------------------------------------------------------------------------
# Running time


class _EverySecs(SavePolicy):
    def __init__(self, secs: float) -> None:
        self.secs = secs

    def init(self) -> PolicyState:
        return {"since": None}

    def _since(self, state: PolicyState, event: Event) -> tuple[float | None, float]:
        since = _state_dict(self, state, ["since"])["since"]
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

    @property
    def spec(self) -> PolicySpec:
        return {"kind": "every_secs", "s": self.secs}

    def __repr__(self) -> str:
        return f"every_secs({self.secs!r})"


def every_secs(s: float) -> SavePolicy:
    """Save once at least ``s`` seconds of running time passed since the last save.

    Time is ``event.time``, the running time of the run in seconds (the manager
    counts it across restarts, excluding downtime); an event without it is an error.
    The first event only starts the timer (``since``); a save, made by this policy
    or any other in the same combination, restarts it. Time that goes backwards
    restarts the timer there, so it never adds time.
    """
    call = f"every_secs(s={s!r})"
    if isinstance(s, bool) or not isinstance(s, int | float):
        raise TypeError(f"{call}: s must be a number of seconds")
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{call}: s must be a positive, finite number of seconds")
    return _EverySecs(float(s))


# ---------------------------------------------------------------------------------------
# Metrics


class _OnImprove(SavePolicy):
    def __init__(self, metric: str, mode: str, min_delta: float) -> None:
        self.metric = metric
        self.mode = mode
        self.min_delta = min_delta

    def init(self) -> PolicyState:
        return {"best": None}

    def _best(self, state: PolicyState) -> float | None:
        best = _state_dict(self, state, ["best"])["best"]
        return None if best is None else float(best)

    def decide(self, state: PolicyState, event: Event) -> bool:
        best, value = self._best(state), _metric(event, self.metric)
        if value is None:
            return False
        if best is None:
            return True
        if self.mode == "min":
            return value < best - self.min_delta
        return value > best + self.min_delta

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        best, value = self._best(state), _metric(event, self.metric)
        if not saved or value is None:
            return state
        if best is None or (value < best if self.mode == "min" else value > best):
            return {"best": value}
        return state

    @property
    def spec(self) -> PolicySpec:
        return {
            "kind": "on_improve",
            "metric": self.metric,
            "mode": self.mode,
            "min_delta": self.min_delta,
        }

    def __repr__(self) -> str:
        extra = "" if self.mode == "min" else f", mode={self.mode!r}"
        if self.min_delta:
            extra += f", min_delta={self.min_delta!r}"
        return f"on_improve({self.metric!r}{extra})"


def on_improve(metric: str, mode: str = "min", min_delta: float = 0.0) -> SavePolicy:
    """Save when ``metrics[metric]`` beats the best saved value by more than ``min_delta``.

    The first value seen votes yes. ``best`` is the best value among the events on
    which a save actually happened (whichever policy caused it), so a slow
    improvement of less than ``min_delta`` per event still saves once it adds up,
    and a vote outvoted by ``&`` leaves ``best`` alone. Events without the metric
    and NaN values are ignored; infinities compare normally. ``best`` lives in the
    state, so a restored run keeps comparing against it.
    """
    if not isinstance(metric, str):
        raise TypeError(f"on_improve(metric={metric!r}): metric must be a str")
    if mode not in ("min", "max"):
        raise ValueError(f"on_improve(mode={mode!r}): mode must be 'min' or 'max'")
    if isinstance(min_delta, bool) or not isinstance(min_delta, int | float):
        raise TypeError(f"on_improve(min_delta={min_delta!r}): min_delta must be a number")
    if not (math.isfinite(min_delta) and min_delta >= 0):
        raise ValueError(f"on_improve(min_delta={min_delta!r}): min_delta must be finite and >= 0")
    return _OnImprove(metric, mode, float(min_delta))


# ---------------------------------------------------------------------------------------
# Signals


class SignalPolicy(SavePolicy):
    """Returned by :func:`on_signal`; adds :meth:`trigger` and :meth:`uninstall`."""

    def __init__(self, signum: signal.Signals) -> None:
        self.signum = signum
        self._pending = False
        self._installed = False
        self._previous: Any = None
        _require_main_thread(f"{self!r}")
        try:
            self._previous = signal.signal(signum, self._handle)
        except (OSError, ValueError) as exc:
            raise ValueError(f"on_signal(signum={signum!r}): cannot handle it: {exc}") from exc
        self._installed = True

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # After uninstall() we may still sit inside a later handler's chain; then we
        # only pass the signal on.
        if self._installed:
            self._pending = True
        previous = self._previous
        # SIG_DFL / SIG_IGN are not callable; None means a handler set outside Python.
        if callable(previous):
            previous(signum, frame)

    def trigger(self) -> None:
        """Act as if the signal had arrived (for tests and for manual preemption)."""
        self._pending = True

    def uninstall(self) -> None:
        """Stop handling the signal and restore the previous handler; idempotent.

        If another handler was installed on top of ours in the meantime, it is left in
        place (it may chain to us, and we then just pass the signal on).
        """
        if not self._installed:
            return
        _require_main_thread(f"{self!r}.uninstall()")
        if signal.getsignal(self.signum) == self._handle:
            previous = self._previous if self._previous is not None else signal.SIG_DFL
            signal.signal(self.signum, previous)
        self._installed = False
        self._pending = False

    def init(self) -> PolicyState:
        return None

    def decide(self, state: PolicyState, event: Event) -> bool:
        # The documented impurity: the vote consumes the process's flag.
        _no_state(self, state)
        pending, self._pending = self._pending, False
        return pending

    def update(self, state: PolicyState, event: Event, saved: bool) -> PolicyState:
        _no_state(self, state)
        return None

    @property
    def spec(self) -> PolicySpec:
        return {"kind": "on_signal", "signum": int(self.signum)}

    def __repr__(self) -> str:
        return f"on_signal(signal.{self.signum.name})"


def _require_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise CheckpointError(
            f"{what}: signal handlers can only be installed or removed from the main "
            "thread; create the policy there and pass it to other threads"
        )


def on_signal(signum: int = signal.SIGTERM) -> SignalPolicy:
    """Save at the next event after ``signum`` arrives (e.g. a preemption notice).

    Installs a handler when called, which must happen in the main thread. The handler
    sets a flag and then calls the previous handler if that was a Python callable. If
    the previous handler was ``SIG_DFL`` it is *not* invoked: for SIGTERM that would
    kill the process before it can save, and preemption notices come with a grace
    period meant for exactly that save. Your loop should therefore exit on its own
    after the final save. The flag is process state (not in ``PolicyState``); the next
    event's vote consumes it. Use ``.trigger()`` to raise the flag by hand and
    ``.uninstall()`` to restore the previous handler.
    """
    try:
        sig = signal.Signals(signum)
    except ValueError:
        raise ValueError(f"on_signal(signum={signum!r}): not a valid signal number") from None
    return SignalPolicy(sig)


# ---------------------------------------------------------------------------------------
# Specs


def _spec_args(spec: Mapping[str, Any], names: Iterable[str]) -> list[Any]:
    wanted = set(names)
    given = set(spec) - {"kind"}
    if given != wanted:
        raise PolicyError(
            f"policy spec {dict(spec)!r}: expected the arguments {sorted(wanted)}, got "
            f"{sorted(given)}"
        )
    return [spec[n] for n in names]


def policy_from_spec(spec: Mapping[str, Any]) -> SavePolicy:
    """Rebuild a save policy from its :attr:`~SavePolicy.spec` (plain data, no code).

    Rebuilding an ``on_signal`` spec installs its signal handler, as calling
    :func:`on_signal` does. A spec of unknown kind or with wrong arguments raises
    :class:`PolicyError`.
    """
    if not isinstance(spec, Mapping) or not isinstance(spec.get("kind"), str):
        raise PolicyError(f"policy spec {spec!r}: expected a dict with a str 'kind'")
    kind = spec["kind"]
    try:
        if kind in ("any", "all"):
            (children,) = _spec_args(spec, ["children"])
            if not isinstance(children, list) or len(children) < 2:
                raise PolicyError(f"policy spec {dict(spec)!r}: needs a list of >= 2 children")
            built = [policy_from_spec(c) for c in children]
            return _Any(built) if kind == "any" else _All(built)
        if kind == "not":
            (child,) = _spec_args(spec, ["child"])
            return _Not(policy_from_spec(child))
        simple: dict[str, Any] = {"always": always, "never": never, "on_final": on_final}
        if kind in simple:
            _spec_args(spec, [])
            made: SavePolicy = simple[kind]()
            return made
        if kind == "every_steps":
            return every_steps(*_spec_args(spec, ["n", "offset"]))
        if kind == "every_epochs":
            return every_epochs(*_spec_args(spec, ["n"]))
        if kind == "at_steps":
            return at_steps(*_spec_args(spec, ["steps"]))
        if kind == "every_secs":
            return every_secs(*_spec_args(spec, ["s"]))
        if kind == "on_improve":
            return on_improve(*_spec_args(spec, ["metric", "mode", "min_delta"]))
        if kind == "on_signal":
            return on_signal(*_spec_args(spec, ["signum"]))
    except PolicyError:
        raise
    except (TypeError, ValueError) as exc:
        raise PolicyError(f"policy spec {dict(spec)!r}: {exc}") from None
    raise PolicyError(f"policy spec {dict(spec)!r}: unknown kind {kind!r}")


# ---------------------------------------------------------------------------------------


def run_policy(
    policy: SavePolicy, events: Iterable[Event], state: PolicyState = None
) -> list[bool]:
    """Feed ``events`` through ``policy`` and return its decisions, for docs and tests.

    ``state=None`` means ``policy.init()``; pass a restored state to continue a run.
    (A stateless policy's state is also None, which init() returns anyway.)
    """
    current = policy.init() if state is None else state
    decisions: list[bool] = []
    for event in events:
        decision, current = policy.should_save(current, event)
        decisions.append(decision)
    return decisions
