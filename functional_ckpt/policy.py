"""Save policies: pure, composable decisions about *when* to checkpoint.

A policy is modelled like an optax gradient transformation: the policy object holds
only configuration, and everything that changes over a run lives in an explicit
``PolicyState`` that the caller threads through::

    state = policy.init()
    for event in events:
        save, state = policy.should_save(state, event)

Keeping the state outside the object is what makes restarts exact: the manager
stores the state in each checkpoint's manifest and hands it back after a restore,
so "the best loss so far" or "seconds since the last save" survive a crash. That is
also why the state must be plain data (it goes through msgpack unchanged).

Policies compose with ``|`` (any), ``&`` (all) and ``~`` (not). Combinators always
evaluate every child, never short-circuit, so each child's state sees every event.

The one deliberate exception to purity is :func:`on_signal`, whose "a signal
arrived" flag is process state: a signal is an event of this process, not of the
run, and must not be replayed after a restore.
"""

from __future__ import annotations

import math
import operator
import signal
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from types import FrameType
from typing import Any, TypeAlias

from functional_ckpt.errors import CheckpointError

__all__ = [
    "Event",
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
    "run_policy",
]

PolicyState: TypeAlias = (
    "bool | int | float | str | list[PolicyState] | dict[str, PolicyState] | None"
)
"""Plain data only: it is written into msgpack manifests and must round-trip exactly.

Lists, never tuples (msgpack reads tuples back as lists); dict keys are strings.
"""


@dataclass(frozen=True)
class Event:
    """One point in training at which the caller asks "should I save now?".

    ``step`` is required because every policy can at least count steps; ``epoch`` and
    ``metrics`` are optional so that a loop without them can still use step/time
    policies. ``is_final`` marks the last event of a run (see :func:`on_final`).
    """

    step: int
    epoch: int | None = None
    metrics: Mapping[str, float] | None = None
    is_final: bool = False

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


class SavePolicy(ABC):
    """Decides, event by event, whether to save; pure apart from :func:`on_signal`.

    Subclasses implement :meth:`init` and :meth:`should_save`. ``should_save`` must not
    mutate the state it is given: it returns a new one, so a caller can keep the old
    state (for example the one stored with the previous checkpoint).
    """

    @abstractmethod
    def init(self) -> PolicyState:
        """The state of a run that has seen no events yet."""

    @abstractmethod
    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        """Return ``(save?, new_state)`` for ``event`` given the state after the last one."""

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

    A state that does not fit usually means the checkpoint was written under a
    different policy; failing loudly beats silently misreading it.
    """
    expected = set(keys)
    if not isinstance(state, dict) or set(state) != expected:
        raise ValueError(
            f"{policy!r}: state={state!r} does not fit this policy (expected a dict with "
            f"keys {sorted(expected)}); was it saved under a different policy? "
            "Use policy.init() to start over."
        )
    return state


def _no_state(policy: SavePolicy, state: PolicyState) -> None:
    if state is not None:
        raise ValueError(
            f"{policy!r}: state={state!r} does not fit this stateless policy (expected "
            "None); was it saved under a different policy? Use policy.init() to start over."
        )


def _fmt_float(x: float) -> str:
    return repr(float(x))


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

    def __init__(self, children: list[SavePolicy]) -> None:
        self.children: tuple[SavePolicy, ...] = tuple(children)

    def init(self) -> PolicyState:
        return [child.init() for child in self.children]

    def _step(self, state: PolicyState, event: Event) -> tuple[list[bool], PolicyState]:
        if not isinstance(state, list) or len(state) != len(self.children):
            raise ValueError(
                f"{self!r}: state={state!r} does not fit this policy (expected a list of "
                f"{len(self.children)} child states); was it saved under a different "
                "policy? Use policy.init() to start over."
            )
        decisions: list[bool] = []
        new_state: list[PolicyState] = []
        # Every child sees every event, so no child's state falls behind.
        for child, child_state in zip(self.children, state, strict=True):
            decision, child_new = child.should_save(child_state, event)
            decisions.append(decision)
            new_state.append(child_new)
        return decisions, new_state

    def __repr__(self) -> str:
        return f" {self._symbol} ".join(_wrap(c, type(self)) for c in self.children)


class _Any(_Combinator):
    _symbol = "|"

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        decisions, new_state = self._step(state, event)
        return any(decisions), new_state


class _All(_Combinator):
    _symbol = "&"

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        decisions, new_state = self._step(state, event)
        return all(decisions), new_state


class _Not(SavePolicy):
    """Negation; its state is the child's state, unchanged in shape."""

    def __init__(self, child: SavePolicy) -> None:
        self.child = child

    def init(self) -> PolicyState:
        return self.child.init()

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        decision, new_state = self.child.should_save(state, event)
        return not decision, new_state

    def __invert__(self) -> SavePolicy:
        return self.child  # ~~p is p, state shape included.

    def __repr__(self) -> str:
        return f"~{_wrap(self.child, _Not)}"


