"""Save policies: decision tables, algebra laws, restart semantics, plain-data state."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import signal
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from functional_ckpt._src import codec
from functional_ckpt._src.policy.base import Event, PolicyState, SavePolicy, run_policy
from functional_ckpt._src.policy.config import policy_from_config, stored_spec
from functional_ckpt._src.policy.leaves import (
    always,
    at_steps,
    every_epochs,
    every_secs,
    every_steps,
    never,
    on_final,
    on_improve,
)
from functional_ckpt._src.policy.signals import on_signal
from functional_ckpt.errors import CheckpointError, ConfigError, PolicyError
from tests import prefork
from tests.patience import HANG, eventually

REPO = Path(__file__).resolve().parents[1]


def steps(*ss: int) -> list[Event]:
    return [Event(step=s) for s in ss]


def fired_at(policy: SavePolicy, events: list[Event]) -> list[int]:
    return [e.step for e, d in zip(events, run_policy(policy, events), strict=True) if d]


def roundtrip(state: PolicyState) -> PolicyState:
    """What a state looks like after a manifest write and read."""
    return msgpack.unpackb(msgpack.packb(state), raw=False)


# --------------------------------------------------------------------------- tables


def test_every_steps_table() -> None:
    assert fired_at(every_steps(3), steps(*range(11))) == [0, 3, 6, 9]
    assert fired_at(every_steps(3, offset=1), steps(*range(9))) == [1, 4, 7]
    assert fired_at(every_steps(3, offset=3), steps(*range(7))) == [3, 6]
    # Sparse steps: only exact multiples count.
    assert fired_at(every_steps(5), steps(1, 4, 7, 10, 13, 15)) == [10, 15]


def test_every_steps_repeated_step_fires_once() -> None:
    policy = every_steps(3)
    assert run_policy(policy, steps(3, 3, 4, 3, 6, 6)) == [True, False, False, False, True, False]
    # The memory survives a restore: the checkpoint saved at 3 holds last_fired_step=3.
    state = policy.init()
    _, state = policy.should_save(state, Event(3))
    assert run_policy(policy, steps(3, 4, 6), state=roundtrip(state)) == [False, False, True]
    # A rollback of the step counter fires again at the next matching step.
    assert run_policy(policy, steps(3, 6, 3)) == [True, True, True]


def test_every_epochs_table() -> None:
    # Three epochs of four steps, per-step events; the last step of each marks its end.
    events = [Event(step=s, epoch=(s - 1) // 4, epoch_end=s % 4 == 0) for s in range(1, 13)]
    assert fired_at(every_epochs(1), events) == [4, 8, 12]
    assert fired_at(every_epochs(2), events) == [8]
    # One event per finished epoch, however the loop numbers them: the epoch is not read.
    for first in (0, 1, 7):
        ends = [Event(step=10 * e, epoch=first + e, epoch_end=True) for e in range(1, 5)]
        assert run_policy(every_epochs(1), ends) == [True] * 4
        assert run_policy(every_epochs(2), ends) == [False, True, False, True]
    # Events without an end never save, whatever their epoch.
    assert run_policy(every_epochs(1), [Event(i, epoch=i) for i in range(5)]) == [False] * 5


def test_every_epochs_counts_an_end_sent_twice_once() -> None:
    policy = every_epochs(2)
    state = policy.init()
    # The end of epoch 1, twice for the same step: counted once, no save (1 is not even).
    for _ in range(2):
        saved, state = policy.should_save(state, Event(step=4, epoch_end=True))
        assert not saved
    # The second end: saves; sent again after the save it does not save twice.
    assert policy.decide(state, Event(step=8, epoch_end=True))
    state = policy.update(state, Event(step=8, epoch_end=True), False)  # outvoted by &
    assert policy.decide(state, Event(step=8, epoch_end=True))  # still owed at that step
    state = policy.update(state, Event(step=8, epoch_end=True), True)
    assert not policy.decide(state, Event(step=8, epoch_end=True))
    # A state stored with a checkpoint goes on counting after a restore.
    assert run_policy(
        policy, [Event(12, epoch_end=True), Event(16, epoch_end=True)], roundtrip(state)
    ) == [
        False,
        True,
    ]
    # The state of the former epoch-number policy starts the count over.
    assert run_policy(
        every_epochs(1), [Event(3, epoch_end=True)], {"last_epoch": 2, "owed": False}
    ) == [True]


def test_at_steps_table() -> None:
    policy = at_steps([2, 5, 100])
    assert fired_at(policy, steps(0, 1, 2, 2, 3, 5, 5, 2)) == [2, 5]
    state = policy.init()
    for e in steps(0, 1, 2):
        _, state = policy.should_save(state, e)
    # Restored after step 2: 2 is not saved again, 5 still is.
    assert run_policy(policy, steps(2, 5), roundtrip(state)) == [False, True]
    assert run_policy(at_steps([]), steps(0, 1, 2)) == [False] * 3


def test_stateless_policies() -> None:
    events = [Event(1), Event(2), Event(3, is_final=True)]
    assert run_policy(always(), events) == [True, True, True]
    assert run_policy(never(), events) == [False, False, False]
    assert run_policy(on_final(), events) == [False, False, True]


def test_on_improve_min() -> None:
    losses = [3.0, 2.0, 2.0, 2.5, 1.0, math.inf]
    events = [Event(i, metrics={"loss": v}) for i, v in enumerate(losses)]
    assert run_policy(on_improve("loss"), events) == [True, True, False, False, True, False]


def test_on_improve_max_and_min_delta() -> None:
    acc = [0.5, 0.55, 0.59, 0.61, 0.6, 0.9]
    events = [Event(i, metrics={"acc": v}) for i, v in enumerate(acc)]
    assert run_policy(on_improve("acc", mode="max"), events) == [
        True, True, True, True, False, True,
    ]  # fmt: skip
    # best is the best *saved* value: 0.55 and 0.59 are within 0.1 of 0.5, 0.61 is not.
    assert run_policy(on_improve("acc", mode="max", min_delta=0.1), events) == [
        True, False, False, True, False, True,
    ]  # fmt: skip
    # min mode with min_delta: improvements must exceed it strictly.
    losses = [3.0, 2.8, 2.5, 2.4, 1.0]
    ev = [Event(i, metrics={"loss": v}) for i, v in enumerate(losses)]
    assert run_policy(on_improve("loss", min_delta=0.5), ev) == [True, False, False, True, True]


def test_on_improve_ignores_missing_metric_and_nan() -> None:
    policy = on_improve("loss")
    state = policy.init()
    for metrics in (None, {}, {"acc": 1.0}, {"loss": math.nan}):
        saved, after = policy.should_save(state, Event(1, metrics=metrics))
        assert not saved and after == state
    saved, state = policy.should_save(state, Event(2, metrics={"loss": 1.0}))
    assert saved
    saved, after = policy.should_save(state, Event(3, metrics={"loss": math.nan}))
    assert not saved and after == state


def test_on_improve_remembers_best_across_restore() -> None:
    events = [Event(i, metrics={"loss": v}) for i, v in enumerate([5.0, 3.0, 4.0])]
    first = on_improve("loss")
    state = first.init()
    for e in events:
        _, state = first.should_save(state, e)
    restored = json.loads(json.dumps(state))
    second = on_improve("loss")  # a new process builds a new, equal policy
    later = [Event(10 + i, metrics={"loss": v}) for i, v in enumerate([3.5, 3.0, 2.9])]
    assert run_policy(second, later, restored) == [False, False, True]
    assert run_policy(second, later) == [True, True, True]  # a fresh state would save


def test_combination_tables() -> None:
    p = every_steps(3) & ~at_steps([6])
    assert fired_at(p, steps(*range(13))) == [0, 3, 9, 12]

    q = every_steps(5) | on_improve("loss")
    losses = [9, 8, 8, 8, 8, 8, 7, 7, 7, 7, 7, 7]
    events = [Event(i, metrics={"loss": float(v)}) for i, v in enumerate(losses)]
    assert fired_at(q, events) == [0, 1, 5, 6, 10]

    r = every_epochs(2) | on_final()
    ev = [Event(i, epoch=i // 2, epoch_end=i % 2 == 1, is_final=i == 6) for i in range(7)]
    assert fired_at(r, ev) == [3, 6]

    s = (every_steps(2) | at_steps([3])) & ~on_final()
    ev = [Event(i, is_final=i == 4) for i in range(6)]
    assert fired_at(s, ev) == [0, 2, 3]


def test_combinators_advance_every_child_on_the_combined_outcome() -> None:
    """at_steps must record 6 as saved even though always() already decided the Any."""
    p = always() | at_steps([6])
    state = p.init()
    _, state = p.should_save(state, Event(6))
    assert state == [None, {"fired": [6]}]
    # No save happened at 6 (never() vetoed it): at_steps still owes step 6.
    q = never() & at_steps([6])
    state = q.init()
    _, state = q.should_save(state, Event(6))
    assert state == [None, {"fired": []}]
    assert (always() & at_steps([6])).decide(state, Event(6))


def test_every_secs_and_on_improve_saves_while_the_loss_falls() -> None:
    """Finding 16: the children of & used to advance on their own votes, so this saved
    nothing while the loss fell from 1.0 to 0.41, and best ended at a value never saved."""
    policy = every_secs(10) & on_improve("loss")
    drops = {3: 0.9, 13: 0.75, 23: 0.6, 33: 0.5, 43: 0.41}  # the loss falls at t = 3, 13, ...
    loss, saved_losses = 1.0, []
    state = policy.init()
    for t in range(51):
        loss = drops.get(t, loss)
        save, state = policy.should_save(state, Event(t, metrics={"loss": loss}, time=float(t)))
        if save:
            saved_losses.append(loss)
    assert saved_losses == [0.9, 0.75, 0.6, 0.5, 0.41]  # at t = 10, 20, 30, 40, 50
    best = state[1]["best"]  # type: ignore[index]
    assert best == 0.41 and best in saved_losses
    assert state[0] == {"since": 50.0}  # type: ignore[index]  # the timer restarted at the save


def test_on_improve_best_is_the_best_value_actually_saved() -> None:
    p = at_steps([0, 2]) | on_improve("loss")
    events = [Event(i, metrics={"loss": v}) for i, v in enumerate([5.0, 4.0, 6.0, 4.5])]
    assert run_policy(p, events) == [True, True, True, False]
    state = p.init()
    for e in events:
        _, state = p.should_save(state, e)
    assert state[1] == {"best": 4.0}  # type: ignore[index]  # 6.0 was saved but is worse
    q = on_improve("loss") & every_steps(2)  # 4.0 at step 1 is outvoted: not a best
    assert run_policy(q, events) == [True, False, False, False]
    state = q.init()
    for e in events:
        _, state = q.should_save(state, e)
    assert state[0] == {"best": 5.0}  # type: ignore[index]


def test_repr_and_flattening() -> None:
    assert repr(every_steps(1000) | every_secs(3600)) == "every_steps(1000) | every_secs(3600.0)"
    a, b, c = every_steps(2), at_steps([3, 1]), on_improve("acc", mode="max", min_delta=0.5)
    abc = a | b | c
    assert repr(abc) == (
        "every_steps(2) | at_steps([1, 3]) | on_improve('acc', mode='max', min_delta=0.5)"
    )
    assert isinstance(abc.init(), list) and len(abc.init()) == 3  # one flat Any node
    assert len(((a | b) | (c | on_final())).init()) == 4
    assert repr(~(a | b)) == "~(every_steps(2) | at_steps([1, 3]))"
    assert repr((a | b) & ~c) == (
        "(every_steps(2) | at_steps([1, 3])) & ~on_improve('acc', mode='max', min_delta=0.5)"
    )
    assert repr(a & b | c) == "every_steps(2) & at_steps([1, 3]) | " + repr(c)
    assert repr(~(a & b)) == "~(every_steps(2) & at_steps([1, 3]))"
    assert repr(every_steps(5, offset=2)) == "every_steps(5, offset=2)"
    assert repr(every_epochs(2) | on_final() | always() | never()) == (
        "every_epochs(2) | on_final() | always() | never()"
    )
    assert ~~a is a
    # repr is valid Python that rebuilds an equivalent policy.
    namespace = {"every_steps": every_steps, "at_steps": at_steps, "on_improve": on_improve}
    for p in (abc, ~(a | b), (a | b) & ~c, a & b | c):
        assert repr(eval(repr(p), namespace)) == repr(p)


def test_run_policy_with_state() -> None:
    p = every_steps(2)
    assert run_policy(p, []) == []
    assert run_policy(p, steps(2, 3, 4), state={"last_saved_step": 2}) == [False, False, True]


# --------------------------------------------------------------------------- every_secs


def timed(*times: float, step: int = 0) -> list[Event]:
    return [Event(step, time=float(t)) for t in times]


def test_every_secs_running_time_in_events() -> None:
    p = every_secs(10)
    decisions = run_policy(p, timed(1000, 1004, 1009, 1010, 1015, 1019, 1021, 1031))
    # The first event starts the timer; after a save the count restarts from zero.
    assert decisions == [False, False, False, True, False, False, True, True]


def test_every_secs_time_going_backwards_adds_nothing() -> None:
    p = every_secs(5)
    assert run_policy(p, timed(100, 90, 94, 95)) == [False, False, False, True]


def test_every_secs_continues_from_a_stored_state() -> None:
    p = every_secs(60)
    state = p.init()
    decisions = []
    for event in timed(50_000, 50_020, 50_060, 50_100):  # saves at +60, then 40 s accumulate
        saved, state = p.should_save(state, event)
        decisions.append(saved)
    assert decisions == [False, False, True, False]
    assert 50_100 - state["since"] == 40.0  # type: ignore[index,operator]
    manifest = json.dumps(state)  # plain data: survives json and msgpack exactly
    assert roundtrip(state) == state

    # A new process: a new instance; the running time (not a wall clock) continues.
    p2 = every_secs(60)
    restored = json.loads(manifest)
    decisions = run_policy(p2, timed(50_100, 50_110, 50_119, 50_120, 50_121), restored)
    # 40 s before the crash + 20 s after = 60 s at 50_120.
    assert decisions == [False, False, False, True, False]


def test_every_secs_state_is_not_mutated() -> None:
    p = every_secs(1)
    state = p.init()
    frozen = copy.deepcopy(state)
    _, mine = p.should_save(state, Event(0, time=0.0))
    assert state == frozen and mine == {"since": 0.0}
    assert p.should_save(mine, Event(1, time=1.0))[0]


def test_every_secs_needs_time_in_the_event() -> None:
    """No policy reads a clock: an event without time is an error naming the policy."""
    p = every_steps(5) | every_secs(3600)
    with pytest.raises(PolicyError, match=r"every_secs\(3600.0\).*no time.*time=seconds"):
        p.should_save(p.init(), Event(0))
    with pytest.raises(CheckpointError):
        every_secs(1).decide({"since": 0.0}, Event(1))


# --------------------------------------------------------------------------- on_signal


def test_on_signal_chains_previous_python_handler_and_uninstalls() -> None:
    calls: list[int] = []

    def previous(signum: int, frame: object) -> None:
        calls.append(signum)

    original = signal.signal(signal.SIGUSR1, previous)
    try:
        p = on_signal(signal.SIGUSR1)
        assert repr(p) == "on_signal(signal.SIGUSR1)"
        assert run_policy(p, steps(1)) == [False]
        os.kill(os.getpid(), signal.SIGUSR1)
        eventually(lambda: calls, "the signal handler", poll=0.001)
        assert calls == [signal.SIGUSR1]
        # The flag makes the next event save, once.
        assert run_policy(p, steps(2, 3)) == [True, False]
        p.trigger()
        assert run_policy(every_steps(100) | p, steps(4, 5)) == [True, False]
        p.uninstall()
        assert signal.getsignal(signal.SIGUSR1) is previous
        p.uninstall()  # idempotent
        assert signal.getsignal(signal.SIGUSR1) is previous
    finally:
        signal.signal(signal.SIGUSR1, original)


def test_on_signal_uninstall_leaves_later_handler_in_place() -> None:
    original = signal.getsignal(signal.SIGUSR2)
    try:
        first = on_signal(signal.SIGUSR2)
        second = on_signal(signal.SIGUSR2)  # chains to first
        second.trigger()
        first.uninstall()  # second is on top: leave it, first becomes pass-through
        assert signal.getsignal(signal.SIGUSR2) == second._handle
        second.uninstall()
        assert signal.getsignal(signal.SIGUSR2) == first._handle
        # first is uninstalled: it only passes the signal on and does not fire.
        first._handle(signal.SIGUSR2, None)
        assert run_policy(first, steps(1)) == [False]
    finally:
        signal.signal(signal.SIGUSR2, original)


def test_on_signal_does_not_run_sig_dfl() -> None:
    """SIGTERM's default action would kill the process before it could save."""
    script = textwrap.dedent(
        """
        import os, signal, time
        from functional_ckpt.policy import Event, on_signal, run_policy
        p = on_signal()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert run_policy(p, [Event(1), Event(2)]) == [True, False]
        p.uninstall()
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        print("survived")
        """
    )
    out = prefork.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=HANG
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "survived"


