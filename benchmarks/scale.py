"""Coordination at 8..4096 ranks, simulated: fc.save / fc.restore against stock DCP.

A multi-rank save spends most of its time writing bytes, but around the writes
every rank plans, the coordinator merges every rank's plan and writes the
manifest and DCP's ``.metadata``, and on restore every rank reads them back. Those
costs grow with the number of ranks; this script measures them for world sizes
no machine here can launch, by running the project's own code for every simulated
rank, without a process group:

model
  A decoder of ``--layers`` layers (hidden 4096, MLP 16384, vocabulary 32768; with
  ``--full`` the llama-like layout: 32 layers of 8 weights, 1,037 tensors), every
  weight a DTensor sharded on dim 0 across the N ranks (as FSDP2's ``fully_shard``
  leaves it), AdamW's two moments beside each (sharded the same way) and its
  replicated 0-d ``step``; a few replicated values (hyperparameters, the step);
  each rank's own ``rng`` and ``loader`` state. Tensors are stride-0 views: no
  tensor byte is allocated, planning never reads one.
fc, one rank
  ``plan_save`` of the whole state and the encoding of its per-rank entries
  (``multi_rank.local_entries``): what each rank does before it sends anything.
fc, coordinator
  Decoding every rank's entries and keys and DCP's deduplication on them
  (``multi_rank.coordinate``), reading every rank's written chunks
  (``exchange.parse_written``: what each rank's shard writer reports, one chunk per
  shard of every sharded tensor, replicated tensors spread over the ranks as DCP's
  planner spreads them), merging them and packing the parts' rows
  (``splice.merge``), then ``manifest.assemble``, ``dcp_metadata.derive``,
  ``local.encode_parts`` and ``Manifest.encode`` (the index): everything
  ``finalize`` computes before it writes, timed by function. A second save of the
  same layout is timed too: every rank says "unchanged" and sends its chunks' new
  numbers without their boxes, so nothing is planned, the rows are packed from the
  columns and ``.metadata`` is kept.
fc, one rank's restore
  Decoding the manifest's index, ``parse_checkpoint`` and the rank's view without
  the sharded chunks, the parts its shards meet (``dtensor.parts_meeting``: its
  own), their CRC32 and decoding, the view filled from them, the DCP ``Metadata``
  its reader serves (``dcp_metadata.metadata_for``) and DCP's load planning for
  the rank's shards (``create_read_items_for_chunk_list``, what
  ``DefaultLoadPlanner`` calls per tensor). Then the same rank on real files
  (:func:`restore_on_disk`): the files it opens, the bytes it reads and the most
  descriptors it holds, counted at ``os.open``, ``os.pread`` and ``os.close``.
stock DCP
  The same plans through ``DefaultSavePlanner.create_global_plan`` and the
  ``Metadata`` that ``FileSystemWriter.finish`` pickles; one rank's load:
  unpickling ``.metadata`` and the same load planning.

Bytes each rank sends and receives are predicted from the payloads (what the
project's collective helpers in ``distributed/groups`` move, counted the way
tests/test_dist.py counts a real 8-rank run, and DCP's own object collectives, from
the pickles ``torch.distributed`` would send). Times are this process's CPU time
(``time.process_time``: a shared machine's load does not inflate them); peak
memory is ``tracemalloc``'s peak above the start of each phase (a second,
separate run of it).

Targets (one run): coordinator time and bytes received from N=256 to N=4096 at
most 20x; bytes a non-coordinator rank receives in a save constant in N; at
N=1024 the coordinator's time <= 0.3x DCP's planning and metadata, one rank's
restore planning <= 0.3x DCP's and under 1 s, its peak memory <= 0.2x the decoded
manifest; a cached second save's coordinator time <= 0.3x the first; the files a
restoring rank opens and the bytes it reads besides its tensors' within 1.25x from
N=256 to N=4096, its restore CPU within 1.5x; the coordinator's first save at
N=4096 <= 0.5x DCP's planning and ``.metadata``.

Usage::

    python benchmarks/scale.py [--quick | --full] [--ranks 8,64,256] [--layers L] [--json PATH]
    python benchmarks/scale.py --sockets [--full]   # a rank's sockets for its checkpoint groups
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import pickle
import sys
import time
import tracemalloc
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from _common import (
    REPO_ROOT,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    environment,
    finish,
    fmt_ratio,
    fmt_seconds,
    ratio,
    render_targets,
    verdict,
)

if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

DEFAULT_RANKS = (8, 64, 256, 1024)
QUICK_RANKS = (8, 64)
FULL_RANKS = (256, 512, 1024, 2048, 4096)
#: The llama-like layout: 32 layers of 8 weights, embedding, norm and head (1,037
#: tensors with AdamW's moments and the rng, 777 of them sharded on dim 0).
LLAMA = {"layers": 32, "norms": 1}
HEADER = 64  # bytes of blob header before a chunk's raw bytes (what the layout reserves)
PER_RANK = ("rng", "loader")


# --------------------------------------------------------------------------- the model


@dataclass(frozen=True)
class Model:
    """A decoder's parameter shapes; every dimension 0 divides by every simulated N."""

    layers: int = 4
    hidden: int = 4096
    mlp: int = 16384
    vocab: int = 32768
    norms: int = 2  # per layer

    def params(self) -> list[tuple[str, tuple[int, ...]]]:
        h, m = self.hidden, self.mlp
        out: list[tuple[str, tuple[int, ...]]] = [("embed", (self.vocab, h))]
        for i in range(self.layers):
            p = f"layer{i}_"
            out += [(p + n, (h, h)) for n in ("q", "k", "v", "o")]
            out += [(p + "gate", (m, h)), (p + "up", (m, h)), (p + "down", (h, m))]
            out += [(p + f"norm{j + 1}", (h,)) for j in range(self.norms)]
        return [*out, ("norm", (h,)), ("head", (self.vocab, h))]


def _placeholder(shape: Sequence[int], dtype: Any = None) -> Any:
    """A tensor of ``shape`` holding one element (a stride-0 view): planning reads none."""
    import torch

    one = torch.empty((), dtype=dtype or torch.float32)
    return one.expand(*shape) if shape else one


def per_rank_state(rank: int, rng: Any = None) -> dict[str, Any]:
    """One rank's own state: its generator's state (``rng``, else a placeholder of its
    shape) and its data position."""
    import torch

    return {
        "rng": {"torch": _placeholder((5056,), torch.uint8) if rng is None else rng, "seed": rank},
        "loader": {"pos": rank * 100, "seed": rank, "epoch": 3},
    }


