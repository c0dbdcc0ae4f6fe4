"""``Memory``: a manager's memory tier, as one option value (``CheckpointManager(memory=...)``).

Built and checked where the user writes it; the manager opens it on its root
(:class:`~.memory_tier.MemoryTier`). Plain fields, so that a configuration file can
describe it as well as code, but for ``domain`` (a function; its default needs none).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from functional_ckpt._src.policy import SavePolicy, every_steps
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.state.tree import State, leaves_of
from functional_ckpt._src.storage import ram
from functional_ckpt.errors import CheckpointError

__all__ = ["Memory", "OverBudget", "over_budget", "resolve_budget"]


def _every_step() -> SavePolicy:
    return every_steps(1)


@dataclass(frozen=True)
class Memory:
    """Checkpoint into RAM on a policy of its own (default: every step), above the disk tier.

    The tier is a folder in RAM (``path``; by default one per root under
    ``/dev/shm``) holding the newest ``keep`` (``keep_last(1)`` or ``keep_last(2)``;
    a bare 1 or 2 is short for them) checkpoints in the ordinary
    format, saved off the training thread, each on the previous one, without fsync:
    it survives a crash of the process, not a power loss or a reboot.
    ``restore_latest`` takes its newest step when no other tier has a newer one.
    ``budget`` caps the RAM it may use: bytes, or a fraction of the memory available
    when the manager opens. On a signal of ``promote_on`` (default SIGTERM) its
    newest checkpoint is copied to the disk tier, for at most ``promote_within``
    seconds, before the signal takes its course.

    Under ``torch.distributed`` each node has a folder of its own (the default one is
    per machine), and each rank's shard files are also held in the folders of
    ``replicas - 1`` other failure domains (default: 2 where there are at least two
    domains, else 1), so that a lost node's part is still in RAM elsewhere. A
    domain is a node (from ``LOCAL_RANK``), or what ``domain(rank)`` returns (an
    int or a str, the same on every rank). See docs/tiered.md.
    """

    path: str | os.PathLike[str] | None = None
    save: SavePolicy = field(default_factory=_every_step)
    keep: int | RetentionPolicy = 2
    budget: int | float = 0.5
    promote_on: tuple[int, ...] = (int(signal.SIGTERM),)
    promote_within: float = 60.0
    async_save: bool = True
    incremental: bool = True
    replicas: int | None = None
    domain: Callable[[int], int | str] | None = None

    @property
    def held(self) -> int:
        """How many checkpoints the tier holds (0 where ``keep`` says no count)."""
        keep = self.keep
        if isinstance(keep, RetentionPolicy):
            spec = keep.spec
            args = spec.get("keep_last") if isinstance(spec, dict) else None
            n = args.get("n") if isinstance(args, dict) else None
            return n if isinstance(n, int) and not isinstance(n, bool) else 0
        return keep if isinstance(keep, int) and not isinstance(keep, bool) else 0

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, str | os.PathLike):
            raise TypeError(f"Memory(path={self.path!r}): expected a directory path or None")
        if not isinstance(self.save, SavePolicy):
            raise TypeError(f"Memory(save={self.save!r}): not a SavePolicy")
        if self.held not in (1, 2):
            raise ValueError(
                f"Memory(keep={self.keep!r}): expected fc.keep_last(1) or fc.keep_last(2) "
                "(the newest checkpoints held; a bare 1 or 2 is short for them)"
            )
        budget = self.budget
        if isinstance(budget, bool) or not isinstance(budget, int | float):
            raise TypeError(
                f"Memory(budget={budget!r}): expected bytes (an int) or a fraction of the "
                "available memory (a float in (0, 1])"
            )
        if isinstance(budget, int) and budget <= 0:
            raise ValueError(f"Memory(budget={budget!r}): a byte budget must be > 0")
        if isinstance(budget, float) and not 0.0 < budget <= 1.0:
            raise ValueError(
                f"Memory(budget={budget!r}): a fraction of the available memory must be in (0, 1]"
            )
        if not isinstance(self.promote_on, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) for s in self.promote_on
        ):
            raise TypeError(
                f"Memory(promote_on={self.promote_on!r}): expected a tuple of signal numbers"
            )
        valid = set(signal.valid_signals())
        for s in self.promote_on:
            if s not in valid or s in (signal.SIGKILL, signal.SIGSTOP):
                raise ValueError(f"Memory(promote_on={self.promote_on!r}): {s} cannot be handled")
        within = self.promote_within
        if isinstance(within, bool) or not isinstance(within, int | float) or not within > 0:
            raise ValueError(f"Memory(promote_within={within!r}): expected a number of seconds > 0")
        replicas = self.replicas
        if replicas is not None and (
            isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1
        ):
            raise ValueError(
                f"Memory(replicas={replicas!r}): expected a number of copies >= 1 (or None: "
                "2 where there are two failure domains or more)"
            )
        if self.domain is not None and not callable(self.domain):
            raise TypeError(
                f"Memory(domain={self.domain!r}): expected a function of a rank, returning its "
                "failure domain (an int or a str)"
            )
        for name in ("async_save", "incremental"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"Memory({name}={getattr(self, name)!r}): expected a bool")


class OverBudget(CheckpointError):
    """A memory-tier save that would not fit the tier's budget (it is skipped)."""


def resolve_budget(option: Memory, folder: Path) -> int:
    """The tier's budget in bytes, against what ``folder`` can take now."""
    held = ram.held_bytes(folder)  # a crashed run's checkpoints: pruned at the next save
    room = ram.available_bytes(folder) + held
    budget = option.budget
    if isinstance(budget, float):
        return int(room * budget)
    if budget > room:
        raise CheckpointError(
            f"Memory(budget={budget}): {folder} can take at most {room} bytes now "
            "(free space there, capped by the memory available); lower the budget or "
            "give the tier a larger folder with Memory(path=...)"
        )
    return budget


def over_budget(option: Memory, budget: int, folder: Path, state: State) -> OverBudget | None:
    """Why this save does not fit ``budget`` (``keep`` checkpoints of this very state: a
    state grows, Adam's moments appear at its first step); None if it fits."""
    tensors = (leaf.value for leaf in leaves_of(state) if leaf.kind == "tensor")
    need = option.held * sum(t.numel() * t.element_size() for t in tensors)
    if need <= budget:
        return None
    return OverBudget(
        f"Memory(budget={option.budget!r}): {option.held} checkpoint(s) of "
        f"this state need {need} bytes in {folder}, more than the budget of "
        f"{budget} bytes; the memory tier skips every save that does not fit (said "
        "once). Raise budget=, lower keep= (1 holds one checkpoint), or leave it out"
    )
