"""What the ranks of a multi-rank save tell the coordinator and it tells each back, in the
project's codec (docs/scale.md); pure, so benchmarks/scale.py measures it."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from torch.distributed.checkpoint.planner import SavePlan

from functional_ckpt._src import codec
from functional_ckpt._src.distributed import groups
from functional_ckpt._src.format import packed_rows
from functional_ckpt._src.format.manifest import Chunk
from functional_ckpt._src.format.naming import parse_shard, temporary_base
from functional_ckpt._src.format.packed_rows import Spliced
from functional_ckpt._src.save.dedup import Drops, ItemKey, dedup_keys
from functional_ckpt._src.save.job import SaveJob
from functional_ckpt._src.save.plan import Plan
from functional_ckpt.errors import CheckpointError

KeyBox = tuple[str, tuple[int, ...], tuple[int, ...]]  # a chunk's DCP key, offsets and sizes


@dataclass
class PlanCache:
    """The last plans of one checkpoint group: a layout saved again is not planned again. A
    cache never decides: a plan claimed unchanged that the coordinator lacks fails the save.
    """

    local: SavePlan | None = None
    final: SavePlan | None = None
    keys: list[tuple[ItemKey, ...]] | None = None
    drops: list[Drops] | None = None
    boxes: list[list[KeyBox]] | None = None  # each rank's written chunks' boxes (coordinator)
    recipe: Recipe | None = None  # where their rows went (``save/splice``)


@dataclass(frozen=True)
class Recipe:
    """Where a layout's rows went in the save that last merged it (``save/splice``)."""

    key: Any  # the tree's tensors, the values' entries, incremental or not
    names: list[str]  # the files rows name, by their number in the merged table
    layout: np.ndarray  # each row's file, offset, length and zstd (what .metadata reads)
    order: np.ndarray  # the rows of the parts, part after part
    bounds: list[int]  # where each part's rows start in ``order``
    rest: list[tuple[int, KeyBox]]  # the rows the index and the per-rank entries hold
    spliced: Spliced  # the split, and .metadata once the save derived it


def global_step(
    cache: PlanCache,
    sent: Sequence[tuple[ItemKey, ...] | None],
    dedup: Callable[[Sequence[Sequence[ItemKey]]], list[Drops]] = dedup_keys,
) -> list[Drops | None]:
    """The coordinator's step: each rank's drops, or None for "write your last plan" (``sent[r]``
    None: rank ``r``'s plan equals its last); a claimed plan it does not hold fails the save."""
    unchanged = [s is None for s in sent]
    if any(unchanged) and (cache.keys is None or len(cache.keys) != len(sent)):
        raise CheckpointError(
            "a rank reused a save plan this coordinator does not hold; save again"
        )
    if all(unchanged) and cache.drops is not None:
        return [None] * len(sent)
    held = cache.keys if cache.keys is not None else [()] * len(sent)
    merged = [c if s is None else s for c, s in zip(held, sent, strict=True)]
    drops = dedup(merged)
    last = cache.drops if cache.drops is not None and len(cache.drops) == len(sent) else None
    out: list[Drops | None] = [
        None if same and last is not None and last[r] == d else d
        for r, (d, same) in enumerate(zip(drops, unchanged, strict=True))
    ]
    cache.keys, cache.drops = merged, drops
    return out


def keys_payload(keys: tuple[ItemKey, ...] | None) -> Any:
    """A rank's keys as plain data (None: unchanged)."""
    if keys is None:
        return None
    return [[f, None if o is None else list(o), n] for f, o, n in keys]


def parse_keys(plain: Any, rank: int) -> tuple[ItemKey, ...] | None:
    """What :func:`keys_payload` made, checked: a rank's keys or None."""
    if plain is None:
        return None
    bad = CheckpointError(f"rank {rank} sent an invalid save plan")
    if not isinstance(plain, list):
        raise bad
    out: list[ItemKey] = []
    for k in plain:
        if not isinstance(k, list) or len(k) != 3:
            raise bad
        fqn, offset, nbytes = k
        if type(fqn) is not str or type(nbytes) is not int or nbytes < 0:
            raise bad
        if offset is not None:
            if not isinstance(offset, list) or any(type(v) is not int or v < 0 for v in offset):
                raise bad
            offset = tuple(offset)
        out.append((fqn, offset, nbytes))
    return tuple(out)


