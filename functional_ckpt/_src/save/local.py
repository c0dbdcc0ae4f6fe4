"""One process writes a planned state and commits it; :func:`finalize` commits every save."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path

import torch

from functional_ckpt._src.format import dcp_metadata, naming
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.manifest import Manifest, Tree, Written, assemble
from functional_ckpt._src.format.segments import FIELD, pack_segments
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.save import incremental
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import Hooks, SaveJob
from functional_ckpt._src.save.plan import byte_entries
from functional_ckpt._src.save.trust import Key, Seen
from functional_ckpt._src.storage import commit, durable
from functional_ckpt._src.storage.os_failure import os_failure
from functional_ckpt.errors import CheckpointError, UnsupportedValue


def finalize(
    tmp: Path,
    job: SaveJob,
    tree: Tree,
    written: Written,
    *,
    created: float,
    before_commit: Callable[[], None] | None = None,
    syncing: list[Future[None]] | None = None,
    elsewhere: Mapping[str, int] | None = None,
    sync: bool = True,
) -> int:
    """Commit ``tmp`` as the job's checkpoint; return its bytes on disk. ``syncing``: shard
    fsyncs still running; ``elsewhere``: files ranks wrote into their own parts; no ``sync``:
    no fsync."""
    syncing = [] if syncing is None else syncing
    dest, prepared = job.dest, job.prepared
    assert prepared is not None
    try:
        manifest = assemble(
            tree,
            written,
            {},
            created=created,
            metadata=prepared.metadata,
            metadata_bytes=prepared.metadata_bytes,
        )
        spliced = written.spliced  # a multi-rank save of the layout saved last keeps it
        md_bytes = spliced.dcp if spliced is not None else None
        if md_bytes is None:
            md_bytes = dcp_metadata.derive(manifest.tensor_groups(), manifest.dcp_bytes)
        if spliced is not None:
            spliced.dcp = md_bytes
        durable.write_new(tmp / naming.DCP_METADATA, md_bytes, sync=sync, background=syncing)
        files = {naming.DCP_METADATA: {"size": len(md_bytes), "crc32": crc32(md_bytes)}}
        for name in sorted(os.listdir(tmp)):
            files.setdefault(name, {"size": (tmp / name).stat().st_size})
            files[name].update(written.file_info.get(name, {}))
        for name, size in sorted((elsewhere or {}).items()):
            files.setdefault(name, {"size": size})
        manifest = dataclasses.replace(manifest, files=files)
        parts = 0  # each part checks itself (a CRC32 follows it): the index lists none
        for name, data in encode_parts(manifest, dest):
            durable.write_new(tmp / name, data, sync=sync, background=syncing)
            parts += len(data)
        manifest_bytes = manifest.encode()
        if len(manifest_bytes) > LIMITS.manifest_bytes:  # only the coordinator knows it
            raise UnsupportedValue(
                f"{dest}: the manifest of this save would be {len(manifest_bytes)} bytes, "
                f"more than the {LIMITS.manifest_bytes} a reader accepts ({len(tree.ranks)} "
                "ranks, one chunk per rank of every sharded tensor); nothing was committed: "
                "save the state in parts (e.g. model and optimizer apart)"
            )
        durable.write_new(tmp / naming.MANIFEST, manifest_bytes, sync=sync)
    finally:
        for fut in syncing:  # every file durable (or its error raised) before going on
            fut.result()
    if before_commit is not None:
        before_commit()
    commit.write_commit_marker(tmp, manifest_bytes, version=manifest.version, sync=sync)
    commit.commit_checkpoint(tmp, dest, overwrite=job.options.overwrite, sync=sync)
    return sum(f["size"] for f in files.values()) + parts + len(manifest_bytes)


def encode_parts(manifest: Manifest, dest: Path) -> list[tuple[str, bytes]]:
    """Every part of a split manifest (none for one manifest), each within its limit."""
    if not manifest.parted:
        return []
    out: list[tuple[str, bytes]] = []
    for rank in range(len(manifest.ranks)):
        data = manifest.encode_part(rank)
        name = naming.part_name(rank)
        if len(data) > LIMITS.manifest_part_bytes:
            raise UnsupportedValue(
                f"{dest}: {name}, rank {rank}'s part of the manifest, would be {len(data)} "
                f"bytes, more than the {LIMITS.manifest_part_bytes} a reader accepts; "
                "nothing was committed: keep less per-rank state"
            )
        out.append((name, data))
    return out


def write_local(job: SaveJob, tensors: Sequence[torch.Tensor], hooks: Hooks) -> CheckpointInfo:
    """Write and commit a planned state from one process (``tensors``: contiguous, on the CPU)."""
    plan, dest = job.plan, job.dest
    t0 = time.perf_counter()
    created = time.time()
    tmp = durable.tmp_sibling(dest)
    keys: list[Key] = [(e.fqn, (0,) * len(e.shape)) for e in plan.targets]  # whole tensors
    try:
        durable.make_dirs(dest.parent)
        tmp.mkdir()
        syncing: list[Future[None]] = []
        blobs = byte_entries(plan, snapshot=job.snapshot)
        chunks, located, segments = incremental.write_rank(
            tmp,
            0,
            job.base,
            keys,
            tensors,
            job.idents,
            after_each=hooks.after_each,
            syncing=syncing,
            blobs=blobs,
            sync=job.options.durable,
            live=hooks.live,
            zstd_level=job.options.zstd_level,
        )
        if hooks.after_read is not None:
            hooks.after_read()
        by_fqn = {e.fqn: (c,) for e, c in zip(plan.targets, chunks, strict=True)}
        info = incremental.reused_info(tmp)
        if segments:
            info.setdefault(naming.shard_name(0), {})[FIELD] = pack_segments(segments)
        written = Written(by_fqn, tuple(located), info)
        check = hooks.before_commit
        nbytes = finalize(
            tmp,
            job,
            plan.tree(),
            written,
            created=created,
            before_commit=None if check is None else (lambda: check(written)),
            syncing=syncing,
            sync=job.options.durable,
        )
    except BaseException as e:
        commit.remove_tree(tmp)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):  # CheckpointExists
            raise os_failure(e, dest, "saving") from e
        raise
    job.options.trust.remember(dest, Seen(keys, job.idents))
    return job.info(nbytes, created, t0)
