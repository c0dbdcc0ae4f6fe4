"""What a managed checkpoint records about itself in its metadata, and reading it back.

Each checkpoint a :class:`~functional_ckpt.manager.CheckpointManager` writes carries
automatic keys (when, where and from which git commit it was written, the run's
lineage and rollbacks), the user's metadata, and under the reserved key
``"manager"`` the manager's record: step, epoch, metrics, running time and each
policy's spec with its state. A restarted run reads its policies' states and its
running time back from that record; a state is handed back only to the policy of
the same spec.
"""

from __future__ import annotations

import math
import platform
import re
import subprocess
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from functional_ckpt import codec
from functional_ckpt._types import PathLike
from functional_ckpt.errors import CheckpointWarning
from functional_ckpt.policy import Event, PolicyState, SavePolicy
from functional_ckpt.retention import RetentionPolicy
from functional_ckpt.root import MANAGER_KEY

__all__ = [
    "AUTO_KEYS",
    "checkpoint_metadata",
    "check_metadata",
    "git_commit",
    "manager_record",
    "running_time_of",
    "stored_state",
]

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
    }
)
_GIT_TIMEOUT_S = 2.0


def git_commit(cwd: PathLike | None = None) -> str | None:
    """HEAD of the git checkout at ``cwd`` (default: the working directory), or None.

    Best effort by design: no git, no repository, a hung filesystem (short timeout)
    all mean "unknown", never a failed save.
    """
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


def check_metadata(metadata: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The user's metadata as a plain dict: msgpack-encodable, the reserved key left free."""
    meta = dict(metadata or {})
    if MANAGER_KEY in meta:
        raise ValueError(
            f"{where}: metadata key {MANAGER_KEY!r} is reserved for the manager's own record"
        )
    codec.check_encodable(meta, where="CheckpointManager(metadata=...)")
    return meta


def checkpoint_metadata(
    record: Mapping[str, Any],
    user: Mapping[str, Any],
    *,
    cwd: str,
    git: str | None = None,
    lineage: Mapping[str, Any] | None = None,
    rollbacks: Sequence[Any] = (),
) -> dict[str, Any]:
    """Automatic keys, then the user's metadata, then the manager's record."""
    auto: dict[str, Any] = {
        "time": time.time(),
        "python": platform.python_version(),
        "cwd": cwd,
    }
    if git is not None:
        auto["git_commit"] = git
    if lineage is not None:
        auto["forked_from"] = lineage  # every checkpoint of a fork says so
    if rollbacks:
        auto["rollbacks"] = list(rollbacks)  # and of a run that rolled back
    return {**auto, **user, MANAGER_KEY: dict(record)}


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
        # A stored state belongs to the policy of this spec and no other.
        "save": {"spec": save.spec, "state": save_state},
        "keep": keep.spec,
    }
    if export is not None:
        record["export"] = {"spec": export.spec, "state": export_state}
    return record


def running_time_of(record: Mapping[str, Any]) -> float:
    """The running time a record carries; 0.0 when it is missing or not a sane duration."""
    running = record.get("running_time")
    plain = isinstance(running, float | int) and not isinstance(running, bool)
    seconds = float(running) if plain else 0.0  # type: ignore[arg-type]
    return seconds if math.isfinite(seconds) and seconds >= 0 else 0.0


def stored_state(
    policy: SavePolicy, record: Mapping[str, Any], key: str, path: Path
) -> PolicyState:
    """The state stored for ``policy``, or ``policy.init()`` if it was another policy's.

    A state is handed back only to the policy whose spec it was stored with; any other
    policy starts fresh (with a warning) instead of reinterpreting it.
    """
    stored = record.get(key)
    if stored is None and not any(k in record for k in ("policy_state", "export_policy_state")):
        return policy.init()  # written by fc.save or a fork: a new run's policies
    spec = policy.spec
    if isinstance(stored, dict) and stored.get("spec") == spec and "state" in stored:
        state: PolicyState = stored["state"]
        return state
    old = stored.get("spec") if isinstance(stored, dict) else None
    warnings.warn(
        f"{path}: the stored {key} policy state belongs to "
        f"{'an unrecorded policy' if old is None else repr(old)}, not to {policy!r} "
        f"(spec {spec!r}); that policy starts fresh",
        CheckpointWarning,
        stacklevel=5,
    )
    return policy.init()
