"""``Memory``: a manager's memory tier, as one option value (``CheckpointManager(memory=...)``).

Plain fields checked where the user writes them, so that a configuration file can
describe the tier as well as code (all but ``domain``, a function).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src.policy import SavePolicy, every_steps
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.state.tree import State, leaves_of
from functional_ckpt._src.storage import ram, usage
from functional_ckpt.errors import CheckpointError

__all__ = ["Memory", "OverBudget", "over_budget", "resolve_budget"]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return _int(v) or isinstance(v, float)


#: What each field must be, as its error says.
_EXPECTED = {
    "path": "a directory path or None",
    "save": "a SavePolicy",
    "keep": "fc.keep_last(1) or fc.keep_last(2) (a bare 1 or 2 is short for them)",
    "budget": "bytes (an int > 0) or a fraction of the available memory (a float in (0, 1])",
    "promote_on": "a tuple of signal numbers that can be handled",
    "promote_within": "a number of seconds > 0",
    "replicas": "a number of copies >= 1 (or None: 2 where there are two failure domains)",
    "domain": "a function of a rank, returning its failure domain (an int or a str)",
    "async_save": "a bool",
    "incremental": "a bool",
}


@dataclass(frozen=True)
class Memory:
    """Checkpoint into RAM on a policy of its own (default: every step), above the disk tier.

    A folder in RAM (``path``; by default one per run under ``/dev/shm``) holds the
    newest ``keep`` (``keep_last(1)`` or ``keep_last(2)``; a bare 1 or 2 is short for
    them) checkpoints in the ordinary format, without fsync: it survives a crash of the
    process, not a reboot. ``budget`` caps its RAM: bytes, or a fraction of the memory
    available. On a signal of ``promote_on`` its newest checkpoint is copied to the disk
    tier within ``promote_within`` seconds. Under ``torch.distributed`` each rank's
    files are also held by ``replicas - 1`` other failure domains (``domain(rank)``,
    by default its node). See docs/tiered.md.
    """

    path: str | os.PathLike[str] | None = None
    save: SavePolicy = field(default_factory=lambda: every_steps(1))
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
        n: Any = self.keep
        if isinstance(n, RetentionPolicy):
            spec = n.spec
            n = spec.get("keep_last", {}).get("n") if isinstance(spec, dict) else None
        return n if _int(n) else 0

    def __post_init__(self) -> None:
        b, w, r, sig = self.budget, self.promote_within, self.replicas, self.promote_on
        handled = set(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}
        sigs = isinstance(sig, tuple) and all(map(_int, sig))
        ok = {  # field: (of a right type, of a right value)
            "path": (self.path is None or isinstance(self.path, str | os.PathLike), True),
            "save": (isinstance(self.save, SavePolicy), True),
            "keep": (True, self.held in (1, 2)),
            "budget": (_num(b), _num(b) and (0 < b <= 1 if isinstance(b, float) else b > 0)),
            "promote_on": (sigs, sigs and set(sig) <= handled),
            "promote_within": (True, _num(w) and w > 0),
            "replicas": (r is None or _int(r), r is None or (_int(r) and r >= 1)),
            "domain": (self.domain is None or callable(self.domain), True),
            "async_save": (isinstance(self.async_save, bool), True),
            "incremental": (isinstance(self.incremental, bool), True),
        }
        for name, (right_type, right_value) in ok.items():
            if not (right_type and right_value):
                raise (ValueError if right_type else TypeError)(
                    f"Memory({name}={getattr(self, name)!r}): expected {_EXPECTED[name]}"
                )


class OverBudget(CheckpointError):
    """A memory-tier save that would not fit the tier's budget (it is skipped)."""


def resolve_budget(option: Memory, folder: Path) -> int:
    """The tier's budget in bytes, against what ``folder`` can take now (a crashed run's
    checkpoints count as room: they are pruned at the next save)."""
    held = usage.disk_bytes([Path(d) for d, _, _ in os.walk(folder)])  # each inode once
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
    """Why ``keep`` checkpoints of this very state exceed ``budget`` (checked at every save:
    a state grows, Adam's moments appear at its first step); None if they fit."""
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