def parse_drops(plain: Any, n_items: int) -> Drops:
    """A rank's drops as the coordinator sent them, checked against its plan's length."""
    if not isinstance(plain, list) or any(
        type(i) is not int or not 0 <= i < n_items for i in plain
    ):
        raise CheckpointError("the coordinator sent an invalid save plan")
    return tuple(plain)


def results_payload(written: Sequence[tuple[str, Chunk]], boxes: bool = True) -> Any:
    """A rank's written chunks as fixed-width rows and, with ``boxes``, DCP keys and boxes."""
    files = list(dict.fromkeys(c.file for _, c in written))
    at = {f: i for i, f in enumerate(files)}
    table = np.array([(at[c.file], *c[3:]) for _, c in written], "<u8").reshape(
        -1, packed_rows.COLUMNS
    )
    keys = None
    if boxes:
        keys = [
            [f, struct.pack(f"<{2 * len(c.offsets)}Q", *c.offsets, *c.sizes)] for f, c in written
        ]
    return [files, table.tobytes(), keys]


@dataclass(frozen=True)
class Sent:
    """A rank's written chunks as it reported them (:func:`results_payload`), checked."""

    files: list[str]
    table: np.ndarray  # (chunks, COLUMNS) unsigned: the file's index, then the numbers
    boxes: list[KeyBox] | None  # None: those of the plan it wrote last time


