"""Retention policies: pure decisions about *which* checkpoints to keep.

A retention policy looks at the checkpoints that exist and returns the set of steps
to keep; it never touches the disk. :func:`plan_deletions` turns that answer into a
list of steps to delete, adding the two safety rules no policy may override: the
newest checkpoint and any protected step (e.g. one being written) are never deleted.
Deleting is the manager's job, so that planning stays easy to test and to dry-run.

Policies combine with ``|`` (union: keep what any of them keeps), which is the only
combinator retention needs: "keep the last 3 and the best 2 and one per 10k steps".
Every policy has a plain-data :attr:`~RetentionPolicy.spec`, its configuration form,
which :func:`.retention_from_config` rebuilds it from, so a checkpoint can record the
policy its writer used without storing code or parsing text.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from functional_ckpt._src.policy.base import PolicySpec, custom_spec, positive_int

__all__ = [
    "CheckpointLike",
    "CheckpointRecord",
    "RetentionPolicy",
    "best_steps",
    "keep_all",
    "keep_best",
    "keep_every",
    "keep_last",
    "keep_within",
    "plan_deletions",
    "union_parts",
]


class CheckpointLike(Protocol):
    """What retention needs to know about a checkpoint (the manager's records fit it)."""

    @property
    def step(self) -> int: ...

    @property
    def time(self) -> float:
        """Seconds since the Unix epoch at which the checkpoint was committed."""
        ...

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
        _check_unique(checkpoints)
        return self._select(checkpoints)

    @abstractmethod
    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        """``select`` without the input checks, so unions check only once."""

    @property
    def spec(self) -> PolicySpec:
        """The policy in configuration form, every argument spelled (a union: a list);
        :func:`.retention_from_config` rebuilds it.

        A policy defined outside this module describes itself by type and repr; such a
        spec is recorded but cannot be rebuilt.
        """
        return custom_spec(self)

    def __or__(self, other: object) -> RetentionPolicy:
        if not isinstance(other, RetentionPolicy):
            return NotImplemented
        children: list[RetentionPolicy] = []
        for p in (self, other):
            children.extend(p.children if isinstance(p, _Union) else [p])
        return _Union(children)


def _check_unique(checkpoints: Sequence[CheckpointLike]) -> None:
    seen: set[int] = set()
    for c in checkpoints:
        if c.step in seen:
            raise ValueError(
                f"checkpoints: step {c.step} appears more than once; each checkpoint "
                "must have a distinct step"
            )
        seen.add(c.step)


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


class _KeepAll(RetentionPolicy):
    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        return {c.step for c in checkpoints}

    @property
    def spec(self) -> PolicySpec:
        return "keep_all"

    def __repr__(self) -> str:
        return "keep_all()"


def keep_all() -> RetentionPolicy:
    """Keep every checkpoint (disables garbage collection)."""
    return _KeepAll()


class _KeepLast(RetentionPolicy):
    def __init__(self, n: int) -> None:
        self.n = n

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        return set(sorted((c.step for c in checkpoints), reverse=True)[: self.n])

    @property
    def spec(self) -> PolicySpec:
        return {"keep_last": {"n": self.n}}

    def __repr__(self) -> str:
        return f"keep_last({self.n})"


def keep_last(n: int) -> RetentionPolicy:
    """Keep the ``n`` checkpoints with the highest steps (newest by step, not by time)."""
    return _KeepLast(positive_int(n, "n", f"keep_last(n={n!r})"))


class _KeepBest(RetentionPolicy):
    def __init__(self, k: int, metric: str, mode: str) -> None:
        self.k = k
        self.metric = metric
        self.mode = mode

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        return set(best_steps(checkpoints, self.metric, self.mode)[: self.k])

    @property
    def spec(self) -> PolicySpec:
        return {"keep_best": {"k": self.k, "metric": self.metric, "mode": self.mode}}

    def __repr__(self) -> str:
        extra = "" if self.mode == "min" else f", mode={self.mode!r}"
        return f"keep_best({self.k}, {self.metric!r}{extra})"


def _check_mode(mode: object, call: str) -> str:
    if mode not in ("min", "max"):
        raise ValueError(f"{call}(mode={mode!r}): mode must be 'min' or 'max'")
    return str(mode)


def best_steps(checkpoints: Iterable[CheckpointLike], metric: str, mode: str = "min") -> list[int]:
    """Steps ranked best first by ``metrics[metric]``: the one definition of "best".

    ``mode="min"`` ranks the lowest values first, ``"max"`` the highest. Checkpoints
    without the metric, or with NaN, are not ranked. Ties go to the newer (higher)
    step, the one a resume would rather start from. ``keep_best`` keeps a prefix of
    this list and the manager's ``best_step`` is its head.
    """
    sign = 1.0 if _check_mode(mode, "best_steps") == "min" else -1.0
    candidates: list[tuple[float, int]] = []
    for c in checkpoints:
        if metric in c.metrics:
            value = float(c.metrics[metric])
            if not math.isnan(value):
                candidates.append((sign * value, -c.step))
    candidates.sort()
    return [-neg_step for _, neg_step in candidates]


def keep_best(k: int, metric: str, mode: str = "min") -> RetentionPolicy:
    """Keep the ``k`` checkpoints with the best ``metrics[metric]``.

    ``mode="min"`` keeps the lowest values, ``"max"`` the highest. Checkpoints without
    the metric, or with NaN, are not candidates (so fewer than ``k`` may be kept).
    Ties are broken in favour of the newer (higher) step, which is the one a resume
    would rather start from.
    """
    k = positive_int(k, "k", f"keep_best(k={k!r})")
    if not isinstance(metric, str):
        raise TypeError(f"keep_best(metric={metric!r}): metric must be a str")
    return _KeepBest(k, metric, _check_mode(mode, "keep_best"))


class _KeepEvery(RetentionPolicy):
    def __init__(self, steps: int) -> None:
        self.steps = steps

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        return {c.step for c in checkpoints if c.step % self.steps == 0}

    @property
    def spec(self) -> PolicySpec:
        return {"keep_every": {"steps": self.steps}}

    def __repr__(self) -> str:
        return f"keep_every(steps={self.steps})"


def keep_every(steps: int) -> RetentionPolicy:
    """Keep checkpoints whose step is a multiple of ``steps`` (sparse long-term history)."""
    return _KeepEvery(positive_int(steps, "steps", f"keep_every(steps={steps!r})"))


class _KeepWithin(RetentionPolicy):
    def __init__(self, secs: float, clock: Callable[[], float]) -> None:
        self.secs = secs
        self.clock = clock

    def _select(self, checkpoints: Sequence[CheckpointLike]) -> set[int]:
        cutoff = float(self.clock()) - self.secs
        return {c.step for c in checkpoints if c.time >= cutoff}

    @property
    def spec(self) -> PolicySpec:
        # The clock is how "now" is read, not what the policy is.
        return {"keep_within": {"secs": self.secs}}

    def __repr__(self) -> str:
        return f"keep_within({self.secs!r})"


def keep_within(secs: float, clock: Callable[[], float] = time.time) -> RetentionPolicy:
    """Keep checkpoints committed at most ``secs`` seconds ago (``time >= now - secs``).

    ``clock`` must use the same origin as the checkpoints' ``time`` (Unix time by
    default); it is read once per :meth:`~RetentionPolicy.select`.
    """
    call = f"keep_within(secs={secs!r})"
    if isinstance(secs, bool) or not isinstance(secs, int | float):
        raise TypeError(f"{call}: secs must be a number of seconds")
    if math.isnan(secs) or secs < 0:
        raise ValueError(f"{call}: secs must be >= 0")
    if not callable(clock):
        raise TypeError(f"keep_within(clock={clock!r}): clock must be callable")
    return _KeepWithin(float(secs), clock)


def union_parts(policy: RetentionPolicy) -> tuple[RetentionPolicy, ...]:
    """The operands of ``a | b | ...`` (a policy that is no union is its only part)."""
    return policy.children if isinstance(policy, _Union) else (policy,)


def plan_deletions(
    policy: RetentionPolicy,
    checkpoints: Sequence[CheckpointLike],
    *,
    protected: Iterable[int] = (),
) -> list[int]:
    """Return the steps to delete, ascending: all that ``policy`` does not keep, except
    the newest checkpoint (highest step) and any step in ``protected``.

    The newest checkpoint is always kept because it is the one a crash would resume
    from, whatever a policy like ``keep_best`` thinks of its metrics; ``protected``
    covers checkpoints the caller is still writing or reading.
    """
    if not isinstance(policy, RetentionPolicy):
        raise TypeError(f"plan_deletions(policy={policy!r}): policy must be a RetentionPolicy")
    if not checkpoints:
        return []
    keep = policy.select(checkpoints) | set(protected)
    keep.add(max(c.step for c in checkpoints))
    return sorted(c.step for c in checkpoints if c.step not in keep)