# ---------------------------------------------------------------------------------------
# Stateless policies


class _Always(SavePolicy):
    def init(self) -> PolicyState:
        return None

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        _no_state(self, state)
        return True, None

    def __repr__(self) -> str:
        return "always()"


class _Never(SavePolicy):
    def init(self) -> PolicyState:
        return None

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        _no_state(self, state)
        return False, None

    def __repr__(self) -> str:
        return "never()"


class _OnFinal(SavePolicy):
    def init(self) -> PolicyState:
        return None

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        _no_state(self, state)
        return event.is_final, None

    def __repr__(self) -> str:
        return "on_final()"


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
        return {"last_fired_step": None}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        last = _state_dict(self, state, ["last_fired_step"])["last_fired_step"]
        step = event.step
        fire = step >= self.offset and (step - self.offset) % self.n == 0 and step != last
        return fire, {"last_fired_step": step if fire else last}

    def __repr__(self) -> str:
        extra = f", offset={self.offset}" if self.offset else ""
        return f"every_steps({self.n}{extra})"


def every_steps(n: int, offset: int = 0) -> SavePolicy:
    """Save at steps ``offset, offset + n, offset + 2n, ...``.

    Fires when ``step >= offset``, ``(step - offset) % n == 0`` and ``step`` differs
    from the step at which it last fired, so an event repeated for the same step (a
    retried iteration, a second call at the end of a step) saves only once. It does
    not require steps to increase: after the step counter is rolled back it fires
    again at the next matching step. With the default offset it fires at step 0 if
    you send an event for step 0; pass ``offset=n`` to skip that save.
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
        return {"last_epoch": 0}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        last = _state_dict(self, state, ["last_epoch"])["last_epoch"]
        epoch = event.epoch
        if epoch is None:
            return False, state
        fire = epoch > last and epoch % self.n == 0
        return fire, {"last_epoch": epoch}

    def __repr__(self) -> str:
        return f"every_epochs({self.n})"


def every_epochs(n: int) -> SavePolicy:
    """Save on the first event of each epoch that is a positive multiple of ``n``.

    Fires when ``event.epoch`` is higher than the epoch of the previous event that had
    one (initially 0) and ``epoch % n == 0``. Events with ``epoch=None`` are ignored
    and leave the state unchanged. Works both for per-step events (the first step of
    epoch 2 saves "2 epochs done") and for one event per finished epoch counted from 1.
    A jump over a multiple (epoch 1 to 3 with ``n=2``) does not save: only the epoch
    actually reached is tested. An epoch that goes down is recorded, so counting up
    again saves again.
    """
    return _EveryEpochs(_positive_int(n, "n", f"every_epochs(n={n!r})"))


class _AtSteps(SavePolicy):
    def __init__(self, steps: frozenset[int]) -> None:
        self.steps = steps

    def init(self) -> PolicyState:
        return {"fired": []}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        fired = _state_dict(self, state, ["fired"])["fired"]
        if event.step not in self.steps or event.step in fired:
            return False, state
        return True, {"fired": sorted([*fired, event.step])}

    def __repr__(self) -> str:
        return f"at_steps({sorted(self.steps)!r})"


def at_steps(steps: Iterable[int]) -> SavePolicy:
    """Save at each of the given steps, once each (a repeated or replayed step is skipped).

    The state remembers which of them already fired, so a run restored from a
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
# Wall-clock time


