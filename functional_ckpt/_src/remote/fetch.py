"""Downloading a remote checkpoint, in parallel, committed locally.

The objects land in a private directory of the root, renamed into place with the
marker written last: a killed download leaves no marker, and the root's next writer
removes the directory (``root/leftovers``). Damage is ``CorruptCheckpoint``; a copy
deleted or replaced remotely meanwhile is ``RemoteVanished``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.format.view import parse_checkpoint
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.root.leftovers import DOWNLOAD_PREFIX
from functional_ckpt._src.storage import commit, committed, durable, opener
from functional_ckpt._src.storage.verify import verify
from functional_ckpt.errors import CheckpointError, CorruptCheckpoint, RemoteVanished

__all__ = ["commit_shares", "download", "fetch_share"]


def download(
    store: Store,
    step: int,
    into: Path,
    *,
    check: bool = True,
    replace: bool = False,
    rank: int | None = None,
    world: int = 0,
) -> Path:
    """Download and verify remote ``step``; return it committed as ``into/step_N``
    (``replace``: over a rank's part of it). ``check=False`` leaves verifying to the
    caller; with it, ``rank`` fetches only what that rank reads (:func:`_fetch`)."""
    work = f"{DOWNLOAD_PREFIX}{uuid.uuid4().hex[:12]}"
    try:
        with _damage(store, step):
            reader = None if check or rank is None else rank
            tmp = into / work / step_name(step)
            marker, names = _fetch(store, step, tmp, reader, index=True, world=world)
    except BaseException:
        commit.remove_tree(into / work)
        raise
    commit_shares(store, step, into, work, marker, check=check, replace=replace)
    final = into / step_name(step)
    # Flushed in the background: a copy torn by a power loss fails its checksums, is
    # moved aside and downloaded again (the remote copy is the durable one).
    threading.Thread(target=_fsync_all, args=(final, names), daemon=True).start()
    return final


def fetch_share(store: Store, step: int, into: Path, work: str, *, rank: int, world: int) -> bytes:
    """One rank's share of a download into a root the ranks share, flushed, in
    ``into/<work>/step_N``; the marker, written by :func:`commit_shares` once all are."""
    first, mine = rank == 0, into / work / f"rank-{rank}"  # the coordinator: rank 0
    tmp = into / work / step_name(step)
    with _damage(store, step):
        marker, names = _fetch(store, step, mine, rank, index=first, world=world, metadata=True)
        tmp.mkdir(exist_ok=True)
        for name in names:  # the index by the coordinator; a part's files by its rank
            if first or name != naming.MANIFEST:
                _fsync_all(mine, [name])
                os.replace(mine / name, tmp / name)
    return marker


def commit_shares(
    store: Store,
    step: int,
    into: Path,
    work: str,
    marker: bytes,
    *,
    check: bool = False,
    replace: bool = True,
) -> None:
    """Commit ``into/<work>/step_N`` as ``into/step_N``, marker last, once the remote copy
    is found unchanged (and, with ``check``, every byte verified)."""
    tmp, final = into / work / step_name(step), into / step_name(step)
    try:
        with _damage(store, step):
            _unchanged(store, step, marker)
            durable.write_new(tmp / naming.COMMIT_MARKER, marker)
            report = verify(tmp) if check else None
            if report is not None and not report.ok:
                problems = "; ".join(str(p) for p in report.problems[:3])
                raise CorruptCheckpoint(
                    f"{store.where(step)}: damaged remote checkpoint: {problems}"
                )
            commit.commit_checkpoint(tmp, final, overwrite=replace, replaces=commit.PARTS)
    finally:
        commit.remove_tree(into / work)


@contextlib.contextmanager
def _damage(store: Store, step: int) -> Iterator[None]:
    """Whatever a hostile remote manifest provokes is a ``CheckpointError``."""
    try:
        yield
    except (CheckpointError, OSError):
        raise
    except Exception as e:  # anything a forged manifest could still provoke
        raise CorruptCheckpoint(
            f"{store.where(step)}: damaged remote checkpoint ({type(e).__name__}: {e})"
        ) from e


def _fetch(
    store: Store,
    step: int,
    tmp: Path,
    rank: int | None,
    *,
    index: bool,
    world: int = 0,
    metadata: bool = False,
) -> tuple[bytes, list[str]]:
    """Download into ``tmp`` what one reader reads of remote ``step``, no marker: every
    file if ``rank`` is None, else its part and files, with ``index`` the index's files
    (``.metadata`` with ``metadata``; every part where ``world`` is not the saving one).
    The marker and the names fetched."""
    marker, manifest = store.manifest(step)
    # validated once, before any fetch: a forged table naming the marker is refused here
    shared = parse_checkpoint(manifest, Path(store.where(step))).shared
    listed = shared.file_sizes.items() if index or rank is None else ()
    sizes = {n: s for n, s in listed if rank is None or metadata or n != naming.DCP_METADATA}
    parts: list[int] = []  # parts that check themselves: the index lists none
    if shared.raw.get("version") == naming.PART_FILES_VERSION:
        parts = list(range(shared.parts))
        if world and shared.parts != world:  # a reader's chunks may lie in any part
            parts = parts if index else []
        elif rank is not None:
            parts = parts[rank : rank + 1]
    found = store.objects(step)
    wanted = [*sizes, *map(naming.part_name, parts), naming.MANIFEST]
    _present(store, step, found, wanted, sizes)
    tmp.mkdir(parents=True)
    _get(store, step, tmp, wanted)
    if parts:  # then the files the parts list (their own, not every rank's)
        with committed.Checkpoint(tmp, opener.open_directory(tmp), manifest) as ck:
            once = committed.parsed(ck)
            for r in parts:
                once.part(r)
            more = {n: s for n, s in once.shared.file_sizes.items() if n not in shared.file_sizes}
        _present(store, step, found, list(more), more)
        _get(store, step, tmp, list(more))
        wanted += more
    return marker, wanted


def _unchanged(store: Store, step: int, marker: bytes) -> None:
    """Raise unless remote ``step`` still has ``marker`` (not deleted or replaced)."""
    if store.objects(step).get(naming.COMMIT_MARKER) != len(marker) or (
        store.read(step, naming.COMMIT_MARKER) != marker
    ):
        raise RemoteVanished(
            f"{store.where(step)}: deleted or replaced remotely while it was downloaded"
        )


def _present(
    store: Store, step: int, found: dict[str, int], names: list[str], sizes: dict[str, int]
) -> None:
    """Every object of ``names`` is there, those of ``sizes`` at their recorded size."""
    missing = [n for n in names if n not in found]
    if missing:
        raise RemoteVanished(
            f"{store.where(step)}: {', '.join(missing[:5])} missing from a committed remote "
            "checkpoint: it is being deleted (or was damaged)"
        )
    for name, size in sizes.items():
        if found[name] != size:
            raise CorruptCheckpoint(
                f"{store.where(step, name)}: {found[name]} bytes, the manifest records {size}; "
                "the remote checkpoint is damaged"
            )


def _get(store: Store, step: int, tmp: Path, names: list[str]) -> None:
    if names:
        store.call(
            store.where(step),
            store.fs.get,
            [store.object_path(step, n) for n in names],
            [str(tmp / n) for n in names],
        )


def _fsync_all(path: Path, names: list[str]) -> None:
    for name in names:
        try:
            fd = os.open(path / name, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return  # deleted meanwhile: nothing to flush
        with contextlib.suppress(OSError):
            durable.fsync_and_close(fd)