#: Makes one tensor of the state: (its key, global shape, sharded on dim 0?) -> tensor.
MakeTensor = Callable[[str, tuple[int, ...], bool], Any]


def _placeholders(key: str, shape: tuple[int, ...], sharded: bool) -> Any:
    t = _placeholder(shape)
    return t.requires_grad_(True) if key.startswith("model/") else t


def full_state(
    model: Model, rank: int, tensor: MakeTensor = _placeholders, rng: Any = None
) -> dict[str, Any]:
    """The state one rank passes to ``fc.save`` (shapes global, as a DTensor reports).

    ``tensor`` makes each tensor (placeholders here; DTensors in tests/dist_job.py,
    which saves this same state for real).
    """
    params = model.params()
    weights = {n: tensor(f"model/{n}", s, True) for n, s in params}
    opt_state = {
        n: {
            "step": tensor(f"optim/{n}/step", (), False),
            "exp_avg": tensor(f"optim/{n}/exp_avg", s, True),
            "exp_avg_sq": tensor(f"optim/{n}/exp_avg_sq", s, True),
        }
        for n, s in params
    }
    groups = [
        {
            "lr": 3e-4,
            "betas": [0.9, 0.95],
            "eps": 1e-8,
            "weight_decay": 0.1,
            "params": [n for n, _ in params],
        }
    ]
    return {
        "model": weights,
        "optim": {"state": opt_state, "param_groups": groups},
        "step": 1000,
        **per_rank_state(rank, rng),
    }


# --------------------------------------------------------------------------- one world


@dataclass
class World:
    """Everything the simulated ranks of one world size planned and wrote."""

    n: int
    plan: Any  # rank 0's Plan (the shared entries are every rank's)
    payloads: list[bytes]  # what each rank sends the coordinator: entries, item keys
    payloads_again: list[bytes]  # the same in a second save of the layout ("unchanged")
    locals_: list[tuple[Any, ...]]  # each rank's per-rank entries
    local_targets: list[tuple[Any, ...]]  # each rank's per-rank tensors
    results: list[list[tuple[str, Any]]]  # each rank's written chunks, by DCP key
    blobs: tuple[Any, ...]  # the values as DCP byte entries, located (rank 0)
    dcp_plans: list[Any]  # each rank's DCP SavePlan (stock DCP's local_step)
    dcp_results: list[list[Any]]  # each rank's DCP WriteResults
    plan_s: float  # one rank's fc planning time
    written: list[bytes]  # what each rank reports having written (its chunks with boxes)
    written_again: list[bytes]  # the same in a second save (new CRC32s, no boxes)
    plans: Any = field(default_factory=lambda: _plan_cache())  # the coordinator's last plans


def _plan_cache() -> Any:
    from functional_ckpt._src.save.exchange import PlanCache

    return PlanCache()


def _sharded(entry: Any, n: int) -> bool:
    return len(entry.shape) > 0 and entry.shape[0] % n == 0 and entry.path[0] not in PER_RANK


def _chunk(entry: Any, rank: int, n: int, cursor: int, sharded: bool) -> Any:
    """The chunk a rank's shard writer reports for its part of ``entry``."""
    from functional_ckpt._src.format.manifest import Chunk
    from functional_ckpt._src.format.naming import shard_name

    sizes, rest, nbytes = _box(tuple(entry.shape), entry.dtype.itemsize, n if sharded else 1)
    seed = f"{entry.fqn}/{rank}".encode()
    return Chunk(
        (rank * sizes[0], *rest) if sharded else (0, *rest)[: len(sizes)],
        sizes,
        shard_name(rank),
        cursor,
        HEADER + nbytes,
        cursor + HEADER,
        nbytes,
        zlib.crc32(seed),
        zlib.crc32(seed[::-1]),
    )