class _EverySecs(SavePolicy):
    def __init__(self, secs: float, clock: Callable[[], float]) -> None:
        self.secs = secs
        self.clock = clock
        # Identifies this process's clock; a state carrying another token was written
        # by another process (or instance), whose clock readings mean nothing here.
        self.session = uuid.uuid4().hex

    def init(self) -> PolicyState:
        return {"session": self.session, "elapsed": 0.0, "last_clock": None}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        fields = _state_dict(self, state, ["session", "elapsed", "last_clock"])
        now = float(self.clock())
        elapsed = float(fields["elapsed"])
        last_clock = fields["last_clock"]
        if fields["session"] == self.session and last_clock is not None:
            # Same clock: count the time since the previous event (never negative).
            elapsed += max(0.0, now - float(last_clock))
        # Otherwise this is the first event, or a resume: (re)start the timer at `now`
        # and keep the running time accumulated before, so downtime does not count.
        fire = elapsed >= self.secs
        return fire, {
            "session": self.session,
            "elapsed": 0.0 if fire else elapsed,
            "last_clock": now,
        }

    def __repr__(self) -> str:
        return f"every_secs({_fmt_float(self.secs)})"


def every_secs(s: float, clock: Callable[[], float] = time.monotonic) -> SavePolicy:
    """Save once at least ``s`` seconds of *running* time passed since the last save.

    Running time is the sum of clock intervals between consecutive events of one
    process. The first event only starts the timer. The state stores the seconds
    accumulated since the last save, the last clock reading and a per-instance session
    token; when a state written by another instance (a new process after a restore,
    whose monotonic clock has an unrelated origin) comes in, the first event re-bases
    the timer and adds nothing, so downtime between the crash and the restart never
    counts, while the running time accumulated before the checkpoint does. A clock
    that goes backwards adds no time. After a save the count restarts from zero.
    """
    call = f"every_secs(s={s!r})"
    if isinstance(s, bool) or not isinstance(s, int | float):
        raise TypeError(f"{call}: s must be a number of seconds")
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{call}: s must be a positive, finite number of seconds")
    if not callable(clock):
        raise TypeError(f"every_secs(clock={clock!r}): clock must be callable")
    return _EverySecs(float(s), clock)


# ---------------------------------------------------------------------------------------
# Metrics


class _OnImprove(SavePolicy):
    def __init__(self, metric: str, mode: str, min_delta: float) -> None:
        self.metric = metric
        self.mode = mode
        self.min_delta = min_delta

    def init(self) -> PolicyState:
        return {"best": None}

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        best = _state_dict(self, state, ["best"])["best"]
        if event.metrics is None or self.metric not in event.metrics:
            return False, state
        value = float(event.metrics[self.metric])
        if math.isnan(value):
            return False, state
        if best is None:
            fire = True
        elif self.mode == "min":
            fire = value < best - self.min_delta
        else:
            fire = value > best + self.min_delta
        return fire, ({"best": value} if fire else state)

    def __repr__(self) -> str:
        extra = "" if self.mode == "min" else f", mode={self.mode!r}"
        if self.min_delta:
            extra += f", min_delta={self.min_delta!r}"
        return f"on_improve({self.metric!r}{extra})"


def on_improve(metric: str, mode: str = "min", min_delta: float = 0.0) -> SavePolicy:
    """Save when ``metrics[metric]`` beats the best saved value by more than ``min_delta``.

    The first value seen always saves. ``best`` is updated only when it fires, so it
    is the best value *saved*: a slow improvement of less than ``min_delta`` per event
    still saves once it adds up to more than ``min_delta``. Events without the metric
    and NaN values are ignored (no save, state unchanged); infinities compare normally.
    ``best`` lives in the state, so a restored run keeps comparing against it.
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

    def should_save(self, state: PolicyState, event: Event) -> tuple[bool, PolicyState]:
        _no_state(self, state)
        if not self._pending:
            return False, None
        self._pending = False
        return True, None

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
    event fires and clears it. Use ``.trigger()`` to raise the flag by hand and
    ``.uninstall()`` to restore the previous handler.
    """
    try:
        sig = signal.Signals(signum)
    except ValueError:
        raise ValueError(f"on_signal(signum={signum!r}): not a valid signal number") from None
    return SignalPolicy(sig)


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
