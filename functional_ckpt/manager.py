"""CheckpointManager: policies, retention, resume and locking around ``save``/``restore``.

The manager holds no checkpointing logic of its own (DESIGN principle 1). It
threads a save policy's state through ``maybe_save`` events, writes through
:func:`functional_ckpt.save`, prunes with :func:`~functional_ckpt.retention.plan_deletions`,
and on resume reads the newest checkpoint that is actually readable. What it adds
is the bookkeeping a single function cannot do:

* checkpoints live in ``root/step_{step:09d}/`` (zero padded, so ``ls`` sorts them);
* each checkpoint's metadata carries, under the reserved key ``"manager"``, the
  step, epoch, metrics and the policy states, so a restarted run continues its
  policies (``every_secs`` counts only running time, ``on_improve`` keeps its best);
* one writer per root, enforced by an ``flock`` on ``root/.lock`` (released by the
  kernel when the holder dies, so a crashed writer's lock is simply taken over);
* a crash leaves only ``*.tmp-*`` / ``*.trash-*`` directories, which the next
  writer removes; readers never list them;
* a corrupt newest checkpoint is reported and skipped, never silently replaced by a
  fresh start.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import platform
import re
import socket
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from tensordict import TensorDict, TensorDictBase

from functional_ckpt import codec, format
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    TemplateMismatch,
)
from functional_ckpt.export import Export, export_safetensors
from functional_ckpt.io import CheckpointInfo, distributed_active, like_argument, restore, save
from functional_ckpt.policy import Event, PolicyState, SavePolicy, every_steps, never
from functional_ckpt.reader import Reshard
from functional_ckpt.retention import RetentionPolicy, keep_all, plan_deletions
from functional_ckpt.staging import PendingSave, Stager, Staging, save_async
from functional_ckpt.tree import Leaf, as_state, iter_leaves, unflatten
from functional_ckpt.writer import DEFAULT_PER_RANK, is_dtensor

__all__ = [
    "CheckpointManager",
    "CheckpointWarning",
    "MANAGER_KEY",
    "StepInfo",
    "fork",
    "step_name",
]

PathLike = str | os.PathLike[str]
State = TensorDictBase | Mapping[str, Any]

#: Reserved metadata key holding the manager's own record of each checkpoint.
MANAGER_KEY = "manager"
LOCK_FILE = ".lock"
EXPORTS_DIR = "exports"
#: Infix of a checkpoint moved aside because it could not be read (kept for forensics).
QUARANTINE_INFIX = ".corrupt-"
#: Metadata keys describing the process that wrote a checkpoint (replaced on fork).
AUTO_KEYS = frozenset(
    {"hostname", "torch", "functional_ckpt", "pid", "time", "python", "git_commit", "cwd"}
)
_STEP_RE = re.compile(r"step_(\d+)")
_GIT_TIMEOUT_S = 2.0


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped or a stored policy state was discarded."""


def step_name(step: int) -> str:
    """Directory name of ``step``: zero padded so that lexical order is step order."""
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a canonical checkpoint directory name, else None.

    Only the exact name :func:`step_name` produces counts, so ``step_5`` next to
    ``step_000000005`` cannot make one step appear twice, and temporary or
    quarantined siblings (``step_….tmp-…``) never match.
    """
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


@dataclass(frozen=True)
class StepInfo:
    """One managed checkpoint, as retention policies and users see it.

    ``time`` is when the save started (Unix seconds, the manifest's ``created``);
    ``size`` counts every file in the directory. ``metadata`` is everything the
    checkpoint recorded, automatic keys and the user's alike.
    """

    step: int
    path: Path
    time: float
    metrics: Mapping[str, float] = field(default_factory=dict, hash=False)
    epoch: int | None = None
    is_final: bool = False
    size: int = 0
    metadata: Mapping[str, Any] = field(default_factory=dict, hash=False)


# --------------------------------------------------------------------------- helpers


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


def _plain_metrics(metrics: Mapping[str, Any] | None, where: str) -> dict[str, float]:
    """Metrics as plain ``str -> float`` (tensors and numpy scalars are converted)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}: metrics must be a mapping of str to numbers")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: metric names must be str, got {k!r}")
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"{where}: metrics[{k!r}]={v!r} is not a number") from None
    return out