@functools.cache
def _box(shape: tuple[int, ...], itemsize: int, n: int) -> tuple[Any, ...]:
    """A shard's sizes of ``shape`` split on dim 0 ``n`` ways, the zeros after its
    first offset, its bytes."""
    if not shape:
        return (), (), itemsize
    sizes = (shape[0] // n, *shape[1:])
    return sizes, (0,) * (len(shape) - 1), math.prod(sizes) * itemsize


def simulate(model: Model, n: int) -> World:
    """Plan every rank of an ``n``-rank save and say what each rank's writer reports."""
    import torch
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        MetadataIndex,
        TensorProperties,
    )
    from torch.distributed.checkpoint.planner import (
        SavePlan,
        TensorWriteData,
        WriteItem,
        WriteItemType,
    )
    from torch.distributed.checkpoint.planner_helpers import (
        _create_write_item_for_bytesio,
        _create_write_item_for_tensor,
    )
    from torch.distributed.checkpoint.storage import WriteResult

    from functional_ckpt._src.save import dedup, exchange
    from functional_ckpt._src.save.plan import byte_entries, plan_save

    t0 = time.process_time()
    plan = plan_save(full_state(model, 0), per_rank=PER_RANK, rank=0)
    plan_s = time.process_time() - t0
    shared = [t for t in plan.targets if t.path[0] not in PER_RANK]
    planned_blobs = byte_entries(plan)
    props = {}
    for t in shared:
        props[t.fqn] = TensorProperties(dtype=t.dtype, requires_grad=t.requires_grad)

    rank_plans = [plan]
    locals_, local_targets = (
        [plan.local],
        [tuple(t for t in plan.targets if t.path[0] in PER_RANK)],
    )
    for r in range(1, n):
        p = plan_save(per_rank_state(r), per_rank=PER_RANK, rank=r)
        rank_plans.append(p)
        locals_.append(p.local)
        local_targets.append(p.targets)

    results: list[list[tuple[str, Any]]] = [[] for _ in range(n)]
    cursors = [0] * n
    replicated = 0
    for t in shared:
        if _sharded(t, n):
            owners = range(n)
        else:  # DCP's planner writes a replicated tensor once, spreading them over ranks
            owners = range(replicated % n, replicated % n + 1)
            replicated += 1
        for r in owners:
            c = _chunk(t, r, n, cursors[r], _sharded(t, n))
            cursors[r] += c.length
            results[r].append((t.fqn, c))
    for r in range(n):  # every rank writes its own per-rank tensors
        for t in local_targets[r]:
            c = _chunk(t, r, n, cursors[r], False)
            cursors[r] += c.length
            results[r].append((t.fqn, c))
    blobs = []
    for b in planned_blobs:
        blobs.append(b.located(results[0][0][1].file, cursors[0]))
        cursors[0] += len(b.data)

    # stock DCP's local plans: what DefaultSavePlanner.create_local_plan makes of each
    # rank's state dict (DTensor shards, replicated tensors, values as byte items)
    dcp_plans, dcp_results = [], []
    # objects equal across tensors and ranks made once (DCP's planner never mutates them)
    whole = {t.fqn: _create_write_item_for_tensor(t.fqn, torch.empty(t.shape)) for t in shared}
    values = [_create_write_item_for_bytesio(b.fqn, b"") for b in planned_blobs]
    shard_data: dict[tuple[Any, ...], Any] = {}
    for r in range(n):
        its: list[Any] = []
        for t in shared:
            if not _sharded(t, n):
                its.append(whole[t.fqn])
                continue
            key = (t.shape, t.dtype_name, t.requires_grad, r)
            data = shard_data.get(key)
            if data is None:
                rows = t.shape[0] // n
                data = shard_data[key] = TensorWriteData(
                    chunk=ChunkStorageMetadata(
                        offsets=torch.Size((r * rows, *([0] * (len(t.shape) - 1)))),
                        sizes=torch.Size((rows, *t.shape[1:])),
                    ),
                    properties=props[t.fqn],
                    size=torch.Size(t.shape),
                )
            index = MetadataIndex(t.fqn, data.chunk.offsets)
            its.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=data))
        for t in local_targets[r]:
            its.append(_create_write_item_for_tensor(t.fqn, torch.empty(t.shape, dtype=t.dtype)))
        its += values
        dcp_plans.append(SavePlan(its, planner_data={it.index.fqn: () for it in its}))
    # what each rank sends the coordinator in fc.save: its per-rank entries and the
    # keys of its write items (the tensors alone: fc.save writes values itself)
    t0 = time.process_time()
    payloads = [
        exchange.rank_payload(
            p,
            dedup.item_keys(SavePlan([it for it in d.items if it.type != WriteItemType.BYTE_IO])),
        )
        for p, d in zip(rank_plans, dcp_plans, strict=True)
    ]
    plan_s += (time.process_time() - t0) / n
    payloads_again = [exchange.rank_payload(p, None) for p in rank_plans]
    # what each rank reports having written: the boxes too, unless it wrote its last plan
    written = [exchange.written_payload(r) for r in results]
    written_again = [  # new values: new CRC32s in the same layout
        exchange.written_payload(
            [(k, c._replace(crc32=c.crc32 ^ 0x5A5A5A)) for k, c in r], boxes=False
        )
        for r in results
    ]
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    for r in range(n):
        index_of = {it.index.fqn: it.index for it in dcp_plans[r].items}  # the same keys
        dcp_results.append(
            [
                WriteResult(
                    index=index_of[fqn],
                    size_in_bytes=c.length,
                    storage_data=_StorageInfo(c.file, c.offset, c.length),
                )
                for fqn, c in results[r]
            ]
        )
    for b in blobs:
        dcp_results[0].append(
            WriteResult(
                index=MetadataIndex(b.fqn),
                size_in_bytes=b.length,
                storage_data=_StorageInfo(b.file, b.offset, b.length),
            )
        )
    return World(
        n,
        plan,
        payloads,
        payloads_again,
        locals_,
        local_targets,
        results,
        tuple(blobs),
        dcp_plans,
        dcp_results,
        plan_s,
        written,
        written_again,
    )


# --------------------------------------------------------------------------- the phases


def fc_coordinator(
    world: World, again: bool = False, split: dict[str, float] | None = None
) -> tuple[bytes, list[bytes], bytes]:
    """The coordinator's share of ``fc.save``: (the manifest's index, its per-rank
    parts, .metadata). ``again``: a save of the layout saved last, where every rank
    sent "unchanged" instead of its keys. ``split`` receives the seconds of each step
    (by the function that runs it)."""
    from functional_ckpt._src import codec
    from functional_ckpt._src.format import dcp_metadata, naming
    from functional_ckpt._src.format.checksum import crc32
    from functional_ckpt._src.format.manifest import Tree, Written, assemble
    from functional_ckpt._src.save import exchange, local, multi_rank, splice

    times = split if split is not None else {}
    last = [time.process_time()]

    def lap(step: str) -> None:
        now = time.process_time()
        times[step] = times.get(step, 0.0) + now - last[0]
        last[0] = now

    plan = world.plan
    cache = world.plans
    payloads = world.payloads_again if again else world.payloads
    failures, ranks, _ = multi_rank.coordinate(payloads, plan.local, cache)
    assert not failures
    lap("multi_rank.coordinate (decode, dedup)")
    sent = []
    for r, data in enumerate(world.written_again if again else world.written):
        sent.append(exchange.parse_written(data, r)[1])
    lap("exchange.parse_written")
    tree = Tree(plan.entries, ranks, plan.root)
    chunks, sizes, spliced = splice.merge(cache, sent, tree, world.blobs, False)
    lap("splice.merge (the parts' rows)")
    meta = {"note": "scale"}
    manifest = assemble(
        tree,
        Written(chunks, world.blobs, spliced=spliced),
        {},
        created=0.0,
        metadata=meta,
        metadata_bytes=codec.encode(meta),
    )
    lap("manifest.assemble")
    md = spliced.dcp or dcp_metadata.derive(manifest.tensor_groups(), manifest.dcp_bytes)
    spliced.dcp = md
    lap("dcp_metadata.derive (.metadata)")
    files: dict[str, dict[str, Any]] = {naming.DCP_METADATA: {"size": len(md), "crc32": crc32(md)}}
    files.update({name: {"size": size} for name, size in sorted(sizes.items())})
    manifest = replace(manifest, files=files)
    parts = local.encode_parts(manifest, Path("ckpt"))  # each lists its rank's files
    lap("local.encode_parts")
    index = manifest.encode()
    lap("Manifest.encode (index)")
    return index, [data for _, data in parts], md


