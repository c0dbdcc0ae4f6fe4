"""What a managed checkpoint records about itself in its metadata, and reading it back.

A policy's stored state is handed back on a restart only to the policy of the same spec.
"""

from __future__ import annotations

import contextlib
import platform
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.arguments import mapping
from functional_ckpt._src.format.header import MANAGER_KEY, record_of
from functional_ckpt._src.log import warn
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import Event, PolicyState, SavePolicy
from functional_ckpt._src.policy.config import stored_spec
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.root.run import Cut, Run, numbers
from functional_ckpt._src.storage.committed import check_committed
from functional_ckpt.errors import CheckpointError, CheckpointWarning

#: Metadata keys describing the process that wrote a checkpoint (replaced on fork).
AUTO_KEYS = frozenset(
    {
        "hostname",
        "torch",
        "functional_ckpt",
        "pid",
        "time",
        "python",
        "git_commit",
        "cwd",
        "rollbacks",
        "run",
    }
)
_GIT_TIMEOUT_S = 2.0


def git_commit(cwd: PathLike | None = None) -> str | None:
    """HEAD of the git checkout at ``cwd``, or None: "unknown", never a failed save."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    sha = proc.stdout.strip()
    return sha if proc.returncode == 0 and re.fullmatch(r"[0-9a-f]{40,64}", sha) else None


def check_metadata(metadata: Mapping[str, Any] | None) -> dict[str, Any]:
    """The user's metadata as a plain dict: msgpack-encodable, the reserved key left free."""
    meta = mapping(metadata, "metadata", "CheckpointManager", "a mapping")
    where = "CheckpointManager(metadata=...)"
    if MANAGER_KEY in meta:
        raise ValueError(f"{where}: key {MANAGER_KEY!r} is reserved for the manager's own record")
    codec.check_encodable(meta, where=where)
    return meta


@dataclass
class Provenance:
    """Where a run comes from, as each of its checkpoints records it (see :class:`Lineage`)."""

    cwd: str
    git: str | None = None
    lineage: dict[str, Any] | None = None
    rollbacks: list[Any] = field(default_factory=list)
    run: str | None = None
    cuts: int = 0  # how many cuts the run's trunk has had (see :meth:`Lineage.cut`)
    #: What ``metadata["run"]`` records beside the id: the parent, and the ancestors if any.
    line: dict[str, Any] = field(default_factory=lambda: {"parent": None})

    def metadata(self, record: Mapping[str, Any], user: Mapping[str, Any]) -> dict[str, Any]:
        """Automatic keys, then the user's metadata, then the manager's record."""
        auto: dict[str, Any] = {
            "time": time.time(),
            "python": platform.python_version(),
            "cwd": self.cwd,
        }
        if self.git is not None:
            auto["git_commit"] = self.git
        if self.lineage is not None:
            auto["forked_from"] = self.lineage  # every checkpoint of a fork says so
        if self.rollbacks:
            auto["rollbacks"] = list(self.rollbacks)  # and of a run that rolled back
        if self.run is not None:
            auto["run"] = {"id": self.run, **self.line} | ({"cuts": self.cuts} if self.cuts else {})
        return {**auto, **user, MANAGER_KEY: dict(record)}

    def resume(self, metadata: Mapping[str, Any]) -> None:
        """Continue the lineage and rollbacks recorded in a restored checkpoint."""
        lineage = metadata.get("forked_from")
        self.lineage = lineage if isinstance(lineage, dict) else None
        rollbacks = metadata.get("rollbacks")
        self.rollbacks = list(rollbacks) if isinstance(rollbacks, list) else []

    def continued_from(self, step: int | None, metadata: Mapping[str, Any], path: Path) -> None:
        """The parent of this run's next checkpoints: the one just restored from ``path``."""
        checksum = None
        with contextlib.suppress(CheckpointError, OSError):
            checksum = check_committed(path).get("manifest_crc32")
        run, prior = run_of(metadata), ancestors_of(metadata)
        line: dict[str, Any] = {"parent": {"run": run, "step": step, "manifest_crc32": checksum}}
        ancestors = prior if run in (None, self.run, *prior) else [*prior, str(run)]
        if ancestors:  # and where this lineage left each: the step, its checkpoint's save time
            until = {**until_of(metadata, "until", int), str(run): step}
            times = {**until_of(metadata, "until_time", float), str(run): metadata.get("time")}
            until = {r: s for r, s in until.items() if r in ancestors and s is not None}
            times = {r: t for r, t in times.items() if r in until and type(t) is float}
            line.update(ancestors=ancestors, until=until, until_time=times)
        self.line = line