def _fits(state: Any, shape: Any, *, in_field: bool = False) -> bool:
    """Does a stored policy state have the shape of ``policy.init()``?

    Compared structurally (dict keys, list lengths, None-ness), not by value, so a
    state saved under a different policy is detected before the policy chokes on it.
    A None *field* of a dict (``last_fired_step``, ``best``) starts unset and may
    hold any scalar later; a None *policy state* (a stateless policy) must stay
    None. An empty list (``at_steps``' fired steps) accepts any list.
    """
    if isinstance(shape, dict):
        return (
            isinstance(state, dict)
            and set(state) == set(shape)
            and all(_fits(state[k], shape[k], in_field=True) for k in shape)
        )
    if isinstance(shape, list):
        if not isinstance(state, list):
            return False
        if not shape:
            return True
        return len(state) == len(shape) and all(
            _fits(a, b, in_field=in_field) for a, b in zip(state, shape, strict=True)
        )
    if shape is None and not in_field:
        return state is None
    return not isinstance(state, dict | list)


def _dir_size(path: Path) -> int:
    total = 0
    with os.scandir(path) as it:
        for entry in it:
            if entry.is_file(follow_symlinks=False):
                total += entry.stat(follow_symlinks=False).st_size
    return total


def _stamp(path: Path) -> tuple[int, int, int]:
    """Identity of a committed checkpoint (its marker), to cache manifest reads."""
    st = os.stat(path / format.COMMIT_MARKER)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


def _identity(path: Path) -> tuple[int, tuple[int, int, int] | None] | None:
    """(directory inode, marker stamp), or None if gone: did a writer swap it under us?"""
    try:
        ino = os.stat(path).st_ino
    except FileNotFoundError:
        return None
    try:
        return ino, _stamp(path)
    except FileNotFoundError:
        return ino, None


def _read_info(path: Path, step: int) -> StepInfo:
    manifest = format.read_manifest(path)
    meta = manifest.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    record = meta.get(MANAGER_KEY)
    record = record if isinstance(record, dict) else {}
    metrics = record.get("metrics")
    epoch = record.get("epoch")
    created = manifest.get("created")
    return StepInfo(
        step=step,
        path=path,
        time=float(created) if isinstance(created, int | float) else 0.0,
        metrics=dict(metrics) if isinstance(metrics, dict) else {},
        epoch=epoch if isinstance(epoch, int) else None,
        is_final=bool(record.get("is_final", False)),
        size=_dir_size(path),
        metadata=meta,
    )


# --------------------------------------------------------------------------- lock


#: A dead writer's lock can outlive it briefly: children it forked (data loader
#: workers, a subprocess before its exec) hold the descriptor until they exit.
LOCK_GRACE_S = 3.0


def _flock_with_grace(fd: int) -> None:
    deadline = time.monotonic() + LOCK_GRACE_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


class _RootLock:
    """An exclusive ``flock`` on ``root/.lock`` for the lifetime of a writing manager.

    ``flock`` rather than an O_EXCL lock file because the kernel drops it when the
    holder dies, however it dies: a SIGKILLed trainer leaves no lock to clean up.
    The file's content (pid, host, start time) is only for the error message; the
    file itself is never removed, since unlinking a locked file lets a second
    process lock a fresh inode of the same name.
    """

    def __init__(self, root: Path) -> None:
        self.path = root / LOCK_FILE
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise CheckpointError(
                f"{root}: cannot take the writer lock {self.path} ({e}); on a read-only "
                "location open the manager with read_only=True"
            ) from e
        try:
            _flock_with_grace(fd)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise CheckpointError(f"{root}: cannot lock {self.path}: {e}") from e
            raise CheckpointError(
                f"{root}: another writing CheckpointManager holds the lock "
                f"({self.holder_text()}); only one writer per root is allowed. Stop it, use "
                "another root, or open this one with read_only=True to follow it"
            ) from None
        self.fd: int | None = fd
        info = {
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "since": time.time(),
        }
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)

    def holder_text(self) -> str:
        try:
            info = json.loads(self.path.read_text())
            since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["since"])))
            return f"pid {info['pid']} on {info['hostname']} since {since}; see {self.path}"
        except (OSError, ValueError, KeyError, TypeError):
            return f"holder unknown; see {self.path}"

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the only descriptor drops the flock
            self.fd = None

    def __del__(self) -> None:  # a manager dropped without close() still unlocks
        with contextlib.suppress(Exception):
            self.release()