def dcp_global(world: World, planner_type: Any = None) -> tuple[list[Any], Any]:
    """DCP's coordinator planning (dedup, global plan, metadata, validation)."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    planner = (planner_type or DefaultSavePlanner)()
    return planner.create_global_plan(list(world.dcp_plans))  # type: ignore[no-any-return]


def dcp_coordinator(
    world: World, tmp: Path, split: dict[str, float] | None = None
) -> tuple[bytes, list[Any], Any]:
    """Stock DCP's coordinator: global planning, then the ``.metadata`` its writer
    pickles; with the global plans and ``Metadata`` (what DCP sends back to the ranks).
    ``split`` receives the seconds of each."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    t0 = time.process_time()
    plans, metadata = dcp_global(world)
    t1 = time.process_time()
    tmp.mkdir(parents=True, exist_ok=True)
    writer = FileSystemWriter(tmp, sync_files=False)
    writer.finish(metadata, world.dcp_results)
    if split is not None:
        split["DefaultSavePlanner.create_global_plan"] = t1 - t0
        split["FileSystemWriter.finish (.metadata)"] = time.process_time() - t1
    return (tmp / ".metadata").read_bytes(), plans, metadata


def _local_chunks(world: World, rank: int) -> dict[str, Any]:
    """What one rank's DTensor templates ask for: its own shard of every sharded tensor."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    n = world.n
    out = {}
    for t in world.plan.targets:
        if t.path[0] in PER_RANK:
            continue
        if _sharded(t, n):
            rows = t.shape[0] // n
            out[t.fqn] = ChunkStorageMetadata(
                offsets=torch.Size((rank * rows, *([0] * (len(t.shape) - 1)))),
                sizes=torch.Size((rows, *t.shape[1:])),
            )
        else:
            out[t.fqn] = ChunkStorageMetadata(
                offsets=torch.Size([0] * len(t.shape)), sizes=torch.Size(t.shape)
            )
    return out


def fc_restore(
    index: bytes,
    parts: Sequence[bytes],
    wanted: dict[str, Any],
    rank: int,
    opened: set[str] | None = None,
) -> int:
    """One rank's restore planning: decode and validate the index, its view, the parts
    its shards meet (authenticated, decoded, validated), DCP's read items. ``opened``
    receives the files it reads: the parts read, the data files of the chunks its
    shards meet (``committed.Checkpoint`` opens exactly these, with the marker and
    the index; tests/test_open_files.py counts them on real files)."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    from functional_ckpt._src import codec
    from functional_ckpt._src.format import dcp_metadata, naming
    from functional_ckpt._src.format.view import parse_checkpoint
    from functional_ckpt._src.restore.dtensor import parts_meeting

    manifest = codec.decode(index, source="manifest")
    assert isinstance(manifest, dict)

    def load(r: int) -> Any:  # what storage/committed.read_part does, from memory
        raw = parts[r]
        if opened is not None:
            opened.add(naming.part_name(r))
        assert zlib.crc32(raw[:-4]) == int.from_bytes(raw[-4:], "little")  # it checks itself
        return codec.decode(raw[:-4], source=naming.part_name(r))

    once = parse_checkpoint(manifest, Path("ckpt"), parts=load if parts else None)
    view = once.view(rank, parts=())
    path_of = {e.fqn: p for p, e in view.tensors.items()}
    boxes = [(path_of[fqn], (tuple(c.offsets), tuple(c.sizes))) for fqn, c in wanted.items()]
    view = once.filled(view, parts_meeting(view, boxes))
    md = dcp_metadata.metadata_for([list(view.tensors.values())])
    reads = 0
    for fqn, chunk in wanted.items():
        items = create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn], [chunk])
        reads += len(items)
        if opened is not None:
            chunks = view.tensors[path_of[fqn]].chunks
            opened.update(chunks[it.storage_index.index].file for it in items)
    return reads


def restore_on_disk(
    index: bytes, parts: Sequence[bytes], wanted: dict[str, Any], rank: int, where: Path
) -> dict[str, int]:
    """One rank's restore opening real files: the files it opens, the bytes it reads
    besides its tensors' and the most descriptors it holds at once, counted at
    ``os.open``/``os.close``/``os.pread``/``os.read``.

    ``where`` gets the checkpoint with its marker, index and parts as written and
    every other file (shard files, ``.metadata``) sparse at its recorded size. The
    rank opens it as ``fc.restore`` does (``committed.open_checkpoint``, its view, the
    parts its shards meet through ``read_part``) and then each data file holding a
    chunk it reads, in file order, through ``Checkpoint.fd`` and ``release``: the
    reads themselves are left out (the blobs are not real).
    """
    import os

    from functional_ckpt._src import codec
    from functional_ckpt._src.format import naming
    from functional_ckpt._src.restore.dtensor import parts_meeting
    from functional_ckpt._src.storage import commit, committed

    where.mkdir(parents=True)
    files = dict(codec.decode(index)["files"])
    for r, data in enumerate(parts):  # each part lists its rank's files (CRC32 after it)
        (where / naming.part_name(r)).write_bytes(data)
        files.update(codec.decode(data[:-4])["files"])
    for name, info in files.items():
        with open(where / name, "wb") as f:
            f.truncate(info["size"])
    (where / naming.MANIFEST).write_bytes(index)
    commit.write_commit_marker(where, index, version=codec.decode(index)["version"], sync=False)
    data: set[str] = set()
    fc_restore(index, parts, wanted, rank, data)  # the files its reads plan
    count = {"rank_files_opened": 0, "rank_bytes_read": 0, "rank_peak_descriptors": 0}
    live: set[int] = set()
    real = os.open, os.close, os.pread, os.read

    def opened(*args: Any, **kw: Any) -> int:
        fd = real[0](*args, **kw)
        live.add(fd)
        count["rank_files_opened"] += 1
        count["rank_peak_descriptors"] = max(count["rank_peak_descriptors"], len(live))
        return fd

    def closed(fd: int) -> None:
        live.discard(fd)
        real[1](fd)

    def read(fd: int, n: int, *at: int) -> bytes:
        got = (real[2] if at else real[3])(fd, n, *at)
        count["rank_bytes_read"] += len(got)
        return got

    os.open, os.close = opened, closed  # type: ignore[assignment]
    os.pread, os.read = read, read  # type: ignore[assignment]
    try:
        with committed.open_checkpoint(where) as ck:
            once = committed.parsed(ck)
            view = once.view(rank, parts=())
            path_of = {e.fqn: p for p, e in view.tensors.items()}
            boxes = [(path_of[f], (tuple(c.offsets), tuple(c.sizes))) for f, c in wanted.items()]
            once.filled(view, parts_meeting(view, boxes))
            for name in sorted(n for n in data if naming.parse_part(n) is None):
                ck.fd(name)
                ck.release(name)
    finally:
        os.open, os.close, os.pread, os.read = real
    count["rank_files_opened"] -= 1  # the directory
    return count