def parse_results(plain: Any, rank: int) -> Sent:
    """What :func:`results_payload` made, checked."""
    bad = CheckpointError(f"rank {rank} reported invalid written chunks")
    if not isinstance(plain, list) or len(plain) != 3:
        raise bad
    files, raw, keys = plain
    if not isinstance(files, list) or any(type(f) is not str for f in files):
        raise bad
    for f in files:
        if parse_shard(f) is None:  # a shard file of this checkpoint, never a path
            raise CheckpointError(f"rank {rank} reported a chunk in {f!r}, not a shard file")
    if type(raw) is not bytes or len(raw) % (8 * packed_rows.COLUMNS):
        raise bad
    table = np.frombuffer(raw, "<u8").reshape(-1, packed_rows.COLUMNS).astype(np.uint64)
    if len(table) and (
        int(table[:, 0].max()) >= len(files)
        or int(table[:, 5:7].max()) > 0xFFFFFFFF  # CRC32s
        or int(table[:, 7].max()) > 1  # zstd
    ):
        raise bad
    if keys is None:
        return Sent(files, table, None)
    if not isinstance(keys, list) or len(keys) != len(table):
        raise bad
    boxes: list[KeyBox] = []
    for k in keys:
        if not isinstance(k, list) or len(k) != 2:
            raise bad
        fqn, packed = k
        if type(fqn) is not str or type(packed) is not bytes or len(packed) % 16:
            raise bad
        v = struct.unpack(f"<{len(packed) // 8}Q", packed)
        boxes.append((fqn, v[: len(v) // 2], v[len(v) // 2 :]))
    return Sent(files, table, boxes)


def rank_payload(
    plan: Plan, keys: tuple[ItemKey, ...] | None, error: BaseException | None = None
) -> bytes:
    """What a rank sends before writing: per-rank entries, keys (None: unchanged) or its failure."""
    if error is not None:
        return codec.encode([groups.report(error), None, None])
    return codec.encode([b"", [e.to_plain() for e in plan.local], keys_payload(keys)])


def written_payload(
    written: Sequence[tuple[str, Chunk]],
    error: BaseException | None = None,
    part: dict[str, int] | None = None,
    boxes: bool = True,
) -> bytes:
    """What a rank sends after writing: its chunks and ``part``'s file sizes, or its failure."""
    if error is not None:
        return codec.encode([groups.report(error), None, None])
    return codec.encode([b"", results_payload(written, boxes), part])


def parse_written(data: bytes, rank: int) -> tuple[bytes, Sent | None, dict[str, int]]:
    """:func:`written_payload` of ``rank``, checked: (its report, chunks, own part's files)."""
    sent = codec.decode(data)
    if not isinstance(sent, list) or len(sent) != 3 or type(sent[0]) is not bytes:
        raise CheckpointError(f"rank {rank} reported invalid written chunks")
    if sent[0]:
        return sent[0], None, {}
    part = sent[2] if sent[2] is not None else {}
    if not isinstance(part, dict) or any(
        type(n) is not str
        or type(size) is not int
        or size < 0
        or (parse_shard(n) or (-1,))[0] != rank
        for n, size in part.items()
    ):
        raise CheckpointError(f"rank {rank} reported invalid files of its own")
    return b"", parse_results(sent[1], rank), part


def reply(failures: dict[int, bytes], value: Any) -> bytes:
    """What the coordinator sends after a step: every failure, or the step's result."""
    return codec.encode([[[r, m] for r, m in sorted(failures.items())], value])


def parse_reply(data: bytes) -> tuple[dict[int, bytes], Any]:
    """:func:`reply` read back: (every failing rank's report, the result)."""
    bad = CheckpointError("the coordinator sent an invalid reply")
    try:
        told = codec.decode(data)
    except CheckpointError:
        raise bad from None
    if not isinstance(told, list) or len(told) != 2 or not isinstance(told[0], list):
        raise bad
    failures: dict[int, bytes] = {}
    for pair in told[0]:
        if not isinstance(pair, list) or len(pair) != 2:
            raise bad
        r, m = pair
        if type(r) is not int or type(m) is not bytes or not m:
            raise bad
        failures[r] = m
    return failures, told[1]


def arguments(job: SaveJob) -> dict[str, Any]:
    """What every rank of a save must pass alike: the destination and base by name (no base
    under parts), the staging mode (None: ``fc.save``), what shapes the files."""
    o = job.options
    told: dict[str, Any] = {"path": job.dest.name}
    if not o.parts:
        told["base"] = None if o.base is None else o.base.name
    told.update(
        overwrite=o.overwrite,
        staging=job.staging,
        per_rank=list(o.per_rank),
        parts=o.parts,
        durable=o.durable,
    )
    return told


def first_round(tmp_name: str, job: SaveJob) -> bytes:
    """The coordinator's temporary directory's name and :func:`arguments` (b"": it failed)."""
    return codec.encode([tmp_name, arguments(job)]) if tmp_name else b""


def parse_first_round(data: bytes) -> tuple[str, dict[str, Any] | None]:
    """:func:`first_round` read back: ("", None) for nothing sent."""
    if not data:
        return "", None
    bad = CheckpointError("the coordinator sent an invalid first round of a save")
    try:
        told = codec.decode(data)
    except CheckpointError:
        raise bad from None
    if not isinstance(told, list) or len(told) != 2:
        raise bad
    name, args = told
    if type(name) is not str or "/" in name or temporary_base(name) is None:
        raise bad
    if not isinstance(args, dict):
        raise bad
    return name, args


def disagreement(
    job: SaveJob, coordinator: dict[str, Any], rank: int, what: str
) -> CheckpointError | None:
    """The error failing the save on every rank for an argument passed unlike the coordinator."""
    for name, mine in arguments(job).items():
        theirs = coordinator.get(name, _ABSENT)
        if theirs != mine:
            shown = "(none)" if theirs is _ABSENT else repr(theirs)
            return CheckpointError(
                f"{what}: the ranks disagree on {name}: rank 0 passed {shown}, rank {rank} "
                f"{mine!r}; every rank of a save must pass the same {name}"
            )
    return None


_ABSENT = object()


def unreported(
    sizes: dict[str, int], present: Callable[[str], bool], reported: dict[str, int]
) -> list[str]:
    """The shard files a commit needs that are neither ``present`` nor ``reported``."""
    return sorted(n for n in sizes if n not in reported and not present(n))
