"""The remote tier of a manager's root: a tier (``manager/tiers.Tier``) behind the disk.

Every checkpoint commits locally first, then a background round uploads what the
manager's retention keeps (:mod:`.protocol`, each rank its own files) and prunes.
With one local root per rank, a non-coordinator's ``step_N`` is a *part* (its shards,
no marker), kept only to be uploaded: the whole checkpoint lives remotely.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed import groups
from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.kind import is_committed
from functional_ckpt._src.format.naming import BRANCHES_DIR, step_name
from functional_ckpt._src.log import done, logger, warn
from functional_ckpt._src.policy.retention import CheckpointRecord
from functional_ckpt._src.remote import protocol, resume
from functional_ckpt._src.remote.fetch import download
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.remote.resume import Found
from functional_ckpt._src.remote.store import RemoteStep, Store, public_url
from functional_ckpt._src.remote.uploader import Worker, failure, read_status, retried, write_status
from functional_ckpt._src.root.delete import delete, remove_all
from functional_ckpt._src.root.leftovers import remove_downloads
from functional_ckpt._src.root.listing import committed_steps, read_info, step_dirs
from functional_ckpt._src.root.rollback import finish
from functional_ckpt._src.storage.committed import header_named
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointWarning,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    RankFailed,
    RemoteError,
    RemoteVanished,
    RemoteWarning,
)

__all__ = ["LEASE", "RemoteTier", "read_status"]

T = TypeVar("T")

#: The object naming the manager that writes the remote root (the last to begin): the
#: stale process of a restarted job stops writing once the new one writes.
LEASE = ".writer.json"


class RemoteTier:
    """The object store behind one manager's root (see the module docstring)."""

    def __init__(
        self, root: Path, option: Remote, *, writer: bool = True, apart: Sequence[Path] = ()
    ) -> None:
        self.root, self.keep, self.writer = root, option.keep, writer
        self.prune_unuploaded, url = option.prune_unuploaded, option.url
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
            self.store = Store(url, option.storage_options)
            if getattr(self.store.fs, "local_file", False):
                base = os.path.realpath(self.store.base)
                for place in (root, *apart):  # retention or uploads there would lose steps
                    real = os.path.realpath(place)
                    if os.path.commonpath([base, real]) in (base, real):
                        raise CheckpointError(
                            f"remote={self.url!r}: {base} is, lies inside or contains {place} "
                            "(the local root itself or the memory tier's folder): give the "
                            "remote tier a directory of its own"
                        )
            retried(self.store.listing)  # a wrong endpoint, credentials or bucket fails here
        except BaseException as e:
            if self.world == 1:
                raise
            error = e
        if self.world > 1:
            self._group = groups.checkpoint_group(purpose="upload")
            groups.agree(error, self._group, f"remote {self.url}")
            if writer:
                self.shared = groups.one_directory(root, self._group)
        self.parts = self.world > 1 and not self.shared  # a rank's root: its shards only
        self._lock = threading.Lock()
        self.failures: dict[int, CheckpointError] = {}
        self._unreported: list[Warning] = []
        self._spared: dict[int, str] = {}  # remote steps of another lineage, as reported
        self._committed: set[int] = set()  # steps committed remotely (as last seen)
        self._differ: set[int] = set()  # of those, another checkpoint than the local one
        self._dropped: set[int] = set()  # local steps the remote retention does not keep
        self._uploading: int | None = None
        self._below = float("inf")  # a round plans the steps up to it only (see hold)
        self._rolling: dict[int, BaseException] = {}  # that round's failures (see hold)
        self._records: dict[int, tuple[CheckpointRecord | None, Mapping[str, Any]]] = {}
        self._same: protocol.Copies = {}  # local steps with a remote copy, as last found
        self._worker: Worker | None = None
        self.bad: set[int] = set()  # remote steps found damaged by this process
        self.durable, self.local = True, False
        #: The manager's decisions over this tier (``manager/tiers``): its retention (after
        #: each upload round), what retention keeps (uploaded) and the lineage rule (its
        #: ``manager/provenance.Lineage``, set before the first round).
        self.prune: Callable[[], object] = lambda: None
        self.retained: Callable[[Sequence[Any]], set[int]] = lambda rs: {r.step for r in rs}
        self.ours: Any = None
        if writer:
            cut: BaseException | None = None
            if not self.coordinator and not self.shared:  # (the coordinator's lock does)
                try:
                    remove_downloads(root)
                    finish(root)  # a rollback a crash interrupted completes now
                except BaseException as e:
                    cut = e
            if self.parts:  # a rank that cannot finish fails every rank
                groups.agree(cut, self._group, f"rollback in {root}")
            self._worker = Worker(self._round, coalesce=self.world == 1)

    def __repr__(self) -> str:
        return f"RemoteTier({self.url!r}, keep={self.keep!r})"

    def copy_in(self, source: object, within: float) -> None:
        """A local checkpoint committed: an upload round runs in the background. One
        promoted on a signal (``within`` > 0) is waited for: the process may end next
        (its failures reported later: the interrupted thread may hold ``_lock``)."""
        if self._worker is not None:
            self._worker.request()
            if within:
                self._worker.drain(within)

    def open(self, step: int) -> Path:
        """The local copy of remote ``step`` (downloaded and verified first if missing)."""
        there = self.root / step_name(step)
        return there if is_committed(there) else download(self.store, step, self.root)

    def check(self) -> None:
        """Report upload failures (:class:`RemoteWarning`) and skips not reported yet, once each."""
        with self._lock:
            new, self._unreported = self._unreported, []
        for told in new:
            warn(str(told), type(told), stacklevel=3)

    def protected(self, local_steps: list[int]) -> set[int]:
        """Local steps retention must not delete yet: not copied remotely (as last found)."""
        if self.prune_unuploaded:
            return set()
        with self._lock:
            return set(local_steps) - (self._committed - self._differ) - self._dropped

    def steps(self) -> list[int]:
        """Steps committed on the remote tier, ascending (listed now, and remembered)."""
        listing = retried(self.store.listing)
        committed = {s for s, r in listing.items() if r.committed}
        with self._lock:
            self._committed = set(committed)
        return sorted(committed)

    def infos(self, steps: Iterable[int] | None = None) -> list[CheckpointRecord]:
        """What retention reads: this lineage's intact ``steps`` (default: committed, as known)."""
        with self._lock:
            steps = sorted(self._committed if steps is None else steps)
        heads = [self._head(s)[0] for s in self.lineage_of(steps)]
        return [r for r in heads if r is not None]

    def lineage_of(self, steps: Sequence[int], learn: Sequence[int] = ()) -> list[int]:
        """This lineage's remote ``steps`` (a root holding none first adopts that of ``learn``)."""
        heads = (self._head(s)[1] for s in learn)
        if learn and self.ours.runs is None and self.ours.learn(heads).unrelated:
            raise CheckpointError(self.ours.unsure(self.url))
        return [s for s in steps if self.ours(self._head(s)[1], self.store.where(s))]

    def delete(self, steps: Sequence[int]) -> None:
        """Remove this lineage's remote ``steps`` (another's stay), each marker first."""
        if steps := self.lineage_of(steps):
            self._claim()  # a root another manager writes is not this one's to change
        for step in steps:
            t0 = time.perf_counter()
            retried(partial(protocol.remove_step, self.store, step))
            seconds, where = time.perf_counter() - t0, self.store.where(step)
            done(_LOG, "deleted", where, seconds=seconds, step=step, to="at")
            with self._lock:
                self._committed.discard(step)
            self._records.pop(step, None)
            self._same.pop(step, None)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the uploads asked for ended; report failures (False: timed out)."""
        done = True if self._worker is None else self._worker.drain(timeout)
        self.check()
        return done

    def close(self, *, crashed: bool = False) -> None:
        """Finish the uploads asked for, then stop the worker (after a crash too)."""
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        self.store.close()
        self.check()

    def hold(self, step: int) -> None:
        """A rollback's round, before the newer steps leave: the trunk up to ``step``, held."""
        assert self._worker is not None  # a writer's: a rollback writes
        self._worker.drain()
        self._below = step
        try:
            self._worker.request()
            self._worker.drain()
        finally:  # later rounds upload every step again, whatever stopped this one
            self._below, failed, self._rolling = float("inf"), self._rolling, {}

        def held() -> None:
            err = failed.get(step, failed.get(-1))  # its upload's, or the plan's; each rank's own
            if isinstance(err, RankFailed) or (
                step in self._committed if self.coordinator else err is None
            ):
                return  # held, or another rank's failure (which reaches this one as RankFailed)
            why = failure(step, err, self.url) if err else self._spared.get(step)
            why = why or f"{self.url} does not hold step {step}"
            raise CheckpointError(f"rollback({step}): {why}; nothing was moved")

        self.together(f"rollback {self.url}", held)

    def set_aside(self, steps: list[int], branch: str | None) -> None:
        """A rollback's remote part: ``steps`` leave the remote trunk, copied first to
        ``url/branches/<branch>/`` unless ``branch`` is None. Before the local rollback:
        a crash in between leaves the local trunk whole, and uploads put it back."""
        for step in steps:
            if branch is not None and retried(partial(self.store.objects, step)).get(
                naming.COMMIT_MARKER
            ):
                dest = f"{self.store.base}/{BRANCHES_DIR}/{branch}/{step_name(step)}"
                retried(partial(protocol.copy_step, self.store, step, dest))
        self.delete(steps)

    def newest(self, read: Callable[[Path], T], above: int | None) -> Found[T]:
        """The newest good remote step newer than ``above``, read; a reader follows its root."""
        return resume.newest(self, read, above) if self.writer else None

    def _round(self) -> None:
        self.store.start_uploads()  # at the open of the manager, not during the first save
        plan: dict[str, list[int]] = {"upload": [], "local": []}
        if self.coordinator:
            try:
                plan = self._plan()
            except Exception as err:  # the other ranks still take part in the round
                self._fail(-1, err)
        plan = self.together(f"upload round {self.url}", lambda: plan)
        for step in plan["upload"]:
            self._upload(step)
        if self.coordinator:
            try:
                self.prune()  # the manager's retention over this tier
            except CheckpointError as err:
                self._fail(max(self._committed, default=-1), err)
            self._write_status()
        elif not self.shared:
            self._drop_parts(plan["local"])

    def _claim(self) -> None:
        """Take the remote root (the first time), or raise if another manager took it since."""
        if not self._holding:
            retried(partial(self.store.write_root, LEASE, self._lease))
            self._holding = True
        protocol.check_lease(
            self.store, LEASE, retried(partial(self.store.read_root, LEASE)), self._lease
        )

    def _plan(self) -> dict[str, list[int]]:
        local = {s: p for s, p in committed_steps(self.root).items() if s <= self._below}
        try:
            listing = retried(self.store.listing)
            remote = {s for s, r in listing.items() if r.committed and s <= self._below}
            both = remote & local.keys()
            committed = remote - {s for s in both if self._differs(s, local[s], listing[s])}
        except CheckpointError as err:
            self._fail(max(local, default=-1), err)
            return {"upload": [], "local": sorted(local)}
        candidates = sorted(s for s in local if s not in committed)
        records: list[Any] = self.infos(committed)
        spared: set[int] = set()  # kept locally: their remote slot is another lineage's
        for s in candidates:
            try:
                info = read_info(local[s], s)
            except (CheckpointError, OSError):
                continue  # unreadable locally: not uploaded (the local resume deals with it)
            if s in remote and self._foreign(s):
                spared.add(s)
            elif self.ours(info.metadata, info.path):
                records.append(info)
        kept = self.retained(records)
        upload = [s for s in candidates if s in kept]
        if upload:
            try:
                self._claim()
            except CheckpointError as err:
                self._fail(upload[-1], err)
                upload = []
        with self._lock:
            self._committed = committed
            self._differ = remote - committed
            self._dropped = set(candidates) - kept - spared
        return {"upload": upload, "local": sorted(local)}

    def _differs(self, step: int, local: Path, entry: RemoteStep) -> bool:
        """Whether remote ``step`` is no copy of the ``local`` one (``protocol.differs``)."""
        fn = partial(protocol.differs, self.store, step, local, entry.objects, self._same)
        try:
            if not retried(fn):
                return False
        except RemoteError:
            raise
        except (OSError, CheckpointError):
            return False  # unread locally: taken for a copy (the local resume sees to it)
        self._records.pop(step, None)
        return True

    def _foreign(self, step: int) -> bool:
        """Whether remote ``step``, another checkpoint than the local one, is another
        lineage's: it stays (reported once). Unread now, the round fails."""
        try:
            manifest = retried(partial(self.store.manifest, step))[1]
            theirs = header_named(manifest, step, self.store.where(step)).metadata
        except (CorruptCheckpoint, IncompleteCheckpoint, RemoteVanished):
            return False  # damaged, or gone meanwhile: no one's checkpoint
        if self.ours.holds(theirs):
            return False
        if step not in self._spared:
            self._spared[step] = (
                f"{self.ours.stranger(theirs, self.store.where(step))}: step {step} not "
                "uploaded: an upload never replaces it (the local checkpoint stays)"
            )
            with self._lock:
                self._unreported.append(CheckpointWarning(self._spared[step]))
        return True

    def _head(self, step: int) -> tuple[CheckpointRecord | None, Mapping[str, Any]]:
        """What retention and the lineage read of a remote checkpoint (its manifest, once):
        no record for damage (a step renamed, say), which no retention counts."""
        found = self._records.get(step)
        if found is None:
            found = None, {}
            with contextlib.suppress(CheckpointError, ValueError):
                head = header_named(self.store.manifest(step)[1], step, self.store.where(step))
                record = CheckpointRecord(step, head.created or 0.0, dict(head.record.metrics))
                found = record, dict(head.metadata)
            self._records[step] = found
        return found

    def _upload(self, step: int) -> None:
        """One checkpoint, by the object-store commit protocol, every rank its own files."""
        local, t0 = self.root / step_name(step), time.perf_counter()
        where = self.store.where(step)
        with self._lock:
            self._uploading = step
        if self.coordinator:
            self._write_status()
        sizes: dict[str, int] = {}

        def begin() -> dict[str, int] | None:  # objects there already; None: committed
            sizes.update(protocol.expected_sizes(local))
            return retried(lambda: protocol.begin_upload(self.store, step, local))

        try:
            present = self.together(f"upload {where}", begin, self.coordinator)
            if present is None:
                self._done(step)  # already committed remotely: the same checkpoint
                return
            names = [
                n
                for n in os.listdir(local)
                if n not in (naming.COMMIT_MARKER, naming.MANIFEST)
                and protocol.owner(n, self.world) == self.rank
            ]
            put = partial(protocol.put_part, self.store, step, local, names, present)
            self.together(f"upload {where}", lambda: retried(put))

            def commit() -> None:
                self._claim()  # held since the plan: a root taken over meanwhile gets no marker
                retried(lambda: protocol.commit_upload(self.store, step, local, sizes))

            self.together(f"commit {where}", commit, here=self.coordinator)
        except BaseException as err:
            self._fail(step, err)
            return
        self._done(step)
        if self.coordinator:
            seconds, nbytes = time.perf_counter() - t0, sum(sizes.values())
            done(_LOG, "uploaded", where, seconds=seconds, nbytes=nbytes, step=step)

    def together(
        self, what: str, action: Callable[[], object], here: bool = True, group: Any = None
    ) -> Any:
        """``action`` (on this rank if ``here``), then every rank raises if any failed: none
        goes on alone. The coordinator's result, on every rank (``group``: the uploads')."""
        if self.world == 1:
            return action()  # (``here``: the coordinator)
        error: BaseException | None = None
        value = None
        try:
            value = action() if here else None
        except BaseException as e:
            error = e
        mine = value if self.coordinator else None
        return groups.agree_values(error, mine, group or self._group, what)[0]

    def _done(self, step: int) -> None:
        with self._lock:
            self._committed.add(step)
            self._differ.discard(step)
            self._uploading = None
            self.failures.pop(step, None)
        with contextlib.suppress(CheckpointError, OSError):
            info = read_info(self.root / step_name(step), step)
            record = CheckpointRecord(step, info.time, dict(info.metrics))
            self._records[step] = (record, dict(info.metadata))

    def _fail(self, step: int, err: BaseException) -> None:
        failed = failure(step, err, self.url)
        with self._lock:
            self._uploading = None
            if self._below < float("inf"):  # a rollback's round: its error, not a report
                self._rolling[step] = err
            elif self.coordinator:
                self.failures[step] = failed
                self._unreported.append(RemoteWarning(str(failed)))

    def _drop_parts(self, coordinator_steps: list[int]) -> None:
        """This rank's parts of steps the coordinator no longer keeps (crash-safely), not
        another lineage's checkpoint copied into this rank's root."""
        newest, kept = max(coordinator_steps, default=-1), set(coordinator_steps)
        dirs = [(s, p) for s, p, _ in step_dirs(self.root) if s < newest and s not in kept]
        with contextlib.suppress(CheckpointError, OSError):
            remove_all(delete(self.root, [p for s, p in dirs if not self.theirs(s, p)]))

    def theirs(self, step: int, path: Path) -> bool:
        """Whether local ``step`` at ``path`` is another lineage's (a damaged one is no one's)."""
        with contextlib.suppress(CheckpointError, OSError):  # a part records no run
            return not self.ours(read_info(path, step).metadata, path)
        return False

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