def dcp_restore(metadata_bytes: bytes, wanted: dict[str, Any]) -> int:
    """Stock DCP's load on one rank: ``.metadata`` unpickled, then its read items."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    md = pickle.loads(metadata_bytes)
    reads = 0
    for fqn, chunk in wanted.items():
        reads += len(create_read_items_for_chunk_list(fqn, md.state_dict_metadata[fqn], [chunk]))
    return reads


# --------------------------------------------------------------------------- sockets

#: gloo's algorithms on a checkpoint group, as measured on 8 and 16 ranks: all_gather and
#: all_reduce pass around a ring, broadcast (from the coordinator) runs down a binomial
#: tree, gather and scatter are a star on the coordinator. A group that saves runs all
#: three; one that only agrees (the remote tier's uploads) the ring.
SAVING, AGREEING = ("ring", "tree", "star"), ("ring",)


def gloo_peers(algorithm: str, rank: int, n: int) -> set[int]:
    """The ranks that ``rank`` exchanges with in one of gloo's algorithms rooted at 0."""
    if algorithm == "ring":
        return {(rank - 1) % n, (rank + 1) % n} - {rank}
    if algorithm == "star":
        return set(range(1, n)) if rank == 0 else {0}
    # a binomial tree: the parent clears the highest bit, the children add a higher one
    parent = {rank - (1 << (rank.bit_length() - 1))} if rank else set()
    bits = range(rank.bit_length(), n.bit_length())
    return parent | {rank + (1 << k) for k in bits if rank + (1 << k) < n}


def group_sockets(algorithms: Sequence[str], rank: int, n: int) -> int:
    """The sockets ``rank`` holds for one group whose pairs connect at their first message:
    its listening socket and one per peer its algorithms reach (``n`` when every pair is
    connected as the group is made)."""
    return 1 + len(set().union(*(gloo_peers(a, rank, n) for a in algorithms)))


def manager_sockets(rank: int, n: int) -> int:
    """A manager's sockets with synchronous saves and a remote tier: ``control`` saves,
    ``upload`` agrees (what ``tests/descriptors_job.py`` holds)."""
    return group_sockets(SAVING, rank, n) + group_sockets(AGREEING, rank, n)


def socket_row(n: int, held: Sequence[int] | None = None) -> dict[str, Any]:
    """The coordinator's sockets, the most and the mean of any other rank: every rank's
    ``held``, else :func:`manager_sockets` with every rank's if every pair connected as the
    group was made (``eager``)."""
    eager = None if held else 2 * n
    held = held or [manager_sockets(r, n) for r in range(n)]
    return {"ranks": n, "coordinator": held[0], "other_most": max(held[1:]),
            "other_mean": sum(held[1:]) / (n - 1), "eager": eager}  # fmt: skip


def measure_sockets(n: int, tmp: Path) -> list[int]:
    """Every rank's sockets, measured: ``n`` real gloo ranks open a manager with a remote
    tier, save and restore (``tests/descriptors_job.py``, the same as :func:`manager_sockets`)."""
    from tests.test_dist import launch, wait_all

    job, out = REPO_ROOT / "tests" / "descriptors_job.py", tmp / "held"
    url = (tmp / "bucket").as_uri()
    lazy = {"TORCH_GLOO_LAZY_INIT": "1"}
    for rc, _, err in wait_all(launch(n, str(tmp / "root"), str(out), url, job=job, env=lazy)):
        if rc:
            raise RuntimeError(f"a rank of {job.name} failed: {err[-2000:]}")
    return [json.loads(Path(f"{out}.{r}.json").read_text())["socket"] for r in range(n)]


# --------------------------------------------------------------------------- bytes


@dataclass
class Traffic:
    """Bytes one rank sends and receives, by the helpers' accounting: an input tensor
    counts as sent, every output tensor it fills as received (its own slot included)."""

    sent: int = 0
    received: int = 0

    def add(self, sent: int, received: int) -> None:
        self.sent += sent
        self.received += received

    def as_dict(self) -> dict[str, int]:
        return {"sent": self.sent, "received": self.received}


def predict_helpers(world: World, dest: str, nbytes: int) -> list[Traffic]:
    """:func:`helper_traffic` of the simulated ranks' save to a checkpoint named
    ``dest`` of ``nbytes`` bytes: every message built by the functions ``fc.save``
    builds it with.

    The coordinator's first message is its directory name, what ``durable.tmp_sibling``
    makes of ``dest``, with the arguments of ``fc.save(dest, state)``; the
    coordinator's replies are what its step makes of the payloads (with no plan
    cached: a first save).
    """
    from functional_ckpt._src.distributed.topology import topology
    from functional_ckpt._src.save import exchange, multi_rank
    from functional_ckpt._src.save.job import SaveJob
    from functional_ckpt._src.save.options import SaveOptions
    from functional_ckpt._src.storage import durable

    job = SaveJob(Path(dest), None, SaveOptions(), topology(), True)
    name = len(exchange.first_round(durable.tmp_sibling(Path(dest)).name, job))
    _, _, drops = multi_rank.coordinate(world.payloads, world.plan.local, exchange.PlanCache())
    replies = [len(exchange.reply({}, None if d is None else list(d))) for d in drops]
    written = [len(exchange.written_payload(r)) for r in world.results]
    final = len(exchange.reply({}, nbytes))
    return helper_traffic(world.n, [len(p) for p in world.payloads], name, replies, written, final)


def helper_traffic(
    n: int,
    payloads: Sequence[int],
    tmp_name: int,
    replies: Sequence[int],
    written: Sequence[int],
    final: int,
) -> list[Traffic]:
    """What ``multi_rank.save_planned`` moves through ``distributed/groups`` on each rank.

    Two agreements (one 8-byte maximum each when every rank succeeds), the
    coordinator's directory name broadcast; every rank's entries and item keys
    gathered on the coordinator, its drops scattered back, its written chunks
    gathered, the coordinator's verdict broadcast (each gather and scatter padded
    to the longest message, whose length every rank learns first).
    """
    out = [Traffic() for _ in range(n)]
    for r, t in enumerate(out):
        for _ in range(2):  # agree: the longest report (0)
            t.add(8, 8)
        for size in (tmp_name, final):  # broadcast: length, then bytes
            t.add(8 + size, 0) if r == 0 else t.add(0, 8 + size)
        for sizes in (payloads, written):  # gather: the longest, then each padded
            longest = max(sizes)
            t.add(8, 8)
            t.add(8 + longest, n * (8 + longest) if r == 0 else 0)
        longest = max(replies)  # scatter: the longest (broadcast), then one each
        t.add(8, 0) if r == 0 else t.add(0, 8)
        t.add(n * (8 + longest) if r == 0 else 0, 8 + longest)
    return out