def _recorded(metadata: Mapping[str, Any], key: str) -> Any:
    run = metadata.get("run")
    return run.get(key) if isinstance(run, dict) else None


def run_of(metadata: Mapping[str, Any]) -> str | None:
    """The run id a checkpoint's metadata records (None for one saved outside a manager)."""
    rid = _recorded(metadata, "id")
    return rid if isinstance(rid, str) else None


def ancestors_of(metadata: Mapping[str, Any]) -> list[str]:
    """The runs a checkpoint's run continued from, oldest first (none if unrecorded)."""
    found = _recorded(metadata, "ancestors")
    return [a for a in found if isinstance(a, str)] if isinstance(found, list) else []


def until_of(metadata: Mapping[str, Any], key: str, kind: type) -> dict[str, Any]:
    """Where a checkpoint's lineage left each ancestor: its step or save time, by ``key``."""
    return numbers(_recorded(metadata, key), kind)


def manager_record(
    event: Event,
    save: SavePolicy,
    save_state: PolicyState,
    keep: RetentionPolicy,
    export: SavePolicy | None = None,
    export_state: PolicyState = None,
) -> dict[str, Any]:
    """The manager's record of a checkpoint saved on ``event``."""
    record: dict[str, Any] = {
        "step": event.step,
        "epoch": event.epoch,
        "metrics": dict(event.metrics or {}),
        "is_final": event.is_final,
        "running_time": event.time,
        "save": {"spec": save.spec, "state": save_state},
        "keep": keep.spec,
    }
    if export is not None:
        record["export"] = {"spec": export.spec, "state": export_state}
    return record


class RunningTime:
    """Seconds a run has been running: carried over by restores, downtime excluded
    (only this reads the clock, never a policy: every event carries its value)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._offset = 0.0
        self._base = float(clock())

    def __call__(self) -> float:
        return self._offset + max(0.0, float(self.clock()) - self._base)

    def resume(self, seconds: float) -> None:
        """Continue from a restored checkpoint's running time (an insane one reads as 0.0)."""
        self._offset = seconds
        self._base = float(self.clock())


def stored_state(
    policy: SavePolicy, record: Mapping[str, Any], key: str, path: Path
) -> PolicyState:
    """The state stored for ``policy``; another policy's is never reinterpreted."""
    stored = record.get(key)
    if stored is None and not any(k in record for k in ("policy_state", "export_policy_state")):
        return policy.init()  # written by fc.save or a fork: a new run's policies
    spec = policy.spec
    if isinstance(stored, dict) and stored_spec(stored.get("spec")) == spec and "state" in stored:
        state: PolicyState = stored["state"]
        return state
    old = stored.get("spec") if isinstance(stored, dict) else None
    warn(
        f"{path}: the stored {key} policy state belongs to "
        f"{'an unrecorded policy' if old is None else repr(old)}, not to {policy!r} "
        f"(spec {spec!r}); that policy starts fresh",
        CheckpointWarning,
        stacklevel=5,
    )
    return policy.init()