# --------------------------------------------------------------------------- manager


class CheckpointManager:
    """Save on a policy, keep on a retention policy, resume from the newest good checkpoint.

    ``save`` defaults to ``every_steps(1)`` (every ``maybe_save`` with a new step
    saves) and ``keep`` to ``keep_all()`` (nothing is deleted), so a manager without
    policies is a safe, plain "save each step I give you". ``metadata`` (experiment
    id, hyper-parameters; msgpack-encodable) is stored in every checkpoint next to
    the automatic keys. ``export`` adds weights-only safetensors exports on their
    own policy (see :class:`~functional_ckpt.export.Export`).

    A writing manager locks ``root`` and removes stale temporary directories at
    open; ``read_only=True`` does neither and never deletes or renames anything.
    Not thread-safe: use one manager from one thread.
    """

    def __init__(
        self,
        root: PathLike,
        save: SavePolicy | None = None,
        keep: RetentionPolicy | None = None,
        *,
        metadata: Mapping[str, Any] | None = None,
        read_only: bool = False,
        export: Export | None = None,
        async_save: bool = False,
        staging: Staging = "copy",
        per_rank: Sequence[str] = DEFAULT_PER_RANK,
    ) -> None:
        self.root = Path(root)
        self.per_rank = tuple(per_rank)
        self.async_save = bool(async_save)
        self.staging: Staging = staging
        self._pending: PendingSave | None = None
        self._removal: threading.Thread | None = None
        self._stager = Stager()
        self._distributed = distributed_active()
        self._coordinator = not self._distributed or _rank() == 0
        if self._distributed:
            from functional_ckpt.dist import checkpoint_group

            checkpoint_group()  # created now, on the training thread, in the same order
            checkpoint_group(purpose="control")  # on every rank
        self.read_only = bool(read_only)
        self.save_policy = every_steps(1) if save is None else save
        self.keep = keep_all() if keep is None else keep
        self.export = export
        self.metadata = self._check_metadata(metadata)
        self._check_types()
        self._policy_state: PolicyState = self.save_policy.init()
        self._export_state: PolicyState = export.policy.init() if export is not None else None
        self._bad: set[tuple[int, int]] = set()  # (step, dir inode) found unreadable
        self._cache: dict[int, tuple[tuple[int, int, int], StepInfo]] = {}
        self._restored_step: int | None = None
        self._lock: _RootLock | None = None
        self._closed = False
        self._git: str | None = None
        self._lineage: dict[str, Any] | None = None
        self._cwd = os.getcwd()
        if not self.read_only:
            if self._coordinator:
                self._open_writer()  # one lock per job: the coordinator's
            else:
                self._git = git_commit(self._cwd)

    def _check_metadata(self, metadata: Mapping[str, Any] | None) -> dict[str, Any]:
        meta = dict(metadata or {})
        if MANAGER_KEY in meta:
            raise ValueError(
                f"CheckpointManager({self.root}): metadata key {MANAGER_KEY!r} is reserved "
                "for the manager's own record"
            )
        codec.check_encodable(meta, where="CheckpointManager(metadata=...)")
        return meta

    def _check_types(self) -> None:
        if not isinstance(self.save_policy, SavePolicy):
            raise TypeError(f"CheckpointManager(save={self.save_policy!r}): not a SavePolicy")
        if not isinstance(self.keep, RetentionPolicy):
            raise TypeError(f"CheckpointManager(keep={self.keep!r}): not a RetentionPolicy")
        if self.export is not None and not isinstance(self.export, Export):
            raise TypeError(f"CheckpointManager(export={self.export!r}): not an fc.Export")

    def _open_writer(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"{self.root}: the checkpoint root is a file, not a directory")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CheckpointError(f"{self.root}: cannot create the checkpoint root: {e}") from e
        self._git = git_commit(self._cwd)  # before the lock: no child inherits it
        self._lock = _RootLock(self.root)
        try:
            self._remove_stale()
        except BaseException:
            self._lock.release()
            raise

    def _remove_stale(self) -> None:
        """Delete the ``*.tmp-*`` / ``*.trash-*`` siblings a crashed writer left behind.

        Safe only because we hold the lock: no other writer can be mid-save. Only
        names derived from ``step_N`` are touched; anything else in the root is the
        user's.
        """
        removed = False
        for parent in (self.root, self.root / EXPORTS_DIR):
            if not parent.is_dir():
                continue
            for entry in os.scandir(parent):
                base = entry.name.split(format.TMP_INFIX)[0].split(format.TRASH_INFIX)[0]
                if format.is_temporary_name(entry.name) and parse_step(base) is not None:
                    if entry.is_dir(follow_symlinks=False):
                        format.remove_tree(Path(entry.path))
                    else:
                        os.unlink(entry.path)
                    removed = True
        if removed:
            format.fsync_dir(self.root)

    # ------------------------------------------------------------------ context manager

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Wait for pending work and release the lock; idempotent."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._join_removals()
            self._closed = True
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    def wait(self) -> None:
        """Block until every save started so far is committed; raise if one failed.

        The retention policy runs once the save it follows has committed.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        info = pending.result()
        self._after_commit(info)

    def wait_staged(self) -> None:
        """Block until the state may be mutated again (call it before the optimizer step).

        With synchronous saves, or ``staging="copy"`` once the copy is done, this
        returns at once. With ``staging="none"`` it waits for the whole write.
        """
        if self._pending is None:
            return
        if self.staging == "none":
            self.wait()
        else:
            self._pending.wait_staged()

    def __repr__(self) -> str:
        mode = "read-only" if self.read_only else "writer"
        return (
            f"CheckpointManager({str(self.root)!r}, save={self.save_policy!r}, "
            f"keep={self.keep!r}, {mode})"
        )

    # ------------------------------------------------------------------ listing

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` lives (whether or not it exists)."""
        return self.root / step_name(step)

    def _step_dirs(self) -> Iterator[tuple[int, Path]]:
        """Every canonical ``step_N`` directory not known to be unreadable."""
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        except NotADirectoryError:
            raise CheckpointError(
                f"{self.root}: the checkpoint root is a file, not a directory"
            ) from None
        for entry in entries:
            step = parse_step(entry.name)
            if step is None or not entry.is_dir(follow_symlinks=False):
                continue
            if (step, entry.inode()) in self._bad:
                continue
            yield step, Path(entry.path)

    def steps(self) -> list[int]:
        """Steps of the committed checkpoints, ascending (half-written ones never appear)."""
        return sorted(s for s, p in self._step_dirs() if (p / format.COMMIT_MARKER).exists())

    def latest_step(self) -> int | None:
        """The newest committed step, excluding any this manager found unreadable."""
        return max(self.steps(), default=None)

    @property
    def restored_step(self) -> int | None:
        """The step the last ``restore``/``restore_latest`` returned, if any."""
        return self._restored_step

    def info(self, step: int) -> StepInfo:
        """Step, time, metrics, epoch, size and full metadata of one checkpoint."""
        path = self.path(step)
        try:
            stamp = _stamp(path)
        except FileNotFoundError:
            raise CheckpointNotFound(
                f"{path}: no committed checkpoint for step {step} in {self.root} "
                f"(steps: {self._steps_text()})"
            ) from None
        cached = self._cache.get(step)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        info = _read_info(path, step)
        self._cache[step] = (stamp, info)
        return info

    def _steps_text(self) -> str:
        steps = self.steps()
        if not steps:
            return "none"
        shown = ", ".join(map(str, steps[-10:]))
        return shown if len(steps) <= 10 else f"…, {shown}"

    def infos(self) -> list[StepInfo]:
        """:meth:`info` of every readable committed checkpoint, ascending by step."""
        out = []
        for step in self.steps():
            try:
                out.append(self.info(step))
            except (CheckpointError, OSError):
                continue  # unreadable or just pruned: not a candidate for anything
        return out

    def best_step(self, metric: str, mode: str = "min") -> int | None:
        """The step with the best recorded ``metric`` (ties go to the newer step)."""
        if mode not in ("min", "max"):
            raise ValueError(f"best_step(mode={mode!r}): mode must be 'min' or 'max'")
        sign = 1.0 if mode == "min" else -1.0
        scored = [
            (sign * float(i.metrics[metric]), -i.step)
            for i in self.infos()
            if metric in i.metrics and not math.isnan(float(i.metrics[metric]))
        ]
        return -min(scored)[1] if scored else None

    # ------------------------------------------------------------------ saving

    def _check_writable(self, what: str) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root}: {what}: the manager is closed")
        if self.read_only:
            raise CheckpointError(f"{self.root}: {what}: this manager is read-only")

    def maybe_save(
        self,
        state: State,
        *,
        step: int,
        epoch: int | None = None,
        metrics: Mapping[str, Any] | None = None,
        is_final: bool = False,
        force: bool = False,
    ) -> bool:
        """Feed one event to the policies; save (and prune) if the save policy says so.

        Returns whether a full checkpoint was written. ``force=True`` saves whatever
        the policy says (its state still advances). The export policy is evaluated
        on the same event and its export is written first, so a crash between the
        two can only repeat an export, never lose one. Policy states advance only
        once the writes they describe succeeded, so a failed save is retried at the
        next event.
        """
        self._check_writable("maybe_save")
        if self._pending is not None and self._pending.done():
            self.wait()  # a background failure surfaces here, at the next call
        event = Event(
            step=step, epoch=epoch, metrics=_plain_metrics(metrics, "maybe_save"), is_final=is_final
        )
        if event.step < 0:
            raise ValueError(f"maybe_save(step={step!r}): steps must be >= 0")
        fire, policy_state = self.save_policy.should_save(self._policy_state, event)
        export_fire, export_state = False, self._export_state
        if self.export is not None:
            export_fire, export_state = self.export.policy.should_save(self._export_state, event)
        if self._distributed:  # one decision for all ranks: the coordinator's
            fire, policy_state, export_fire, export_state, force = _coordinator_decides(
                (fire, policy_state, export_fire, export_state, force)
            )
        if fire or force:
            self.wait()  # at most one save in flight; the previous one must have committed
            self._check_order(event.step)  # before any write, the export included
        if export_fire:
            self._export_weights(state, event.step)
        if fire or force:
            self._save_checkpoint(state, event, policy_state, export_state)
        self._policy_state = policy_state
        self._export_state = export_state
        return fire or force

    def _check_order(self, step: int) -> None:
        """Refuse to save behind the newest checkpoint: a resume would never pick it."""
        latest = self.latest_step()
        if latest is not None and step < latest:
            raise CheckpointError(
                f"{self.root}: cannot save step {step}: step {latest} is newer, and a "
                "resume would pick it over this one. Call restore_latest() to resume, delete "
                "the newer steps with delete(step), or fork() into a new root"
            )

    def _save_checkpoint(
        self, state: State, event: Event, policy_state: PolicyState, export_state: PolicyState
    ) -> CheckpointInfo | None:
        record = {
            "step": event.step,
            "epoch": event.epoch,
            "metrics": dict(event.metrics or {}),
            "is_final": event.is_final,
            "policy_state": policy_state,
            "save": repr(self.save_policy),
            "keep": repr(self.keep),
            "export_policy_state": export_state,
        }
        info = self._write(self.path(event.step), state, self._metadata(record))
        if info is not None:
            self._after_commit(info)
        return info

    def _after_commit(self, info: CheckpointInfo) -> None:
        """Retention runs only after the checkpoint it protects is committed."""
        step = parse_step(info.path.name)
        if self._coordinator:
            self._prune(protected={step} if step is not None else set())

    def _metadata(self, record: Mapping[str, Any]) -> dict[str, Any]:
        """Automatic keys, then the user's metadata, then the manager's record."""
        auto: dict[str, Any] = {
            "time": time.time(),
            "python": platform.python_version(),
            "cwd": self._cwd,
        }
        if self._git is not None:
            auto["git_commit"] = self._git
        if self._lineage is not None:
            auto["forked_from"] = self._lineage  # every checkpoint of a fork says so
        return {**auto, **self.metadata, MANAGER_KEY: dict(record)}

    def _write(
        self, path: Path, state: State, metadata: Mapping[str, Any]
    ) -> CheckpointInfo | None:
        """The one place a checkpoint is written; None while an async save runs.

        An existing directory for the same step is replaced atomically: the newer
        save of a step supersedes the older one.
        """
        overwrite = path.exists()
        if self.async_save:
            self._pending = save_async(
                path,
                state,
                metadata=metadata,
                overwrite=overwrite,
                staging=self.staging,
                stager=self._stager,
                per_rank=self.per_rank,
            )
            return None
        return save(path, state, metadata=metadata, overwrite=overwrite, per_rank=self.per_rank)

    def _export_weights(self, state: State, step: int) -> Path | None:
        assert self.export is not None
        if self._distributed:
            # Every rank takes part in gathering the sharded weights; rank 0 writes them.
            state = gathered(state, self.export.select)
            if not self._coordinator:
                return None
        return export_safetensors(
            state,
            self.root / EXPORTS_DIR / step_name(step),
            select=self.export.select,
            dtype=self.export.dtype,
            max_shard_size=self.export.max_shard_size,
            overwrite=True,
        )

    # ------------------------------------------------------------------ deleting

    def _prune(self, protected: set[int]) -> list[int]:
        """Delete what the retention policy does not keep; never the newest or ``protected``."""
        if self._pending is not None:  # a save in flight is never a candidate
            step = parse_step(self._pending.path.name)
            protected = protected | ({step} if step is not None else set())
        doomed = plan_deletions(self.keep, self.infos(), protected=protected)
        self._delete(doomed)
        return doomed

    def delete(self, step: int) -> None:
        """Delete one checkpoint, crash-safely (even the newest: you asked for it)."""
        self._check_writable("delete")
        if not self.path(step).is_dir():
            raise CheckpointNotFound(f"{self.path(step)}: no checkpoint for step {step}")
        self._delete([step])

    def _delete(self, steps: list[int]) -> None:
        """Rename out of sight, fsync the root, then remove.

        After the rename no reader can see the checkpoint, so a crash during the
        slow removal leaves only a ``*.trash-*`` directory that the next writer
        deletes; a half-deleted directory never carries a checkpoint's name.
        """
        trash: list[Path] = []
        for step in steps:
            path = self.path(step)
            aside = format.tmp_sibling(path, format.TRASH_INFIX)
            try:
                os.rename(path, aside)
            except FileNotFoundError:
                continue
            trash.append(aside)
            self._cache.pop(step, None)
        if trash:
            format.fsync_dir(self.root)
        if self.async_save and trash:
            # Out of sight already; unlinking gigabytes need not stall the training loop.
            # close() waits for it; what a crash leaves, the next writer removes at open.
            self._join_removals()
            self._removal = threading.Thread(
                target=_remove_all, args=(trash,), name="fc-prune", daemon=True
            )
            self._removal.start()
        else:
            _remove_all(trash)

    def _join_removals(self) -> None:
        if self._removal is not None:
            self._removal.join()
            self._removal = None

    # ------------------------------------------------------------------ restoring

    def restore(
        self,
        step: int,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
        template: State | None = None,
    ) -> TensorDict:
        """Restore one step (no fallback) and continue the policies from it.

        ``like``, ``out`` and ``reshard`` are those of :func:`functional_ckpt.restore`
        (``template=`` is the deprecated spelling of ``like=``).
        """
        like = like_argument(like, out, template, "CheckpointManager.restore")
        if self._closed:
            raise CheckpointError(f"{self.root}: restore: the manager is closed")
        path = self.path(step)
        info = self.info(step)
        state = restore(path, like, out=out, reshard=reshard)
        self._adopt(info)
        return state

    def restore_latest(
        self,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
        template: State | None = None,
    ) -> TensorDict | None:
        """Restore the newest readable checkpoint; None only if the root holds none.

        Unreadable checkpoints (corrupt bytes, missing files, torn manifest) are
        reported with a :class:`CheckpointWarning` and skipped; a writing manager
        moves them aside to ``step_N.corrupt-…`` (never deletes them). A template
        that does not fit raises at once (that is a bug in the caller, not damage).
        If checkpoints exist but none is readable this raises rather than letting
        the run silently start over. The per-tensor CRCs that ``fc.restore``
        checks while reading are the validation; nothing is read twice.
        ``like``/``out`` are those of :func:`functional_ckpt.restore`: with ``like`` a
        new state is returned and ``like`` is never written.
        """
        like = like_argument(like, out, template, "CheckpointManager.restore_latest")
        if self._closed:
            raise CheckpointError(f"{self.root}: restore_latest: the manager is closed")
        failures: list[str] = []
        for _ in range(100):  # re-list only when a follower raced a prune
            result = self._try_candidates(like, out, failures, reshard)
            if result is not _VANISHED:
                break
        else:
            raise CheckpointError(f"{self.root}: checkpoints kept vanishing while restoring")
        if isinstance(result, TensorDict):
            return result
        if failures:
            raise CheckpointError(
                f"{self.root}: checkpoints exist but none is readable; refusing to start "
                "fresh:\n" + "\n".join(failures)
            )
        damaged = self._quarantined()
        if damaged:
            raise CheckpointError(
                f"{self.root}: the only checkpoints here were found damaged earlier and moved "
                f"aside ({', '.join(damaged[:5])}); refusing to start fresh. Move or delete "
                "them to start over"
            )
        return None

    def _quarantined(self) -> list[str]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if QUARANTINE_INFIX in n and n.startswith("step_"))

    def _try_candidates(
        self,
        like: State | None,
        out: State | None,
        failures: list[str],
        reshard: Reshard | None,
    ) -> object:
        candidates = sorted(self._step_dirs(), reverse=True)
        for step, path in candidates:
            before = _identity(path)
            try:
                info = _read_info(path, step)
                state = restore(path, like, out=out, reshard=reshard)
            except TemplateMismatch:
                raise
            except (CheckpointError, OSError) as err:
                if before is None or _identity(path) != before:
                    return _VANISHED  # pruned or replaced by the writer we follow: list again
                failures.append(f"  {path}: {err}")
                self._reject(step, path, err)
                continue
            self._adopt(info)
            return state
        return None

    def _reject(self, step: int, path: Path, err: BaseException) -> None:
        """Warn about an unreadable checkpoint and make sure it is not picked again."""
        moved = ""
        damaged = isinstance(err, CheckpointError) or (
            isinstance(err, OSError) and err.errno == errno.ENOENT
        )
        if not self.read_only and self._coordinator and damaged:
            aside = format.tmp_sibling(path, QUARANTINE_INFIX)
            with contextlib.suppress(OSError):
                os.rename(path, aside)
                format.fsync_dir(self.root)
                moved = f"; moved aside to {aside.name} (not deleted)"
        if not moved:
            with contextlib.suppress(OSError):
                self._bad.add((step, os.stat(path).st_ino))
        warnings.warn(
            f"{path}: checkpoint of step {step} is unreadable ({type(err).__name__}: {err})"
            f"{moved}; falling back to the previous checkpoint",
            CheckpointWarning,
            stacklevel=4,
        )

    def _adopt(self, info: StepInfo) -> None:
        """Continue the policies from the states stored with the restored checkpoint."""
        self._restored_step = info.step
        if self.read_only:
            return  # a follower never saves: its policies are irrelevant
        lineage = info.metadata.get("forked_from")
        self._lineage = lineage if isinstance(lineage, dict) else None
        record = info.metadata.get(MANAGER_KEY)
        record = record if isinstance(record, dict) else {}
        self._policy_state = self._reseed(
            self.save_policy, record.get("policy_state"), info, "save"
        )
        if self.export is not None:
            self._export_state = self._reseed(
                self.export.policy, record.get("export_policy_state"), info, "export"
            )

    def _reseed(self, policy: SavePolicy, stored: Any, info: StepInfo, what: str) -> PolicyState:
        fresh = policy.init()
        if stored is None and fresh is not None:
            return fresh  # saved without a manager, or forked: a new run's policies
        if _fits(stored, fresh):
            state: PolicyState = stored
            return state
        warnings.warn(
            f"{info.path}: the stored {what} policy state does not fit {policy!r} (was the "
            "policy changed?); that policy starts afresh",
            CheckpointWarning,
            stacklevel=4,
        )
        return fresh