def test_on_signal_requires_main_thread() -> None:
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            on_signal(signal.SIGUSR1)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert len(errors) == 1 and isinstance(errors[0], CheckpointError)
    assert "main thread" in str(errors[0])


def test_on_signal_bad_signum() -> None:
    with pytest.raises(ValueError, match="signum"):
        on_signal(123456)
    with pytest.raises(ValueError, match="signum"):
        on_signal(signal.SIGKILL)


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("make", "exc", "message"),
    [
        (lambda: every_steps(0), ValueError, r"every_steps\(n=0\): n must be a positive int"),
        (lambda: every_steps(True), ValueError, "n must be a positive int"),
        (lambda: every_steps(2.0), ValueError, "n must be a positive int"),
        (lambda: every_steps(2, offset=1.5), TypeError, "offset must be an int"),
        (lambda: every_epochs(-1), ValueError, r"every_epochs\(n=-1\)"),
        (lambda: every_secs(0), ValueError, "s must be a positive"),
        (lambda: every_secs(math.inf), ValueError, "finite"),
        (lambda: every_secs("5"), TypeError, "s must be a number"),
        (lambda: every_secs(5, clock=3), TypeError, "clock"),
        (lambda: Event(step=1, time="now"), TypeError, r"Event\(time='now'\)"),
        (lambda: Event(step=1, time=math.nan), ValueError, "finite"),
        (lambda: on_improve(1), TypeError, "metric must be a str"),
        (lambda: on_improve("loss", mode="avg"), ValueError, "mode must be 'min' or 'max'"),
        (lambda: on_improve("loss", min_delta=-1), ValueError, "min_delta"),
        (lambda: on_improve("loss", min_delta=math.nan), ValueError, "min_delta"),
        (lambda: at_steps(5), TypeError, "steps must be an iterable"),
        (lambda: at_steps([1, "2"]), TypeError, "steps must be ints"),
        (lambda: Event(step=1.5), TypeError, r"Event\(step=...\)"),
        (lambda: Event(step=True), TypeError, "bool"),
        (lambda: Event(step=1, epoch="2"), TypeError, r"Event\(epoch=...\)"),
        (lambda: Event(step=1, metrics=[1.0]), TypeError, "metrics must be a mapping"),
        (lambda: Event(step=1, is_final=1), TypeError, "is_final must be a bool"),
    ],
)
def test_bad_arguments(make: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        make()


def test_event_accepts_index_types() -> None:
    class Step:
        def __index__(self) -> int:
            return 7

    e = Event(step=Step(), epoch=Step())  # type: ignore[arg-type]
    assert type(e.step) is int and e.step == 7 and e.epoch == 7


def test_foreign_state_is_rejected() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        every_steps(3).should_save({"fired": []}, Event(1))
    with pytest.raises(ValueError, match="does not fit"):
        (every_steps(3) | at_steps([1])).should_save([None], Event(1))
    with pytest.raises(ValueError, match="does not fit"):
        on_final().should_save({"best": 1.0}, Event(1))


def test_operators_reject_non_policies() -> None:
    with pytest.raises(TypeError):
        every_steps(1) | 3  # type: ignore[operator]
    with pytest.raises(TypeError):
        every_steps(1) & None  # type: ignore[operator]


# --------------------------------------------------------------------------- hypothesis

leaves = st.one_of(
    st.builds(every_steps, st.integers(1, 5), st.integers(0, 4)),
    st.builds(every_epochs, st.integers(1, 3)),
    st.lists(st.integers(0, 20), max_size=4).map(at_steps),
    st.builds(
        on_improve,
        st.sampled_from(["loss", "acc"]),
        st.sampled_from(["min", "max"]),
        st.sampled_from([0.0, 0.5]),
    ),
    st.builds(every_secs, st.floats(0.5, 5.0)),
    st.sampled_from([on_final(), always(), never()]),
)

policies = st.recursive(
    leaves,
    lambda children: st.one_of(
        st.tuples(children, children).map(lambda t: t[0] | t[1]),
        st.tuples(children, children).map(lambda t: t[0] & t[1]),
        children.map(lambda p: ~p),
    ),
    max_leaves=6,
)

metric_values = st.one_of(st.floats(-3, 3), st.just(math.nan), st.just(math.inf))


@st.composite
def event_streams(draw: st.DrawFn) -> list[Event]:
    """Mostly increasing steps, epochs and running time, with repeats, gaps, missing metrics."""
    n = draw(st.integers(0, 25))
    step, epoch, now = 0, 0, 0.0
    out: list[Event] = []
    for i in range(n):
        step += draw(st.integers(0, 3))
        epoch += draw(st.integers(0, 1))
        now += draw(st.floats(0.0, 3.0))
        metrics = draw(
            st.dictionaries(st.sampled_from(["loss", "acc"]), metric_values, max_size=2) | st.none()
        )
        event = Event(
            step=step,
            epoch=draw(st.sampled_from([epoch, epoch, None])),
            metrics=metrics,
            is_final=i == n - 1 and draw(st.booleans()),
            time=now,
            epoch_end=draw(st.sampled_from([False, False, True])),
        )
        out.append(event)
    return out


def trace(policy: SavePolicy, stream: list[Event]) -> tuple[list[bool], list[PolicyState]]:
    """Decisions and the state after each event; checks that no input state is mutated."""
    state = policy.init()
    decisions, states = [], []
    for event in stream:
        before = copy.deepcopy(state)
        decision, new_state = policy.should_save(state, event)
        assert _same(state, before), "should_save mutated its input state"
        assert type(decision) is bool
        decisions.append(decision)
        states.append(new_state)
        state = new_state
    return decisions, states


def run(policy: SavePolicy, stream: list[Event]) -> list[bool]:
    return trace(policy, stream)[0]


def leaf_states(policy: SavePolicy, state: PolicyState) -> list[tuple[str, str]]:
    """(leaf spec, leaf state) of every leaf, sorted: the same multiset whatever the tree."""
    out: list[tuple[str, str]] = []

    def walk(p: SavePolicy, s: PolicyState) -> None:
        kind = p.spec if isinstance(p.spec, str) else next(iter(p.spec))
        if kind in ("any", "all"):
            assert isinstance(s, list)
            for child, child_state in zip(p.children, s, strict=True):  # type: ignore[attr-defined]
                walk(child, child_state)
        elif kind == "not":
            walk(p.child, s)  # type: ignore[attr-defined]
        else:
            out.append((json.dumps(p.spec, sort_keys=True), json.dumps(s, sort_keys=True)))

    walk(policy, state)
    return sorted(out)


def same_run(a: SavePolicy, b: SavePolicy, stream: list[Event]) -> None:
    """Equal decisions, and every leaf in the same state after every event."""
    da, sa = trace(a, stream)
    db, sb = trace(b, stream)
    assert da == db
    for x, y in zip(sa, sb, strict=True):
        assert leaf_states(a, x) == leaf_states(b, y)


def _same(a: object, b: object) -> bool:
    """Equality that treats NaN as equal to itself (json-like comparison)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


ALGEBRA = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@ALGEBRA
@given(policies, event_streams())
def test_double_negation(p: SavePolicy, stream: list[Event]) -> None:
    same_run(~~p, p, stream)
    # ~p votes the opposite of p from the same state, then p's leaves see the outcome.
    state = (~p).init()
    for event in stream:
        assert (~p).decide(state, event) is (not p.decide(state, event))
        _, state = (~p).should_save(state, event)


@ALGEBRA
@given(policies, policies, event_streams())
def test_commutativity(p: SavePolicy, q: SavePolicy, stream: list[Event]) -> None:
    same_run(p | q, q | p, stream)
    same_run(p & q, q & p, stream)


@ALGEBRA
@given(policies, policies, event_streams())
def test_de_morgan(p: SavePolicy, q: SavePolicy, stream: list[Event]) -> None:
    same_run(~(p | q), ~p & ~q, stream)
    same_run(~(p & q), ~p | ~q, stream)


@ALGEBRA
@given(policies, policies, policies, event_streams())
def test_associativity(p: SavePolicy, q: SavePolicy, r: SavePolicy, stream: list[Event]) -> None:
    same_run((p | q) | r, p | (q | r), stream)
    same_run((p & q) & r, p & (q & r), stream)


@ALGEBRA
@given(policies, policies, event_streams())
def test_a_combination_decides_from_its_children_votes(
    p: SavePolicy, q: SavePolicy, stream: list[Event]
) -> None:
    """Each event: the combined vote is the boolean of the children's votes from the same
    states, and then every child advances on that combined outcome."""
    for combined, op in ((p | q, any), (p & q, all)):
        children = combined.children  # type: ignore[attr-defined]
        state = combined.init()
        for event in stream:
            assert isinstance(state, list)
            votes = [c.decide(s, event) for c, s in zip(children, state, strict=True)]
            saved = combined.decide(state, event)
            assert saved == op(votes)
            expected = [c.update(s, event, saved) for c, s in zip(children, state, strict=True)]
            state = combined.update(state, event, saved)
            assert _same(state, expected)


@ALGEBRA
@given(policies, event_streams(), st.data())
def test_decisions_depend_only_on_state_and_event(
    p: SavePolicy, stream: list[Event], data: st.DataObject
) -> None:
    """Any (state, event) pair reached in a run gives the same decision when asked again,
    asked of a copy of the state, or asked of the policy rebuilt from its spec."""
    rebuilt = policy_from_config(p.spec)
    assert rebuilt.spec == p.spec and repr(rebuilt) == repr(p)
    state = p.init()
    for event in stream:
        decision = p.decide(state, event)
        assert p.decide(copy.deepcopy(state), event) == decision
        assert rebuilt.decide(codec.decode(codec.encode(state)), event) == decision
        saved = data.draw(st.booleans())  # whatever happened, the state stays consistent
        state = p.update(state, event, saved)
        assert rebuilt.update(copy.deepcopy(state), event, saved) == p.update(
            state, event, saved
        ) or _same(rebuilt.update(state, event, saved), p.update(state, event, saved))


def _assert_plain(value: object, path: str = "state") -> None:
    if value is None or type(value) in (bool, int, float, str):
        return
    if type(value) is list:
        for i, item in enumerate(value):
            _assert_plain(item, f"{path}[{i}]")
        return
    if type(value) is dict:
        for key, item in value.items():
            assert type(key) is str, f"{path} has non-str key {key!r}"
            _assert_plain(item, f"{path}[{key!r}]")
        return
    raise AssertionError(f"{path} is {type(value).__name__}, not plain data: {value!r}")


@ALGEBRA
@given(policies, event_streams(), st.data())
def test_state_is_plain_data_and_round_trips(
    p: SavePolicy, stream: list[Event], data: st.DataObject
) -> None:
    expected, states = trace(p, stream)
    for s in [p.init(), *states]:
        _assert_plain(s)
        assert roundtrip(s) == s
        assert json.loads(json.dumps(s)) == s
        assert codec.decode(codec.encode(s)) == s
    _assert_plain(p.spec)
    assert codec.decode(codec.encode(p.spec)) == p.spec
    # Stopping at any event and resuming in a new process (the policy rebuilt from its
    # stored spec, the state through the manifest codec) gives the same decisions as
    # the uninterrupted run.
    cut = data.draw(st.integers(0, len(stream)))
    state = states[cut - 1] if cut else p.init()
    resumed = policy_from_config(codec.decode(codec.encode(p.spec)))
    assert run_policy(resumed, stream[cut:], codec.decode(codec.encode(state))) == expected[cut:]


def test_specs_rebuild_every_policy_and_reject_foreign_ones() -> None:
    p = (every_steps(5, offset=1) | every_secs(60)) & ~at_steps([3, 1]) | on_improve(
        "acc", mode="max", min_delta=0.5
    )
    assert p.spec == {
        "any": [
            {
                "all": [
                    {
                        "any": [
                            {"every_steps": {"n": 5, "offset": 1}},
                            {"every_secs": {"secs": 60.0}},
                        ]
                    },
                    {"not": {"at_steps": {"steps": [1, 3]}}},
                ]
            },
            {"on_improve": {"metric": "acc", "mode": "max", "min_delta": 0.5}},
        ]
    }
    assert repr(policy_from_config(p.spec)) == repr(p)
    for spec in ({"every_steps": {"n": 5, "offset": 0}}, {"every_epochs": {"n": 2}}):
        assert policy_from_config(spec).spec == spec
    for name in ("on_final", "always", "never"):
        assert policy_from_config(name).spec == name
    for bad in (
        None,
        "every_steps(5)",
        {"os.system": {"cmd": "true"}},
        {"kind": "os.system", "cmd": "true"},
        {"every_steps": {"n": 5, "offset": 0, "x": 1}},
        {"kind": "every_steps", "n": 5},
        {"every_steps": {"n": 0, "offset": 0}},
        {"any": []},
        {"not": {"nope": {}}},
        {"custom": {"type": "Mine", "repr": "Mine()"}},
    ):
        with pytest.raises(ConfigError):
            policy_from_config(bad)


def test_specs_of_older_manifests_still_read() -> None:
    """Manifests written before a spec was the configuration form hold
    ``{"kind": name, **arguments}``: read as the same policy, its state handed back."""
    p = (every_steps(5, offset=1) | every_secs(60)) & ~at_steps([3, 1]) | on_improve(
        "acc", mode="max", min_delta=0.5
    )
    older = {
        "kind": "any",
        "children": [
            {
                "kind": "all",
                "children": [
                    {
                        "kind": "any",
                        "children": [
                            {"kind": "every_steps", "n": 5, "offset": 1},
                            {"kind": "every_secs", "s": 60.0},
                        ],
                    },
                    {"kind": "not", "child": {"kind": "at_steps", "steps": [1, 3]}},
                ],
            },
            {"kind": "on_improve", "metric": "acc", "mode": "max", "min_delta": 0.5},
        ],
    }
    assert stored_spec(older) == p.spec
    for spec in (
        {"kind": "every_steps", "n": 5, "offset": 0},
        {"kind": "every_epochs", "n": 2},
        {"kind": "on_final"},
        {"kind": "always"},
        {"kind": "never"},
    ):
        assert stored_spec(policy_from_config(stored_spec(spec)).spec) == stored_spec(spec)
    sig = on_signal(signal.SIGUSR1)
    try:
        assert stored_spec({"kind": "on_signal", "signum": int(signal.SIGUSR1)}) == sig.spec
    finally:
        sig.uninstall()
    custom = {"kind": "custom", "type": "Mine", "repr": "Mine()"}
    assert stored_spec(custom) == {"custom": {"type": "Mine", "repr": "Mine()"}}
    for same in (None, "always", {"every_steps": {"n": 5, "offset": 0}}, [1]):
        assert stored_spec(same) == same


@settings(max_examples=100, deadline=None)
@given(st.lists(st.one_of(st.floats(-5, 5), st.just(math.nan)), max_size=20), st.data())
def test_on_improve_matches_reference(values: list[float], data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(["min", "max"]))
    delta = data.draw(st.sampled_from([0.0, 0.25]))
    events = [Event(i, metrics={"m": v}) for i, v in enumerate(values)]
    best: float | None = None
    expected = []
    for v in values:
        better = not math.isnan(v) and (
            best is None or (v < best - delta if mode == "min" else v > best + delta)
        )
        expected.append(better)
        if better:
            best = v
    assert run_policy(on_improve("m", mode=mode, min_delta=delta), events) == expected


# --------------------------------------------------------------------------- docs


def test_docs_examples_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block of docs/policies.md runs, in order, in one namespace.

    In a temporary working directory: the examples write checkpoints.
    """
    monkeypatch.chdir(tmp_path)
    text = (REPO / "docs" / "policies.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert blocks, "docs/policies.md has no python examples"
    namespace: dict[str, Any] = {"__name__": "docs_policies"}
    original = signal.getsignal(signal.SIGTERM)
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/policies.md[block {i}]", "exec"), namespace)
    finally:
        signal.signal(signal.SIGTERM, original)