class Lineage:
    """The lineage rule (docs/tiered.md): a checkpoint is this run's to resume, keep and
    delete when it records no run, this run on its trunk (no recorded cut left it behind),
    or one of its ``"ancestors"`` on the path it came from (at or below ``"until"``, saved
    no later than ``"until_time"``). Until the
    run has a checkpoint (``run.json`` records its runs from then on) it adopts the one
    lineage the root holds (or else the remote tier's); between unrelated ones it never
    guesses. Another's is reported once. ``alone``: this run's only (a memory tier's
    folder is private to its run: any other checkpoint there was planted)."""

    def __init__(self, run: Run | None, *, alone: bool = False) -> None:
        self.run, self.alone = None if run is None else run.id, alone
        self.recorded = set(() if run is None else run.lineage)  # grows, never shrinks
        self.until = {} if run is None else dict(run.until)  # as does each branch step
        self.until_time = {} if run is None else dict(run.until_time)
        self.cuts = () if run is None else run.cuts  # where this run's own trunk was cut
        self.runs: set[str] | None = set()  # None: every run's (none held records one)
        self.unrelated: list[str] = []  # the runs held, none of them this lineage's
        self._told: set[str] = set()

    def learn(self, held: Iterable[Mapping[str, Any]]) -> Lineage:
        """The lineage's runs, from the metadata of the checkpoints the root holds."""
        held = list(held)
        mine = self.recorded | ({self.run} if self.run is not None else set())
        if self.recorded or any(run_of(m) == self.run for m in held if self.run is not None):
            line = [m for m in held if run_of(m) in mine]
            self.runs = self.recorded = mine | {a for m in line for a in ancestors_of(m)}
            self.unrelated = []
            until, until_time = dict(self.until), dict(self.until_time)
        else:
            lines: dict[str, set[str]] = {}
            for m in held:
                if (run := run_of(m)) is not None:
                    lines.setdefault(run, {run}).update(ancestors_of(m))
            whole = [r for r in sorted(lines) if lines.keys() <= lines[r]]
            self.runs = None if not lines else lines[whole[0]] if whole else set()
            self.unrelated = [] if whole else sorted(lines)
            until, until_time = {}, {}
            line = [m for m in held if whole and run_of(m) == whole[0]]
        for m in line:
            until.update(until_of(m, "until", int))
            until_time.update(until_of(m, "until_time", float))
        self.until, self.until_time = until, until_time  # whole: the uploader reads them
        return self

    def left(self) -> dict[str, Any]:
        """What ``run.json`` records of the lineage (:class:`Run`'s fields)."""
        until, times = dict(self.until), dict(self.until_time)
        return {"lineage": tuple(sorted(self.recorded)), "until": until, "until_time": times}

    def begin(self, metadata: Mapping[str, Any]) -> None:
        """This run has a checkpoint (in RAM, say) recording ``metadata``: it adopts no other
        run's from now on, and the runs that checkpoint continues stay its lineage."""
        if self.run is not None:
            self.recorded |= {self.run, *ancestors_of(metadata)}
            self.until = {**until_of(metadata, "until", int), **self.until}
            self.until_time = {**until_of(metadata, "until_time", float), **self.until_time}
            self.runs = self.recorded if self.runs is None else self.runs  # until learnt again

    def holds(self, metadata: Mapping[str, Any]) -> bool:
        """Whether a checkpoint recording ``metadata`` is of this lineage."""
        run = run_of(metadata)
        if run == self.run or self.alone:
            return run == self.run and not self.cut(metadata)
        if self.runs is None or run is None:
            return True
        step, saved = record_of(metadata).step or 0, metadata.get("time")
        early = type(saved) is not float or saved <= self.until_time.get(run, saved)
        return run in self.runs and step <= self.until.get(run, step) and early

    def cut(self, metadata: Mapping[str, Any]) -> list[Cut]:
        """The cuts that left a checkpoint of this run off its trunk: over its step (a rollback,
        a delete, a resume of an older step saved on from, wherever made) and later than it,
        by the cuts it counted when saved (none recorded: before any), never by a clock."""
        step, saved = record_of(metadata).step or 0, _recorded(metadata, "cuts")
        later = self.cuts[max(saved, 0) if type(saved) is int else 0 :]
        mine = run_of(metadata) == self.run  # (another run's cuts are its own)
        return [(a, b) for a, b in later if mine and a < step <= (step if b is None else b)]

    def stranger(self, metadata: Mapping[str, Any], where: object) -> str:
        """What a checkpoint at ``where`` of another lineage (or off the trunk) is."""
        run = run_of(metadata)
        if run == self.run:
            return f"{where}: a checkpoint of this run ({run}) off this run's trunk"
        return f"{where}: a checkpoint of run {run}, not of this run's lineage ({self.run})"

    def unsure(self, where: object) -> str:
        """Why nothing at ``where`` is resumed or deleted: unrelated runs, none this one."""
        return (
            f"{where}: holds checkpoints of unrelated runs {', '.join(self.unrelated)} and none "
            "of this root's run, so which one it continues is not guessed: nothing is resumed "
            "or deleted. Move the other runs' checkpoints out of the root, or restore(step) "
            "the one to continue and save"
        )

    def __call__(self, metadata: Mapping[str, Any], where: object) -> bool:
        """:meth:`holds`, another lineage's checkpoint at ``where`` reported once."""
        if self.holds(metadata):
            return True
        if str(where) not in self._told and not self.unrelated:  # else told as a whole
            self._told.add(str(where))
            warn(
                f"{self.stranger(metadata, where)}; never resumed nor deleted here "
                "(fork it to continue it)",
                CheckpointWarning,
                stacklevel=4,
            )
        return False