_VANISHED = object()


def gathered(state: State, select: str | Sequence[str]) -> TensorDict:
    """The ``select`` subtree with every DTensor gathered into a full tensor.

    ``full_tensor()`` is a collective on the tensor's mesh: every rank calls this,
    in the same order, on the training thread.
    """
    prefix = (select,) if isinstance(select, str) else tuple(select)
    leaves = []
    for leaf in iter_leaves(as_state(state)):
        if leaf.path[: len(prefix)] != prefix and leaf.path != prefix[: len(leaf.path)]:
            continue
        value = leaf.value
        if leaf.kind == "tensor" and is_dtensor(value):
            value = value.full_tensor()
        leaves.append(Leaf(leaf.path, leaf.kind, value))
    return unflatten(leaves)


def _remove_all(paths: list[Path]) -> None:
    for path in paths:
        format.remove_tree(path)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _coordinator_decides(decision: tuple[Any, ...]) -> tuple[Any, ...]:
    """Every rank adopts rank 0's decision and policy states.

    Clocks and metrics may differ between ranks (``every_secs``, ``on_improve``);
    half the ranks saving would deadlock the collective save, so only the
    coordinator's view counts, and its policy states are stored everywhere.
    """
    from functional_ckpt.dist import all_gather_bytes, checkpoint_group

    group = checkpoint_group(purpose="control")
    payload = codec.encode(list(decision))
    chosen = codec.decode(all_gather_bytes(payload, group)[0])
    assert isinstance(chosen, list)
    return tuple(chosen)


