"""Retention policies: selection tables, unions, and the safety rules of plan_deletions."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from functional_ckpt._src.policy.config import retention_from_config, stored_spec
from functional_ckpt._src.policy.retention import (
    CheckpointLike,
    CheckpointRecord,
    RetentionPolicy,
    best_steps,
    keep_all,
    keep_best,
    keep_every,
    keep_last,
    keep_within,
    plan_deletions,
    union_parts,
)
from functional_ckpt.errors import ConfigError

NOW = 1_700_000_000.0


def clock() -> float:
    return NOW


def ckpts(*rows: tuple[int, float, dict[str, float]]) -> list[CheckpointRecord]:
    return [CheckpointRecord(step, time, metrics) for step, time, metrics in rows]


# Steps 100..600, one every 100 s, the newest committed at NOW.
HISTORY = ckpts(
    (100, NOW - 500, {"loss": 5.0, "acc": 0.1}),
    (200, NOW - 400, {"loss": 2.0, "acc": 0.5}),
    (300, NOW - 300, {"loss": 3.0}),
    (400, NOW - 200, {"loss": math.nan, "acc": 0.7}),
    (500, NOW - 100, {"loss": 2.0, "acc": 0.7}),
    (600, NOW, {}),
)


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (keep_all(), {100, 200, 300, 400, 500, 600}),
        (keep_last(1), {600}),
        (keep_last(2), {500, 600}),
        (keep_last(100), {100, 200, 300, 400, 500, 600}),
        # Ties (200 and 500 both 2.0) go to the newer step; NaN and missing never count.
        (keep_best(1, "loss"), {500}),
        (keep_best(2, "loss"), {200, 500}),
        (keep_best(3, "loss"), {200, 300, 500}),
        (keep_best(10, "loss"), {100, 200, 300, 500}),
        (keep_best(1, "acc", mode="max"), {500}),
        (keep_best(2, "acc", mode="max"), {400, 500}),
        (keep_best(1, "acc"), {100}),
        (keep_best(3, "missing"), set()),
        (keep_every(steps=200), {200, 400, 600}),
        (keep_every(steps=300), {300, 600}),
        (keep_every(steps=7), set()),
        (keep_within(0, clock=clock), {600}),
        (keep_within(200, clock=clock), {400, 500, 600}),  # time >= now - secs: inclusive
        (keep_within(199.5, clock=clock), {500, 600}),
        (keep_within(math.inf, clock=clock), {100, 200, 300, 400, 500, 600}),
        (keep_last(1) | keep_best(1, "loss"), {500, 600}),
        (keep_last(1) | keep_best(1, "acc") | keep_every(steps=300), {100, 300, 600}),
        (keep_within(100, clock=clock) | keep_last(3), {400, 500, 600}),
    ],
    ids=repr,
)
def test_select_table(policy: RetentionPolicy, kept: set[int]) -> None:
    assert policy.select(HISTORY) == kept
    assert policy.select(list(reversed(HISTORY))) == kept  # order of input is irrelevant


def test_select_empty() -> None:
    for policy in (keep_all(), keep_last(3), keep_best(1, "loss"), keep_every(steps=2)):
        assert policy.select([]) == set()


def test_keep_within_reads_clock_at_select_time() -> None:
    now = [NOW - 1000]
    policy = keep_within(60, clock=lambda: now[0])
    assert policy.select(HISTORY) == {100, 200, 300, 400, 500, 600}
    now[0] = NOW
    assert policy.select(HISTORY) == {600}


def test_keep_within_default_clock_is_unix_time() -> None:
    import time

    records = [CheckpointRecord(1, time.time() - 7200), CheckpointRecord(2, time.time())]
    assert keep_within(3600).select(records) == {2}


def test_union_flattens_and_reprs() -> None:
    p = keep_last(3) | keep_best(2, "loss") | keep_every(steps=1000)
    assert repr(p) == "keep_last(3) | keep_best(2, 'loss') | keep_every(steps=1000)"
    assert len(p.children) == 3  # type: ignore[attr-defined]
    q = (keep_last(1) | keep_all()) | (keep_within(60.0) | keep_best(1, "acc", mode="max"))
    assert len(q.children) == 4  # type: ignore[attr-defined]
    assert (
        repr(q) == "keep_last(1) | keep_all() | keep_within(60.0) | keep_best(1, 'acc', mode='max')"
    )
    with pytest.raises(TypeError):
        keep_last(1) | 3  # type: ignore[operator]


def test_any_checkpoint_like_object_works() -> None:
    @dataclass
    class Manifest:
        step: int
        time: float
        metrics: Mapping[str, float]
        path: str

    found: list[CheckpointLike] = [
        Manifest(10, NOW - 10, {"loss": 1.0}, "/ckpt/10"),
        Manifest(20, NOW, {"loss": 2.0}, "/ckpt/20"),
    ]
    assert keep_best(1, "loss").select(found) == {10}
    assert plan_deletions(keep_last(1), found) == [10]


def test_checkpoint_record_defaults_and_hash() -> None:
    r = CheckpointRecord(5, 1.0)
    assert r.metrics == {}
    assert hash(r) == hash(CheckpointRecord(5, 1.0, {"loss": 1.0}))  # metrics not hashed


def test_plan_deletions_table() -> None:
    assert plan_deletions(keep_last(2), HISTORY) == [100, 200, 300, 400]
    assert plan_deletions(keep_last(2), HISTORY, protected=[200, 999]) == [100, 300, 400]
    assert plan_deletions(keep_all(), HISTORY) == []
    # keep_best never picks 600 (no metrics), yet the newest is never deleted.
    assert plan_deletions(keep_best(1, "loss"), HISTORY) == [100, 200, 300, 400]
    assert plan_deletions(keep_every(steps=1000), HISTORY) == [100, 200, 300, 400, 500]
    assert plan_deletions(keep_every(steps=1000), HISTORY, protected={100}) == [200, 300, 400, 500]
    policy = keep_last(1) | keep_best(1, "loss") | keep_every(steps=300)
    assert plan_deletions(policy, list(reversed(HISTORY))) == [100, 200, 400]
    assert plan_deletions(keep_last(1), []) == []
    assert plan_deletions(keep_last(1), HISTORY[:1]) == []


def test_plan_deletions_rejects_duplicates_and_non_policies() -> None:
    dup = [CheckpointRecord(1, 0.0), CheckpointRecord(1, 1.0)]
    with pytest.raises(ValueError, match="step 1 appears more than once"):
        plan_deletions(keep_last(1), dup)
    with pytest.raises(ValueError, match="more than once"):
        keep_all().select(dup)
    with pytest.raises(TypeError, match="policy must be a RetentionPolicy"):
        plan_deletions(lambda c: set(), HISTORY)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plan_deletions\(checkpoints=3\)"):
        plan_deletions(keep_last(1), 3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"plan_deletions\(protected=5\)"):
        plan_deletions(keep_last(1), HISTORY, protected=5)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("make", "exc", "message"),
    [
        (lambda: keep_last(0), ValueError, r"keep_last\(n=0\): n must be a positive int"),
        (lambda: keep_last(1.0), ValueError, "n must be a positive int"),
        (lambda: keep_best(0, "loss"), ValueError, r"keep_best\(k=0\): k must be a positive"),
        (lambda: keep_best(1, 3), TypeError, "metric must be a str"),
        (lambda: keep_best(1, "loss", mode="lowest"), ValueError, "mode must be 'min' or 'max'"),
        (lambda: keep_every(steps=0), ValueError, r"keep_every\(steps=0\)"),
        (lambda: keep_within(-1), ValueError, "secs must be >= 0"),
        (lambda: keep_within(math.nan), ValueError, "secs must be >= 0"),
        (lambda: keep_within("1"), TypeError, "secs must be a number"),
        (lambda: keep_within(1, clock=None), TypeError, "clock must be callable"),
    ],
)
def test_bad_arguments(make: Any, exc: type[Exception], message: str) -> None:
    with pytest.raises(exc, match=message):
        make()


# --------------------------------------------------------------------------- hypothesis

metric_values = st.one_of(st.floats(-10, 10), st.just(math.nan))


@st.composite
def checkpoint_lists(draw: st.DrawFn) -> list[CheckpointRecord]:
    steps = draw(st.lists(st.integers(0, 200), unique=True, max_size=15))
    return [
        CheckpointRecord(
            step=s,
            time=draw(st.floats(NOW - 1000, NOW)),
            metrics=draw(st.dictionaries(st.sampled_from(["loss", "acc"]), metric_values)),
        )
        for s in steps
    ]


leaf_policies = st.one_of(
    st.just(keep_all()),
    st.builds(keep_last, st.integers(1, 5)),
    st.builds(
        keep_best,
        st.integers(1, 4),
        st.sampled_from(["loss", "acc"]),
        st.sampled_from(["min", "max"]),
    ),
    st.builds(keep_every, steps=st.integers(1, 50)),
    st.builds(keep_within, st.floats(0, 1200), clock=st.just(clock)),
)
retention_policies = st.lists(leaf_policies, min_size=1, max_size=4).map(
    lambda ps: ps[0] if len(ps) == 1 else _union(ps)
)


def _union(ps: list[RetentionPolicy]) -> RetentionPolicy:
    out = ps[0]
    for p in ps[1:]:
        out = out | p
    return out


@settings(max_examples=300, deadline=None)
@given(retention_policies, checkpoint_lists(), st.data())
def test_plan_deletions_properties(
    policy: RetentionPolicy, checkpoints: list[CheckpointRecord], data: st.DataObject
) -> None:
    all_steps = {c.step for c in checkpoints}
    protected = data.draw(st.sets(st.integers(0, 250), max_size=5))
    kept = policy.select(checkpoints)
    deleted = plan_deletions(policy, checkpoints, protected=protected)

    assert kept <= all_steps
    assert deleted == sorted(set(deleted))
    assert set(deleted) <= all_steps
    assert not set(deleted) & protected
    assert not set(deleted) & kept
    if checkpoints:
        assert max(all_steps) not in deleted
        assert set(deleted) == all_steps - kept - protected - {max(all_steps)}
    else:
        assert deleted == []


@settings(max_examples=200, deadline=None)
@given(st.lists(leaf_policies, min_size=2, max_size=4), checkpoint_lists())
def test_union_is_union_of_selections(
    ps: list[RetentionPolicy], checkpoints: list[CheckpointRecord]
) -> None:
    expected = set().union(*(p.select(checkpoints) for p in ps))
    assert _union(ps).select(checkpoints) == expected
    assert _union(list(reversed(ps))).select(checkpoints) == expected


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["min", "max"]), checkpoint_lists())
def test_keep_best_matches_reference(
    k: int, mode: str, checkpoints: list[CheckpointRecord]
) -> None:
    candidates = [
        c for c in checkpoints if "loss" in c.metrics and not math.isnan(c.metrics["loss"])
    ]
    sign = 1 if mode == "min" else -1
    ranked = sorted(candidates, key=lambda c: (sign * c.metrics["loss"], -c.step))
    kept = keep_best(k, "loss", mode=mode).select(checkpoints)
    assert kept == {c.step for c in ranked[:k]}
    assert len(kept) == min(k, len(candidates))
    # Every kept checkpoint is at least as good as every dropped candidate.
    dropped = [c for c in candidates if c.step not in kept]
    for c in candidates:
        if c.step in kept:
            assert all(sign * c.metrics["loss"] <= sign * d.metrics["loss"] for d in dropped)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 20), checkpoint_lists())
def test_keep_last_keeps_highest_steps(n: int, checkpoints: list[CheckpointRecord]) -> None:
    kept = keep_last(n).select(checkpoints)
    assert len(kept) == min(n, len(checkpoints))
    dropped = {c.step for c in checkpoints} - kept
    assert all(k > d for k in kept for d in dropped)


@settings(max_examples=200, deadline=None)
@given(retention_policies, checkpoint_lists())
def test_spec_rebuilds_the_same_policy(
    policy: RetentionPolicy, checkpoints: list[CheckpointRecord]
) -> None:
    from functional_ckpt._src import codec

    spec = codec.decode(codec.encode(policy.spec))  # as stored in a manifest
    assert spec == policy.spec
    rebuilt = retention_from_config(spec)
    assert repr(rebuilt) == repr(policy) and rebuilt.spec == policy.spec
    if not any("keep_within" in repr(p) for p in union_parts(policy)):
        assert rebuilt.select(checkpoints) == policy.select(checkpoints)
    assert [repr(p) for p in union_parts(policy)] == repr(policy).split(" | ")


def test_retention_spec_table_and_rejects() -> None:
    p = keep_last(3) | keep_best(2, "loss", mode="max") | keep_every(steps=10) | keep_within(5)
    assert p.spec == [
        {"keep_last": {"n": 3}},
        {"keep_best": {"k": 2, "metric": "loss", "mode": "max"}},
        {"keep_every": {"steps": 10}},
        {"keep_within": {"secs": 5.0}},
    ]
    assert keep_all().spec == "keep_all"
    older = {  # as manifests written before a spec was the configuration form hold it
        "kind": "union",
        "children": [
            {"kind": "keep_last", "n": 3},
            {"kind": "keep_best", "k": 2, "metric": "loss", "mode": "max"},
            {"kind": "keep_every", "steps": 10},
            {"kind": "keep_within", "secs": 5.0},
        ],
    }
    assert stored_spec(older) == p.spec and stored_spec({"kind": "keep_all"}) == "keep_all"
    for bad in (
        None,
        "keep_last(3)",
        {"keep_last": None},
        {"keep_last": {"n": 0}},
        {"keep_last": {"n": 3, "extra": 1}},
        {"keep_within": {"secs": 1.0, "clock": "time.time"}},
        {"__import__": {"name": "os"}},
        [],
        ["keep_all", {"nope": {}}],
        {"custom": {"type": "Mine", "repr": "Mine()"}},
        {"kind": "keep_last", "n": 3},
    ):
        with pytest.raises(ConfigError):
            retention_from_config(bad)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.sampled_from(["min", "max"]), checkpoint_lists())
def test_keep_best_is_a_prefix_of_best_steps(
    k: int, mode: str, checkpoints: list[CheckpointRecord]
) -> None:
    ranked = best_steps(checkpoints, "acc", mode)
    assert keep_best(k, "acc", mode=mode).select(checkpoints) == set(ranked[:k])
    with pytest.raises(ValueError, match="mode must be 'min' or 'max'"):
        best_steps(checkpoints, "acc", "avg")