def helper_traffic_dcp_save(
    n: int, payloads: Sequence[int], tmp_name: int, nbytes_text: int
) -> list[Traffic]:
    """The helpers' share of the same save as it was, around ``dcp.save`` (whose own
    collectives :func:`dcp_traffic` counts): two agreements, the directory name and
    the size broadcast, the entries gathered."""
    out = [Traffic() for _ in range(n)]
    longest = max(payloads)
    for r, t in enumerate(out):
        for _ in range(2):
            t.add(8, 8)
        for size in (tmp_name, nbytes_text):
            t.add(8 + size, 0) if r == 0 else t.add(0, 8 + size)
        t.add(8, 8)
        t.add(8 + longest, n * (8 + longest) if r == 0 else 0)
    return out


def _pickled(obj: Any) -> int:
    return len(pickle.dumps(obj))


def dcp_traffic(world: World, global_plans: Sequence[Any], broadcast: Any) -> list[Traffic]:
    """DCP's own object collectives in a save (``_DistWrapper``): local plans gathered
    (sizes all-gathered first), global plans scattered, write results gathered, the
    finish step's result (the global ``Metadata``) broadcast."""
    n = world.n
    out = [Traffic() for _ in range(n)]
    plan_sizes = [_pickled(p) for p in world.dcp_plans]
    result_sizes = [_pickled(r) for r in world.dcp_results]
    scattered = max(_pickled(p) for p in global_plans)
    final = _pickled(broadcast)
    for sizes in (plan_sizes, result_sizes):  # gather_object
        longest = max(sizes)
        for r, t in enumerate(out):
            t.add(8, 8 * n)
            t.add(longest, n * longest if r == 0 else 0)
    for r, t in enumerate(out):  # scatter_object_list, broadcast_object_list
        if r == 0:
            t.add(8 + n * scattered + 8 * n + 8 + final, 0)
        else:
            t.add(0, 8 + scattered + 8 + 8 + final)
    return out


def summed(*parts: Sequence[Traffic]) -> list[Traffic]:
    out = [Traffic() for _ in parts[0]]
    for part in parts:
        for t, p in zip(out, part, strict=True):
            t.add(p.sent, p.received)
    return out


# --------------------------------------------------------------------------- measuring


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """``fn``'s time with the collector paused, as ``fc.save`` pauses it around a save."""
    gc.disable()
    try:
        t0 = time.process_time()
        out = fn()
        return time.process_time() - t0, out
    finally:
        gc.enable()


def peak(fn: Callable[[], Any]) -> int:
    """Peak bytes ``tracemalloc`` sees ``fn`` allocate above what was held before."""
    gc.disable()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
        gc.enable()


def measure_coordinator(model: Model, n: int) -> dict[str, Any]:
    """The coordinator's first save and a save of the same layout, by function."""
    world = simulate(model, n)  # a first save: no plan cached
    split: dict[str, dict[str, float]] = {"first": {}, "again": {}}
    first_s, _ = timed(lambda: fc_coordinator(world, False, split["first"]))
    again_s, _ = timed(lambda: fc_coordinator(world, True, split["again"]))
    chunks = sum(len(r) for r in world.results)
    return {"ranks": n, "chunks": chunks, "fc_coordinator_s": first_s,
            "fc_coordinator_again_s": again_s, "coordinator_split_s": split}  # fmt: skip


def measure(model: Model, n: int, tmp: Path, memory: bool) -> dict[str, Any]:
    """Every phase of one world size: times, sizes, predicted bytes, peaks (``memory``)."""
    from torch.distributed.checkpoint.metadata import Metadata

    from functional_ckpt._src import codec
    from functional_ckpt._src.format import dcp_metadata, naming

    dcp_metadata._derived.cache_clear()  # a first save: nothing derived yet, no plan cached
    world = simulate(model, n)
    split: dict[str, dict[str, float]] = {"first": {}, "again": {}, "dcp": {}}
    fc_s, (manifest, parts, md) = timed(lambda: fc_coordinator(world, False, split["first"]))
    # the same layout again
    fc_again_s, _ = timed(lambda: fc_coordinator(world, True, split["again"]))
    dcp_s, (dcp_md, plans, stock_md) = timed(lambda: dcp_coordinator(world, tmp, split["dcp"]))
    rank = 1 % n
    wanted = _local_chunks(world, rank)
    fc_restore_s, fc_reads = timed(lambda: fc_restore(manifest, parts, wanted, rank))
    dcp_restore_s, dcp_reads = timed(lambda: dcp_restore(dcp_md, wanted))
    assert fc_reads == dcp_reads, (fc_reads, dcp_reads)
    opened: set[str] = set()  # besides the marker and the index
    fc_restore(manifest, parts, wanted, rank, opened)
    read = [parts[r] for r in map(naming.parse_part, opened) if r is not None]
    marker = len(  # the commit marker's bytes (commit.write_commit_marker)
        codec.encode(
            {
                "format": naming.FORMAT_NAME,
                "version": naming.PARTS_VERSION,
                "manifest_size": len(manifest),
                "manifest_crc32": zlib.crc32(manifest),
            }
        )
    )

    def decode_all() -> list[Any]:  # the whole manifest decoded: the index and every part
        return [codec.decode(manifest), *(codec.decode(p[:-4]) for p in parts)]

    decode_s, _ = timed(decode_all)
    row: dict[str, Any] = {
        "ranks": n,
        "tensors": len(world.plan.targets),
        "chunks": sum(len(r) for r in world.results),
        "manifest_bytes": len(manifest),
        "parts_bytes": sum(len(p) for p in parts),
        "largest_part_bytes": max((len(p) for p in parts), default=0),
        "fc_metadata_bytes": len(md),
        "dcp_metadata_bytes": len(dcp_md),
        "fc_rank_plan_s": world.plan_s,
        "fc_coordinator_s": fc_s,
        "fc_coordinator_again_s": fc_again_s,
        "dcp_coordinator_s": dcp_s,
        "fc_restore_rank_s": fc_restore_s,
        "dcp_restore_rank_s": dcp_restore_s,
        "manifest_decode_s": decode_s,
        "coordinator_split_s": split,
        # what one restoring rank opens and reads besides its tensors' bytes, and the
        # most descriptors it holds, on real files
        **restore_on_disk(manifest, parts, wanted, rank, tmp.parent / f"fc{n}"),
        # before: every file opened (every part and data file, .metadata), .metadata read
        "rank_files_opened_before": 3 + len(parts) + n,
        "rank_bytes_read_before": marker + len(manifest) + sum(map(len, read)) + len(md),
    }
    on_disk = len(manifest) + sum(len(p) for p in parts)
    nbytes = on_disk + sum(c.length for r in world.results for _, c in r)
    ours = predict_helpers(world, "checkpoint", nbytes)
    lens = [len(p) for p in world.payloads]
    name = len(b"checkpoint.tmp-0123456789abcdef")
    before = summed(
        helper_traffic_dcp_save(n, lens, name, len(str(nbytes))),
        dcp_traffic(world, plans, Metadata(state_dict_metadata={})),
    )
    stock = dcp_traffic(world, plans, stock_md)
    row["bytes"] = {
        "fc": {"coordinator": ours[0].as_dict(), "other": ours[-1].as_dict()},
        "fc_over_dcp_save": {"coordinator": before[0].as_dict(), "other": before[-1].as_dict()},
        "dcp": {"coordinator": stock[0].as_dict(), "other": stock[-1].as_dict()},
    }
    row["payload_bytes"] = lens[:2]
    if memory:
        row["fc_restore_rank_peak"] = peak(lambda: fc_restore(manifest, parts, wanted, rank))
        row["dcp_restore_rank_peak"] = peak(lambda: dcp_restore(dcp_md, wanted))
        row["manifest_decoded_peak"] = peak(decode_all)
        row["fc_coordinator_peak"] = peak(lambda: fc_coordinator(world, again=True))
        row["dcp_coordinator_peak"] = peak(lambda: dcp_coordinator(world, tmp))
    return row


