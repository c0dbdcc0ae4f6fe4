"""The remote tier of a manager's root: uploads, per-tier retention, resumes from remote.

Every checkpoint commits locally first; a background upload round then commits the
ones the remote retention keeps by :mod:`~functional_ckpt._src.remote.protocol`, each
rank uploading the files it wrote. Local retention spares a checkpoint until its
remote copy is committed (unless ``prune_unuploaded``). With one local root per
rank, a non-coordinator's ``step_N`` is a *part* (its shards, no manifest, no marker):
never listed or restored, kept only to be uploaded; a resume then comes from remote.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.header import header_of
from functional_ckpt._src.format.naming import BRANCHES_DIR, step_name
from functional_ckpt._src.log import done, logger, warn
from functional_ckpt._src.policy.retention import CheckpointRecord, RetentionPolicy, plan_deletions
from functional_ckpt._src.remote import protocol
from functional_ckpt._src.remote.fetch import remove_downloads
from functional_ckpt._src.remote.resume import RemoteResume
from functional_ckpt._src.remote.store import Store, public_url
from functional_ckpt._src.remote.uploader import Worker, failure, read_status, retried, write_status
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.listing import committed_steps, read_info, step_dirs
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    RemoteVanished,
    RemoteWarning,
    UnsafeCheckpoint,
)

__all__ = ["LEASE", "RemoteTier", "read_status"]

T = TypeVar("T")

#: The object beside the checkpoints naming the manager that writes the remote root:
#: the one that began writing there last. A manager takes it before its first upload
#: or deletion and checks it before each next one, so the stale process of a restarted
#: job stops writing once the new one writes (a manager that only restores never takes it).
LEASE = ".writer.json"

_DAMAGE = (CorruptCheckpoint, UnsafeCheckpoint, IncompleteCheckpoint, RemoteVanished)


class RemoteTier:
    """The object store behind one manager's root (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        url: str,
        *,
        keep: RetentionPolicy,
        storage_options: Mapping[str, Any] | None = None,
        prune_unuploaded: bool = False,
        writer: bool = True,
        timeout: float | None = None,
    ) -> None:
        self.root = root
        self.keep = keep
        self.prune_unuploaded = prune_unuploaded
        topo = topology()
        self.rank, self.world = topo.rank, topo.world
        self.coordinator = topo.coordinator
        self._group: Any = None
        self.shared = True
        error: BaseException | None = None
        self.url = public_url(url.rstrip("/"))  # never the URL's password
        self._lease = json.dumps(
            {"token": uuid.uuid4().hex, "host": socket.gethostname(), "pid": os.getpid()}
        ).encode()
        self._holding = False  # whether this manager took the remote root (see LEASE)
        try:
            self.store = Store(url, storage_options)
            if getattr(self.store.fs, "local_file", False) and os.path.realpath(
                self.store.base
            ) == os.path.realpath(root):
                raise CheckpointError(
                    f"remote={self.url!r}: the local root itself ({root}); its retention would "
                    "delete local checkpoints: give the remote tier a directory of its own"
                )
            retried(self.store.probe)  # a wrong endpoint, credentials or bucket fails here
        except BaseException as e:
            if self.world == 1:
                raise
            error = e
        if self.world > 1:
            from functional_ckpt._src.distributed.groups import agree, checkpoint_group

            self._group = checkpoint_group(timeout, purpose="upload")
            agree(error, self._group, f"remote {self.url}")
            if writer:
                from functional_ckpt._src.distributed.groups import one_directory

                self.shared = one_directory(root, self._group)
        self._lock = threading.Lock()
        self.failures: dict[int, CheckpointError] = {}
        self._unreported: list[CheckpointError] = []
        self._committed: set[int] = set()  # steps committed remotely (as last seen)
        self._dropped: set[int] = set()  # local steps the remote retention does not keep
        self._uploading: int | None = None
        self._records: dict[int, CheckpointRecord] = {}
        self._same: dict[int, bytes] = {}  # local steps whose remote copy has their marker
        self._worker: Worker | None = None
        self.resume = RemoteResume(  # its resume side (used by the manager's disk tier)
            self.store, root, self.url, shared=self.shared, listed=self._listed
        )
        if writer:
            if self.coordinator or not self.shared:
                remove_downloads(root)
            self._worker = Worker(self._round, coalesce=self.world == 1)
            self._worker.request()  # resumes what a crash interrupted

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, keep={self.keep!r})"

    @property
    def parts(self) -> bool:
        """Whether the ranks' local roots are split (one per machine): each rank's save
        then keeps its own shard files, and the uploads make every checkpoint whole."""
        return self.world > 1 and not self.shared

    # ------------------------------------------------------------------ training thread

    def committed(self) -> None:
        """A local checkpoint committed: run an upload round in the background."""
        if self._worker is not None:
            self._worker.request()

    def hold_uploads(self) -> None:
        """A save begins: uploads stand still until ``release_uploads``, so the state
        copy the loop waits for has the cores (see :mod:`~functional_ckpt._src.remote.mover`)."""
        self.store.pause_uploads()

    def release_uploads(self) -> None:
        self.store.resume_uploads()

    def check(self) -> None:
        """Report upload failures not reported yet, once each, as :class:`RemoteWarning`."""
        with self._lock:
            new, self._unreported = self._unreported, []
        for err in new:
            warn(str(err), RemoteWarning, stacklevel=3)

    def protected(self, local_steps: list[int]) -> set[int]:
        """Local steps retention must not delete yet: their remote copy is not committed."""
        if self.prune_unuploaded:
            return set()
        with self._lock:
            return {s for s in local_steps if s not in self._committed and s not in self._dropped}

    def steps(self) -> list[int]:
        """Steps committed on the remote tier, ascending (listed now)."""
        listing = retried(self.store.listing)
        return sorted(s for s, r in listing.items() if r.committed)

    def uploading(self) -> bool:
        """Whether an upload round is asked for or running."""
        return self._worker is not None and self._worker.busy()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every upload asked for so far has ended; report failures.
        False if ``timeout`` (seconds) passed first."""
        done = True if self._worker is None else self._worker.drain(timeout)
        self.check()
        return done

    def close(self) -> None:
        """Finish the uploads asked for, then stop the worker."""
        if self._worker is not None:
            self._worker.drain()
            self._worker.stop()
            self._worker = None
        self.store.close()
        self.check()

    def newer_than(self, step: int) -> list[int]:
        """Remote steps after ``step`` (committed or not), the uploads asked for done first."""
        if self._worker is not None:
            self._worker.drain()
        return sorted(s for s in retried(self.store.listing) if s > step)

    def set_aside(self, steps: list[int], branch: str | None) -> None:
        """A rollback's remote part: ``steps`` leave the remote trunk, copied first to
        ``url/branches/<branch>/`` (marker last) unless ``branch`` is None.

        Runs before the local rollback moves anything: a crash in between leaves the
        local trunk whole, and the next upload round puts its steps back remotely.
        """
        if steps:
            self._claim()  # a root another manager writes is not this one's to change
        for step in steps:
            if branch is not None and retried(partial(self.store.objects, step)).get(
                naming.COMMIT_MARKER
            ):
                dest = f"{self.store.base}/{BRANCHES_DIR}/{branch}/{step_name(step)}"
                retried(partial(protocol.copy_step, self.store, step, dest))
            retried(partial(protocol.remove_step, self.store, step))
            self._forget(step)

    def _forget(self, step: int) -> None:
        """Remote ``step`` is deleted."""
        with self._lock:
            self._committed.discard(step)
        self._records.pop(step, None)
        self._same.pop(step, None)

    # ------------------------------------------------------------------ restore

    def _listed(self, committed: set[int]) -> None:
        """A resume listed the remote root: what is committed there now."""
        with self._lock:
            self._committed = committed

    # ------------------------------------------------------------------ collectives

    def _gather(self, value: Any, group: Any = None) -> list[Any]:
        """Every rank's ``value`` (on the uploads' group unless told otherwise)."""
        if self.world == 1:
            return [value]
        from functional_ckpt._src.distributed.groups import all_gather_values

        return all_gather_values(value, group or self._group)

    def _share(self, value: Any, group: Any = None) -> Any:
        """The coordinator's ``value``, on every rank."""
        return self._gather(value if self.coordinator else None, group)[0]

    # ------------------------------------------------------------------ worker thread

    def _round(self) -> None:
        self.store.start_uploads()  # at the open of the manager, not during the first save
        plan: dict[str, list[int]] = {"upload": [], "local": []}
        if self.coordinator:
            try:
                plan = self._plan()
            except Exception as err:  # the other ranks still take part in the round
                self._fail(-1, err)
        plan = self._share(plan) if self.world > 1 else plan
        for step in plan["upload"]:
            self._upload(step)
        if self.coordinator:
            self._prune_remote()
            self._write_status()
        elif not self.shared:
            self._drop_parts(plan["local"])

    def _claim(self) -> None:
        """Before writing remotely: take the remote root (the first time), or raise if
        another manager took it since (see :data:`LEASE`)."""
        if not self._holding:
            retried(partial(self.store.write_root, LEASE, self._lease))
            self._holding = True
        self._held()

    def _held(self) -> None:
        """Raise unless this manager still holds the remote root."""
        protocol.check_lease(
            self.store, LEASE, retried(partial(self.store.read_root, LEASE)), self._lease
        )

    def _plan(self) -> dict[str, list[int]]:
        local = committed_steps(self.root)
        try:
            listing = retried(self.store.listing)
        except CheckpointError as err:
            self._fail(max(local, default=-1), err)
            return {"upload": [], "local": sorted(local)}
        committed = {s for s, r in listing.items() if r.committed}
        try:
            committed -= self._others(local, committed)
        except CheckpointError as err:
            self._fail(max(local, default=-1), err)
            return {"upload": [], "local": sorted(local)}
        candidates = sorted(s for s in local if s not in committed)
        records: list[Any] = [self._record(s) for s in committed]
        for s in candidates:
            try:
                records.append(read_info(local[s], s))
            except (CheckpointError, OSError):
                continue  # unreadable locally: not uploaded (the local resume deals with it)
        kept = self.keep.select(records) | {max(r.step for r in records)} if records else set()
        upload = [s for s in candidates if s in kept]
        if upload:
            try:
                self._claim()
            except CheckpointError as err:
                self._fail(upload[-1], err)
                upload = []
        with self._lock:
            self._committed = committed
            self._dropped = set(candidates) - kept
        return {"upload": upload, "local": sorted(local)}

    def _others(self, local: dict[int, Path], committed: set[int]) -> set[int]:
        """Local steps whose remote copy is another checkpoint of that step (another
        marker): not this one's copy, so uploaded over it. Each is compared once."""
        out = set()
        for step in sorted(committed & local.keys()):
            try:
                mine = protocol.local_marker(local[step])
            except (OSError, CheckpointError):
                continue
            if self._same.get(step) == mine:
                continue
            try:
                theirs = retried(partial(self.store.read, step, naming.COMMIT_MARKER))
            except RemoteVanished:
                theirs = b""  # deleted meanwhile: not a copy of anything
            if theirs == mine:
                self._same[step] = mine
            else:
                out.add(step)
                self._records.pop(step, None)
        return out

    def _record(self, step: int) -> CheckpointRecord:
        """What the remote retention needs of a remote checkpoint (its manifest, read once)."""
        if step not in self._records:
            created, metrics = 0.0, {}
            with contextlib.suppress(CheckpointError, ValueError):
                head = header_of(self.store.manifest(step)[1])
                created, metrics = head.created or 0.0, dict(head.record.metrics)
            self._records[step] = CheckpointRecord(step, created, metrics)
        return self._records[step]

    def _upload(self, step: int) -> None:
        """One checkpoint, by the object-store commit protocol, every rank its own files."""
        from functional_ckpt._src.distributed.groups import agree

        local, t0 = self.root / step_name(step), time.perf_counter()
        with self._lock:
            self._uploading = step
        if self.coordinator:
            self._write_status()
        error: BaseException | None = None
        present: dict[str, int] | None = {}
        sizes: dict[str, int] = {}
        try:
            if self.coordinator:
                sizes = protocol.expected_sizes(local)
                present = retried(lambda: protocol.begin_upload(self.store, step, local))
        except BaseException as e:
            error = e
        try:
            if self.world > 1:
                agree(error, self._group, f"upload {self.store.where(step)}")
                present = self._share(present)
            elif error is not None:
                raise error
            if present is None:
                self._done(step)  # already committed remotely: the same checkpoint
                return
            names = [
                n
                for n in os.listdir(local)
                if n not in (naming.COMMIT_MARKER, naming.MANIFEST)
                and protocol.owner(n, self.world) == self.rank
            ]
            parts = present or {}
            self._together(
                f"upload {self.store.where(step)}",
                lambda: retried(lambda: protocol.put_part(self.store, step, local, names, parts)),
            )

            def commit() -> None:
                self._held()  # a root taken over meanwhile gets no marker from here
                retried(lambda: protocol.commit_upload(self.store, step, local, sizes))

            self._together(f"commit {self.store.where(step)}", commit, here=self.coordinator)
        except BaseException as err:
            self._fail(step, err)
            return
        self._done(step)
        if self.coordinator:
            seconds, nbytes = time.perf_counter() - t0, sum(sizes.values())
            done(
                _LOG, "uploaded", self.store.where(step), seconds=seconds, nbytes=nbytes, step=step
            )

    def _together(self, what: str, action: Callable[[], object], here: bool = True) -> None:
        """``action`` (on this rank if ``here``), then every rank raises if any rank's
        failed: no rank goes on to the next phase of an upload alone."""
        error: BaseException | None = None
        try:
            if here:
                action()
        except BaseException as e:
            error = e
        if self.world > 1:
            from functional_ckpt._src.distributed.groups import agree

            agree(error, self._group, what)
        elif error is not None:
            raise error

    def _done(self, step: int) -> None:
        with self._lock:
            self._committed.add(step)
            self._uploading = None
            self.failures.pop(step, None)
        with contextlib.suppress(CheckpointError, OSError):
            info = read_info(self.root / step_name(step), step)
            self._records[step] = CheckpointRecord(step, info.time, dict(info.metrics))

    def _fail(self, step: int, err: BaseException) -> None:
        failed = failure(step, err, self.url)
        with self._lock:
            self._uploading = None
            if self.coordinator:
                self.failures[step] = failed
                self._unreported.append(failed)

    def _prune_remote(self) -> None:
        """Delete what the remote retention does not keep, marker first (never the newest)."""
        with self._lock:
            committed = sorted(self._committed)
        if not committed:
            return
        doomed = plan_deletions(self.keep, [self._record(s) for s in committed])
        if doomed:
            try:
                self._claim()
            except CheckpointError as err:
                self._fail(max(committed), err)
                return
        for step in doomed:
            try:
                protocol.remove_step(self.store, step)
            except CheckpointError as err:
                self._fail(step, err)
                continue
            self._forget(step)

    def _drop_parts(self, coordinator_steps: list[int]) -> None:
        """This rank's parts of steps the coordinator no longer keeps (crash-safely)."""
        if not coordinator_steps:
            return
        newest, kept = max(coordinator_steps), set(coordinator_steps)
        doomed = [p for s, p, _ in step_dirs(self.root) if s < newest and s not in kept]
        with contextlib.suppress(CheckpointError, OSError):
            remove_all(delete(self.root, doomed))

    def _write_status(self) -> None:
        with self._lock:
            doc = {
                "url": self.url,
                "time": time.time(),
                "remote": sorted(self._committed),
                "uploading": self._uploading,
                "failed": {str(s): str(e) for s, e in sorted(self.failures.items())},
            }
        write_status(self.root, doc)


_LOG = logger("remote")
