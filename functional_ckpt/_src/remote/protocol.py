"""Committing a checkpoint on an object store: every object confirmed, the marker last.

With no atomic rename, a remote checkpoint becomes visible by the local marker's bytes;
the manifest goes first, so every object found beside it was written after it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

from functional_ckpt._src.codec import documents
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.naming import parse_shard
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.storage import committed, opener
from functional_ckpt.errors import RemoteError, RemoteVanished

Copies = dict[int, tuple[bytes, dict[str, int]]]  # copies found (step -> marker, sizes): not reread


def owner(name: str, world: int) -> int:
    """The rank that uploads file ``name``: a shard file's writer, else the coordinator."""
    shard = parse_shard(name)
    rank = shard[0] if shard else 0
    return rank if rank < world else 0


def expected_sizes(local: Path) -> dict[str, int]:
    """Every object of the checkpoint at ``local`` except the marker, with its size."""
    files = committed.every_file(local)  # authenticated by the local marker
    sizes = {str(name): int(info["size"]) for name, info in files.items()}
    sizes[naming.MANIFEST] = (local / naming.MANIFEST).stat().st_size
    return sizes


def local_marker(local: Path) -> bytes:
    return opener.read_file(
        local / naming.COMMIT_MARKER, limit=LIMITS.marker_bytes, what="commit marker"
    )


def begin_upload(store: Store, step: int, local: Path) -> dict[str, int] | None:
    """None if ``step`` is committed remotely (every object at its size), else the objects
    of this very checkpoint there (name -> size), which need not be sent again."""
    manifest = opener.read_file(
        local / naming.MANIFEST, limit=LIMITS.manifest_bytes, what="manifest"
    )
    objects = store.objects(step)
    if naming.COMMIT_MARKER in objects:
        if not differs(store, step, local, objects, {}):
            return None
        store.remove(step, [naming.COMMIT_MARKER])  # superseded: uncommitted before anything else
        del objects[naming.COMMIT_MARKER]
    if (
        objects.get(naming.MANIFEST) == len(manifest)
        and store.read(step, naming.MANIFEST) == manifest
    ):
        return objects
    store.remove(step, sorted(objects))
    store.write(step, naming.MANIFEST, manifest)
    return {naming.MANIFEST: len(manifest)}


def differs(store: Store, step: int, local: Path, objects: Mapping[str, int], seen: Copies) -> str:
    """Why remote ``step`` (listed as ``objects``) is no copy of the checkpoint at ``local``,
    "" if it holds the local marker and every object at its size (one cut short is none)."""
    mine = local_marker(local)
    known, sizes = seen.get(step, (b"", {}))
    if known != mine:
        with contextlib.suppress(RemoteVanished):  # deleted meanwhile: a copy of nothing
            known = store.read(step, naming.COMMIT_MARKER)
        if known != mine:
            return f"the remote holds another checkpoint of step {step}"
        sizes = expected_sizes(local)
    if wrong := short(objects, sizes):
        return f"the remote copy is cut short: {', '.join(wrong[:5])}"
    seen[step] = mine, sizes
    return ""


def put_part(
    store: Store, step: int, local: Path, names: Iterable[str], present: dict[str, int]
) -> int:
    """Upload ``names`` not ``present`` at their size in one ``put``; the bytes sent."""
    sizes = {name: os.stat(local / name).st_size for name in names}
    todo = [n for n, size in sizes.items() if present.get(n) != size]
    if todo:
        lpaths = [str(local / n) for n in todo]
        rpaths = [store.object_path(step, n) for n in todo]
        store.put(store.where(step), lpaths, rpaths)
    _confirm(store, step, sizes)
    return sum(sizes[n] for n in todo)


def commit_upload(store: Store, step: int, local: Path, sizes: dict[str, int]) -> None:
    """Write the marker once every object of ``sizes`` is confirmed; then confirm it."""
    _confirm(store, step, sizes)
    marker = local_marker(local)
    store.write(step, naming.COMMIT_MARKER, marker)
    _confirm(store, step, {naming.COMMIT_MARKER: len(marker)})


def short(found: Mapping[str, int], sizes: Mapping[str, int]) -> list[str]:
    """The objects of ``sizes`` not ``found`` (a listing) at their size, described."""
    return [
        f"{name} ({'missing' if name not in found else f'{found[name]} bytes'}, expected {size})"
        for name, size in sorted(sizes.items())
        if found.get(name) != size
    ]


def _confirm(store: Store, step: int, sizes: dict[str, int]) -> None:
    if wrong := short(store.objects(step), sizes):
        raise RemoteError(
            f"{store.where(step)}: uploaded objects not confirmed: {', '.join(wrong[:5])}; "
            "the checkpoint is not committed remotely"
        )


def remove_step(store: Store, step: int) -> None:
    """Delete remote ``step``: its marker first (no longer committed), then the rest."""
    store.remove(step, [naming.COMMIT_MARKER])
    store.remove(step, sorted(store.objects(step)))


def copy_step(store: Store, step: int, dest: str) -> None:
    """Copy committed remote ``step`` into the directory ``dest`` of the store, marker last."""
    objects = store.objects(step)
    for name in sorted(objects, key=lambda n: n == naming.COMMIT_MARKER):
        src = store.object_path(step, name)
        store.call(src, store.fs.copy, src, f"{dest}/{name}")


def check_lease(store: Store, name: str, found: bytes | None, mine: bytes) -> None:
    """Raise unless the lease object ``name`` found at the root is ``mine``."""
    if found == mine:
        return
    try:
        other = documents.load(found or b"{}", name)
        who = f"pid {int(other['pid'])} on {str(other['host'])[:64]!r}"
    except (ValueError, TypeError, KeyError):
        who = "an unknown writer"
    raise RemoteError(
        f"{store.url}: another manager ({who}) began writing to this remote root after this "
        "one; this one no longer uploads or deletes there (one writer per remote root: give "
        "each run its own prefix)"
    )