# --------------------------------------------------------------------------- report


def _kib(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / MiB:.1f} MiB" if n >= 10 * MiB else f"{n / 1024:.1f} KiB"


def targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {r["ranks"]: r for r in rows}
    out: list[dict[str, Any]] = []

    def add(name: str, value: float | None, limit: float, unit: str = "") -> None:
        t: dict[str, Any] = {"target": name, "value": value, "limit": limit}
        t["result"] = verdict(value, limit)
        if unit:
            t["unit"] = unit
        out.append(t)

    lo, hi = by.get(256), by.get(4096)
    add(
        "coordinator time N=4096 / N=256",
        ratio(hi["fc_coordinator_s"], lo["fc_coordinator_s"]) if lo and hi else None,
        20.0,
    )
    add(
        "coordinator bytes received N=4096 / N=256",
        ratio(
            hi["bytes"]["fc"]["coordinator"]["received"],
            lo["bytes"]["fc"]["coordinator"]["received"],
        )
        if lo and hi
        else None,
        20.0,
    )
    first, last = rows[0], rows[-1]
    add(
        f"other rank's bytes received in a save, N={last['ranks']} / N={first['ranks']}",
        ratio(
            last["bytes"]["fc"]["other"]["received"],
            first["bytes"]["fc"]["other"]["received"],
        ),
        1.0,
    )
    k = by.get(1024)
    add(
        "coordinator time / DCP planning+metadata, N=1024",
        ratio(k["fc_coordinator_s"], k["dcp_coordinator_s"]) if k else None,
        0.3,
    )
    add(
        "one rank's restore planning / DCP's, N=1024",
        ratio(k["fc_restore_rank_s"], k["dcp_restore_rank_s"]) if k else None,
        0.3,
    )
    add("one rank's restore planning, N=1024", k["fc_restore_rank_s"] if k else None, 1.0, "s")
    add(
        "restore peak memory / decoded manifest, N=1024",
        ratio(k.get("fc_restore_rank_peak"), k.get("manifest_decoded_peak")) if k else None,
        0.2,
    )
    add(
        f"second save's coordinator / first, N={last['ranks']}",
        ratio(last["fc_coordinator_again_s"], last["fc_coordinator_s"]),
        0.3,
    )
    for what in ("files_opened", "bytes_read"):
        add(
            f"a restoring rank's {what.replace('_', ' ')} (no tensor bytes), N=4096 / N=256",
            ratio(hi[f"rank_{what}"], lo[f"rank_{what}"]) if lo and hi else None,
            1.25,
        )
    add(
        "one rank's restore CPU, N=4096 / N=256",
        ratio(hi["fc_restore_rank_s"], lo["fc_restore_rank_s"]) if lo and hi else None,
        1.5,
    )
    add(
        "coordinator's first save / DCP planning+metadata, N=4096",
        ratio(hi["fc_coordinator_s"], hi["dcp_coordinator_s"]) if hi else None,
        0.5,
    )
    return out