# --------------------------------------------------------------------------- fork


def _source_step(path: Path, meta: Mapping[str, Any]) -> int | None:
    record = meta.get(MANAGER_KEY)
    if isinstance(record, dict) and isinstance(record.get("step"), int):
        step: int = record["step"]
        return step
    m = _STEP_RE.fullmatch(path.name)
    return int(m.group(1)) if m else None


def fork(checkpoint_path: PathLike, new_root: PathLike, *, step: int | None = None) -> Path:
    """Start a new run in ``new_root`` from a checkpoint of another run.

    The checkpoint is restored and saved again (a full copy: the original manifest
    is sealed by its commit marker, so it cannot be amended in place) as
    ``new_root/step_N`` with ``N`` the source's step unless ``step`` is given. The
    copy keeps the user metadata, step, epoch and metrics of the source, gets fresh
    automatic metadata, starts its policies afresh (it is a new run), and records
    ``"forked_from": {"path", "step", "time", "hostname", "git_commit"}`` (nested
    ``"parent"`` for forks of forks). ``new_root`` must hold no checkpoint yet.
    """
    src = Path(checkpoint_path)
    meta = format.read_manifest(src).get("metadata")
    meta = dict(meta) if isinstance(meta, dict) else {}
    src_step = _source_step(src, meta)
    target = src_step if step is None else step
    if target is None:
        raise CheckpointError(f"{src}: cannot tell the checkpoint's step; pass fork(..., step=N)")
    state = restore(src)
    provenance: dict[str, Any] = {
        "path": str(src.resolve()),
        "step": src_step,
        "time": time.time(),
        "hostname": meta.get("hostname"),
        "git_commit": meta.get("git_commit"),
    }
    if "forked_from" in meta:
        provenance["parent"] = meta["forked_from"]
    with CheckpointManager(new_root, save=never(), keep=keep_all()) as mgr:
        existing = mgr.steps()
        if existing:
            raise CheckpointExists(
                f"{mgr.root}: already holds checkpoints (steps {existing[:5]}…); fork into "
                "an empty root"
            )
        record = dict(meta.get(MANAGER_KEY) or {})
        record.update(step=target, policy_state=None, export_policy_state=None)
        user = {k: v for k, v in meta.items() if k not in AUTO_KEYS and k != MANAGER_KEY}
        user["forked_from"] = provenance
        metadata = {**mgr._metadata(record), **user}
        metadata[MANAGER_KEY] = record
        mgr._write(mgr.path(target), state, metadata)
        return mgr.path(target)
