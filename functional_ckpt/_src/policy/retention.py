"""Retention policies: pure decisions about *which* checkpoints to keep, combined by
``|`` (union); :func:`plan_deletions` adds the rules no policy overrides, and the
manager deletes."""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from functional_ckpt._src.arguments import items
from functional_ckpt._src.policy.base import (
    PolicySpec,
    call_text,
    custom_spec,
    metric_and_mode,
    positive_int,
)


class CheckpointLike(Protocol):
    """What retention needs to know about a checkpoint (the manager's records fit it)."""

    @property
    def step(self) -> int: ...

    @property
    def time(self) -> float:
        """Seconds since the Unix epoch at which the checkpoint was committed."""

    @property
    def metrics(self) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class CheckpointRecord:
    """A minimal :class:`CheckpointLike`, for tests, docs and dry runs."""

    step: int
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)


class RetentionPolicy(ABC):
    """Chooses the steps to keep among existing checkpoints; pure and stateless."""

    def select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        """Return the steps of ``checkpoints`` to keep (a subset of their steps)."""
        steps = [c.step for c in checkpoints]
        if len(set(steps)) != len(steps):
            twice = next(s for s in steps if steps.count(s) > 1)
            raise ValueError(
                f"checkpoints: step {twice} appears more than once; each checkpoint "
                "must have a distinct step"
            )
        return self._select(checkpoints)

    @abstractmethod
    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        """``select`` without the input checks, so unions check only once."""

    @property
    def spec(self) -> PolicySpec:
        """Its configuration form (a union: a list), which :func:`.retention_from_config`
        rebuilds (one defined outside: its type and repr)."""
        return custom_spec(self)

    def __or__(self, other: object) -> RetentionPolicy:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        return _Union([c for p in (self, other) for c in union_parts(p)])


class _Union(RetentionPolicy):
    def __init__(self, children: Iterable[RetentionPolicy]) -> None:
        self.children: tuple[RetentionPolicy, ...] = tuple(children)

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        keep: set[int] = set()
        for child in self.children:
            keep |= child._select(checkpoints)
        return keep

    @property
    def spec(self) -> PolicySpec:
        return [c.spec for c in self.children]

    def __repr__(self) -> str:
        return " | ".join(repr(c) for c in self.children)


class _Keep(RetentionPolicy):
    """A leaf policy, its kind and arguments being its spec."""

    def __init__(
        self, kind: str, shown: int = 1, clock: Callable[[], float] = time.time, **args: Any
    ) -> None:
        self._kind, self._args, self._shown, self._clock = kind, args, shown, clock

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        kind, a = self._kind, self._args
        steps = [c.step for c in checkpoints]
        if kind == "keep_last":
            return set(sorted(steps, reverse=True)[: a["n"]])
        if kind == "keep_best":
            return set(best_steps(checkpoints, a["metric"], a["mode"])[: a["k"]])
        if kind == "keep_every":
            return {s for s in steps if s % a["steps"] == 0}
        if kind == "keep_within":
            cutoff = float(self._clock()) - a["secs"]  # read once per select
            return {c.step for c in checkpoints if c.time >= cutoff}
        return set(steps)  # keep_all

    @property
    def spec(self) -> PolicySpec:
        return {self._kind: dict(self._args)} if self._args else self._kind

    def __repr__(self) -> str:
        return call_text(self._kind, self._args, self._shown, [("mode", "min")])


def keep_all() -> RetentionPolicy:
    """Keep every checkpoint (disables garbage collection)."""
    return _Keep("keep_all")


def keep_last(n: int) -> RetentionPolicy:
    """Keep the ``n`` checkpoints with the highest steps (newest by step, not by time)."""
    n = positive_int(n, "n", f"keep_last(n={n!r})")
    return _Keep("keep_last", n=n)


def best_steps(checkpoints: Iterable[CheckpointLike], metric: str, mode: str = "min") -> list[int]:
    """Steps ranked best first by ``metrics[metric]``: the one definition of "best"
    (NaN or none is not ranked; ties go to the newer step, which a resume would pick)."""
    sign = 1.0 if metric_and_mode(metric, mode, "best_steps")[1] == "min" else -1.0
    candidates: list[tuple[float, int]] = []
    for c in checkpoints:
        if metric in c.metrics:
            value = float(c.metrics[metric])
            if not math.isnan(value):
                candidates.append((sign * value, -c.step))
    candidates.sort()
    return [-neg_step for _, neg_step in candidates]


def keep_best(k: int, metric: str, mode: str = "min") -> RetentionPolicy:
    """Keep the ``k`` checkpoints with the best ``metrics[metric]`` (lowest for
    ``mode="min"``) as :func:`best_steps` ranks them; fewer where values are missing."""
    k = positive_int(k, "k", f"keep_best(k={k!r})")
    metric, mode = metric_and_mode(metric, mode, "keep_best")
    return _Keep("keep_best", 2, k=k, metric=metric, mode=mode)


def keep_every(steps: int) -> RetentionPolicy:
    """Keep checkpoints whose step is a multiple of ``steps`` (sparse long-term history)."""
    n = positive_int(steps, "steps", f"keep_every(steps={steps!r})")
    return _Keep("keep_every", 0, steps=n)


def keep_within(secs: float, clock: Callable[[], float] = time.time) -> RetentionPolicy:
    """Keep checkpoints committed at most ``secs`` seconds ago by ``clock``, which has
    the origin of the checkpoints' ``time`` (Unix time by default)."""
    what = f"keep_within(secs={secs!r})"
    if isinstance(secs, bool) or not isinstance(secs, int | float):
        raise TypeError(f"{what}: secs must be a number of seconds")
    if math.isnan(secs) or secs < 0:
        raise ValueError(f"{what}: secs must be >= 0")
    if not callable(clock):
        raise TypeError(f"keep_within(clock={clock!r}): clock must be callable")
    return _Keep("keep_within", 1, clock, secs=float(secs))


def union_parts(policy: RetentionPolicy) -> tuple[RetentionPolicy, ...]:
    """The operands of ``a | b | ...`` (a policy that is no union is its only part)."""
    return policy.children if isinstance(policy, _Union) else (policy,)


def plan_deletions(
    policy: RetentionPolicy,
    checkpoints: Sequence[CheckpointLike],
    *,
    protected: Iterable[int] = (),
) -> list[int]:
    """The steps to delete, ascending: all that ``policy`` does not keep, except the
    newest (what a crash resumes from, whatever its metrics) and ``protected`` ones
    (still being written or read)."""
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"plan_deletions(policy={policy!r}): policy must be a RetentionPolicy")
    what = "plan_deletions"
    records = items(checkpoints, "checkpoints", what, "records", lambda c: hasattr(c, "step"))
    if not records:
        return []
    steps = items(protected, "protected", what, "steps", lambda s: isinstance(s, int))
    keep = policy.select(records) | set(steps)
    keep.add(max(c.step for c in records))
    return sorted(c.step for c in records if c.step not in keep)