def render(result: dict[str, Any]) -> str:
    cfg = result["config"]
    head = (
        f"coordination at scale (simulated ranks, one process): {cfg['layers']}-layer decoder"
        f"{' (llama-like)' if cfg.get('full') else ''}, {result['rows'][0]['tensors']} tensors "
        "with AdamW state; times of one run"
    )
    t1 = Table(
        ["ranks", "chunks", "index", "parts", ".metadata", "coord fc", "coord again", "coord dcp",
         "fc/dcp", "restore fc", "restore dcp", "fc/dcp", "peak fc", "peak dcp", "decoded"]
    )  # fmt: skip
    for r in result["rows"]:
        t1.add(
            r["ranks"],
            r["chunks"],
            _kib(r["manifest_bytes"]),
            _kib(r["parts_bytes"]),
            _kib(r["fc_metadata_bytes"]),
            fmt_seconds(r["fc_coordinator_s"]),
            fmt_seconds(r["fc_coordinator_again_s"]),
            fmt_seconds(r["dcp_coordinator_s"]),
            fmt_ratio(ratio(r["fc_coordinator_s"], r["dcp_coordinator_s"])),
            fmt_seconds(r["fc_restore_rank_s"]),
            fmt_seconds(r["dcp_restore_rank_s"]),
            fmt_ratio(ratio(r["fc_restore_rank_s"], r["dcp_restore_rank_s"])),
            _kib(r.get("fc_restore_rank_peak")),
            _kib(r.get("dcp_restore_rank_peak")),
            _kib(r.get("manifest_decoded_peak")),
        )
    t2 = Table(
        ["ranks", "fc: coord recv", "other recv", "as it was (dcp.save): coord recv",
         "other recv", "dcp: coord recv", "other recv"]
    )  # fmt: skip
    for r in result["rows"]:
        b = r["bytes"]
        t2.add(
            r["ranks"],
            _kib(b["fc"]["coordinator"]["received"]),
            _kib(b["fc"]["other"]["received"]),
            _kib(b["fc_over_dcp_save"]["coordinator"]["received"]),
            _kib(b["fc_over_dcp_save"]["other"]["received"]),
            _kib(b["dcp"]["coordinator"]["received"]),
            _kib(b["dcp"]["other"]["received"]),
        )
    t3 = Table(["ranks", "files opened", "before", "bytes read", "before", "peak fds"])
    for r in result["rows"]:
        t3.add(
            r["ranks"],
            r["rank_files_opened"],
            r["rank_files_opened_before"],
            _kib(r["rank_bytes_read"]),
            _kib(r["rank_bytes_read_before"]),
            r["rank_peak_descriptors"],
        )
    last = result["rows"][-1]
    split = last["coordinator_split_s"]
    t4 = Table(["step (function)", "first save", "again"])
    for step, first in split["first"].items():
        t4.add(step, fmt_seconds(first), fmt_seconds(split["again"].get(step)))
    for step, took in split["dcp"].items():
        t4.add(f"stock DCP: {step}", fmt_seconds(took), "-")
    return "\n".join(
        [head, "", t1.render(), "", "bytes received in one save", t2.render(), "",
         "one restoring rank: files it opens and what it reads of them, besides its "
         "tensors' bytes (before: every file opened, .metadata read whole), on real files",
         t3.render(), "", f"the coordinator's time by function, N={last['ranks']}", t4.render(),
         "", render_targets(result["targets"])]
    )  # fmt: skip


def sockets(args: argparse.Namespace) -> dict[str, Any]:
    """:func:`manager_sockets` at each N, and measured on 8 real ranks against it."""
    import tempfile

    rows = [socket_row(n) for n in sorted({8, *args.ranks})]
    with tempfile.TemporaryDirectory(dir=args.dir if args.dir.exists() else None) as d:
        held = measure_sockets(8, Path(d))
    measured = socket_row(8, held)
    table = Table(["ranks", "coordinator", "other: most", "other: mean", "whole mesh (default)"])
    for r in [*rows, {**measured, "ranks": "8, measured"}]:
        table.add(r["ranks"], r["coordinator"], r["other_most"], f"{r['other_mean']:.1f}",
                  r["eager"] or "-")  # fmt: skip
    over = max(h / manager_sockets(r, 8) for r, h in enumerate(held))
    lo, hi = socket_row(256), socket_row(4096)
    found = [
        ("a rank's sockets measured / predicted, 8 ranks (most)", over, 1.0),
        ("another rank's most sockets, N=4096 / N=256", hi["other_most"] / lo["other_most"], 1.5),
    ]
    result = [
        {"target": t, "value": v, "limit": lim, "result": verdict(v, lim)} for t, v, lim in found
    ]
    print("sockets a rank holds for a manager with synchronous saves and a remote tier "
          "(two groups), pairs connected at their first message (TORCH_GLOO_LAZY_INIT=1)",
          table.render(), "", render_targets(result), sep="\n")  # fmt: skip
    return {"rows": [*rows, measured], "targets": result}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help=f"N in {QUICK_RANKS}, 2 layers")
    p.add_argument(
        "--full",
        action="store_true",
        help=f"the llama-like layout (32 layers of 8 weights) at N in {FULL_RANKS}",
    )
    p.add_argument("--ranks", type=str, default=None, help="comma-separated world sizes")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 4)")
    p.add_argument(
        "--memory-up-to",
        type=int,
        default=None,
        help="measure peak memory (tracemalloc, slow) up to this many ranks (default 256; "
        "none with --full)",
    )
    p.add_argument(
        "--coordinator",
        action="store_true",
        help="only the coordinator's first save and a save of the same layout, by function",
    )
    p.add_argument(
        "--sockets",
        action="store_true",
        help="the sockets a rank holds for its checkpoint groups: predicted, and on 8 real ranks",
    )
    add_run_args(p, "scale", strict="a target")
    args = p.parse_args(argv)
    if args.ranks:
        args.ranks = tuple(int(x) for x in args.ranks.split(","))
    else:
        args.ranks = QUICK_RANKS if args.quick else FULL_RANKS if args.full else DEFAULT_RANKS
    if args.layers is None:
        args.layers = 2 if args.quick else LLAMA["layers"] if args.full else 4
    if args.memory_up_to is None:
        args.memory_up_to = 0 if args.full else 256
    if any(n < 1 or 4096 % n for n in args.ranks):
        p.error("--ranks: each world size must divide 4096")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    import tempfile

    args = parse_args(argv)
    if args.sockets:
        return finish(args, {"benchmark": "scale", "environment": environment(), **sockets(args)})
    model = Model(**{**(LLAMA if args.full else {}), "layers": args.layers})
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir if args.dir.exists() else None) as d:
        for n in args.ranks:
            t0 = time.process_time()
            if args.coordinator:
                rows.append(measure_coordinator(model, n))
            else:
                rows.append(measure(model, n, Path(d) / f"dcp{n}", memory=n <= args.memory_up_to))
            gc.collect()
            print(f"N={n}: {time.process_time() - t0:.1f} s", file=sys.stderr, flush=True)
    result = {
        "benchmark": "scale",
        "config": {
            "layers": args.layers,
            "norms": model.norms,
            "ranks": list(args.ranks),
            "quick": args.quick,
            "full": args.full,
        },
        "environment": environment(),
        "rows": rows,
    }
    if args.coordinator:
        result["targets"] = []
        print(json.dumps(rows, indent=1))
        return finish(args, result)
    result["targets"] = targets(rows)
    print(render(result))
    return finish(args, result)


if __name__ == "__main__":
    raise SystemExit(main())
