"""The manager's read side: restore a step, resume from the best tier, roll back.

Each of these reads a checkpoint and then continues the run from it: the policy
states, the rollback rule's watch and the running time come back from the
checkpoint's record (:meth:`ReadSide._adopt`), so a resumed run decides its next
saves as the uninterrupted one would. Where a resume reads from and what a rollback
moves is :mod:`.tiers`'s. :class:`~.manager.CheckpointManager` holds the state this
works on; the attributes below are its.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensordict import TensorDict

from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.format.header import record_of
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.manager.memory_tier import MemoryTier
from functional_ckpt._src.manager.provenance import Provenance, RunningTime, stored_state
from functional_ckpt._src.manager.rollback_rule import Watch
from functional_ckpt._src.manager.tiers import move_newer, newest_in_tiers
from functional_ckpt._src.policy import PolicyState, SavePolicy
from functional_ckpt._src.remote.tier import RemoteTier
from functional_ckpt._src.restore.api import check_like_or_out, restore
from functional_ckpt._src.restore.template import Reshard
from functional_ckpt._src.root import rollback
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt._src.root.rollback import Newer
from functional_ckpt._src.root.view import RootView
from functional_ckpt._src.state.tree import State
from functional_ckpt._src.storage.committed import check_committed
from functional_ckpt.errors import CheckpointError

__all__ = ["ReadSide"]


class ReadSide:
    """Restoring and rolling back, for :class:`~.manager.CheckpointManager`."""

    root: Path
    view: RootView
    read_only: bool
    memory: MemoryTier | None
    remote: RemoteTier | None
    save_policy: SavePolicy
    export: Export | None
    _coordinator: bool
    _closed: bool
    _restored_step: int | None
    _run: Provenance
    _running: RunningTime
    _watch: Watch
    _policy_state: PolicyState
    _export_state: PolicyState

    def wait(self) -> None:  # the manager's: every save in flight committed
        raise NotImplementedError

    def _check_open(self, what: str, *, writing: bool) -> None:
        if self._closed:
            raise CheckpointError(f"{self.root}: {what}: the manager is closed")
        if writing and self.read_only:
            raise CheckpointError(f"{self.root}: {what}: this manager is read-only")

    def restore(
        self,
        step: int,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict:
        """Restore one step (no fallback) and continue the policies from it.

        ``like``, ``out`` and ``reshard`` are those of :func:`functional_ckpt.restore`.
        """
        check_like_or_out(like, out, "CheckpointManager.restore")
        self._check_open("restore", writing=False)
        path = self.view.path(step)
        info = self.view.info(step)
        state = restore(path, like, out=out, reshard=reshard)
        self._adopt(info)
        return state

    def restore_latest(
        self,
        like: State | None = None,
        *,
        out: State | None = None,
        reshard: Reshard | None = None,
    ) -> TensorDict | None:
        """Restore the newest readable checkpoint; None only if the root holds none.

        With a memory tier its newest readable step comes first, unless the disk or
        remote tier holds a newer one; a damaged one there is reported as a
        ``MemoryWarning`` and the next tier tried. Unreadable checkpoints (corrupt
        bytes, missing files, torn manifest) are
        reported with a ``CheckpointWarning`` and skipped; a writing manager moves them
        aside to ``step_N.corrupt-…`` (never deletes them). A template that does not
        fit raises at once (a bug in the caller, not damage). If checkpoints exist but
        none is readable this raises rather than letting the run silently start over.
        ``like``/``out`` are those of :func:`functional_ckpt.restore`.
        """
        check_like_or_out(like, out, "CheckpointManager.restore_latest")
        self._check_open("restore_latest", writing=False)

        def read(path: Path) -> TensorDict:
            return restore(path, like, out=out, reshard=reshard)

        t0 = time.perf_counter()
        found = newest_in_tiers(
            self.view,
            self.memory,
            self.remote,
            read,
            writer=not self.read_only,
            coordinator=self._coordinator,
        )
        if found is None:
            _LOG.info(
                "no checkpoint in %s: starting fresh", self.root, extra={"path": str(self.root)}
            )
            return None
        info, state = found
        self._adopt(info)
        done(
            _LOG, "resumed", info.path, seconds=time.perf_counter() - t0, step=info.step, to="from"
        )
        return state

    def rollback(
        self,
        step: int,
        like: State | None = None,
        *,
        newer: Newer = "branch",
        branch: str | None = None,
        reason: Mapping[str, Any] | None = None,
    ) -> TensorDict:
        """Continue the run from the older kept checkpoint ``step``, in this root.

        Restores ``step`` like :meth:`restore`, then moves every newer checkpoint out of
        the trunk: to ``root/branches/<branch>/`` (``newer="branch"``) or deleted
        (``newer="delete"``); nothing moves if the restore fails, and a crash leaves
        the rollback not started or finished by the next writer. Later checkpoints
        record it under ``metadata["rollbacks"]`` (with ``reason``). See docs/manager.md.
        """
        return self._rollback(step, like, newer, branch, reason)[0]

    def _rollback(
        self,
        step: int,
        like: State | None,
        newer: Newer,
        branch: str | None,
        reason: Mapping[str, Any] | None,
    ) -> tuple[TensorDict, str | None]:
        """:meth:`rollback`, and the branch the newer checkpoints went to (or None)."""
        self._check_open("rollback", writing=True)
        rollback.check_request(newer, branch, reason)
        self.wait()  # a save in flight commits first: it may be one of the newer steps
        state = self.restore(step, like)  # raises, moving nothing, if step is unusable
        done = move_newer(
            self.view,
            self.memory,
            self.remote,
            step,
            newer=newer,
            branch=branch,
            reason=reason,
            coordinator=self._coordinator,
        )
        if done is None:
            return state, None
        self._run.rollbacks.append(done)
        return state, done.get("branch")

    def _adopt(self, info: StepInfo) -> None:
        """Continue the run from the restored checkpoint: policy states and running time."""
        self._restored_step = info.step
        if self.read_only:
            return  # a follower never saves: its policies are irrelevant
        self._run.resume(info.metadata)
        checksum = None
        with contextlib.suppress(CheckpointError, OSError):
            checksum = check_committed(info.path).get("manifest_crc32")
        self._run.continued_from(info.step, info.metadata, checksum)
        record = record_of(info.metadata)
        self._policy_state = stored_state(self.save_policy, record.raw, "save", info.path)
        self._watch.resume(record.raw, info.path)
        if self.export is not None:
            self._export_state = stored_state(self.export.policy, record.raw, "export", info.path)
        self._running.resume(record.running_time)


_LOG = logger("manager")
