"""The coordinator's plan cache: a layout saved again is not planned again, and a
plan is reused only for the world and the layout it was made for.

The local plans are the ones DCP's planner makes of benchmarks/scale.py's state on
every simulated rank (the same plans whose keys the coordinator of a real save
receives).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format.manifest import Tree
from functional_ckpt._src.save import dedup, exchange, multi_rank, splice, staging
from tests import prefork

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scale

MODEL = scale.Model(layers=1, hidden=64, mlp=128, vocab=256)
Keys = tuple[dedup.ItemKey, ...]


class Counting:
    """The coordinator's deduplication, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, plans: Sequence[Sequence[dedup.ItemKey]]) -> list[dedup.Drops]:
        self.calls += 1
        return dedup.dedup_keys(plans)


def owners(keys: Sequence[Keys], drops: Sequence[dedup.Drops]) -> list[set[str]]:
    """The names each rank writes: its keys without its drops."""
    return [
        {k[0] for i, k in enumerate(ks) if i not in set(d)}
        for ks, d in zip(keys, drops, strict=True)
    ]


def local_keys(n: int, model: scale.Model = MODEL) -> list[Keys | None]:
    return [dedup.item_keys(p) for p in scale.simulate(model, n).dcp_plans]


def test_a_layout_saved_again_is_not_planned_again() -> None:
    cache, count = exchange.PlanCache(), Counting()
    first = exchange.global_step(cache, local_keys(4), count)
    assert count.calls == 1 and all(d is not None for d in first)  # each told its drops
    again = exchange.global_step(cache, [None] * 4, count)
    assert count.calls == 1  # every rank said "unchanged": nothing planned
    assert again == [None] * 4  # every rank writes its last plan


def test_a_rank_whose_layout_changed_is_planned_again_with_the_others() -> None:
    cache, count = exchange.PlanCache(), Counting()
    first = local_keys(4)
    exchange.global_step(cache, first, count)
    other = local_keys(4, scale.Model(layers=2, hidden=64, mlp=128, vocab=256))
    changed = [None, other[1], None, None]  # rank 1 has new keys
    delta = exchange.global_step(cache, changed, count)
    assert count.calls == 2
    merged = [first[0], other[1], first[2], first[3]]  # the cached keys, rank 1's new ones
    assert cache.keys == merged and cache.drops is not None
    written = owners(merged, cache.drops)  # type: ignore[arg-type]
    assert set().union(*written) == {k[0] for ks in merged for k in ks or ()}
    assert any("layer1" in fqn for fqn in written[1])  # its new keys are planned
    assert delta[1] is not None  # the rank whose plan changed is sent its drops


class Group:
    """A stand-in for a checkpoint group (held weakly, as torch's are)."""


def plans(group: Any) -> exchange.PlanCache:
    return staging.plans(group, exchange.PlanCache)


def test_a_plan_is_never_reused_by_another_world() -> None:
    """Each checkpoint group holds its own plans (another world, other ranks, the memory
    tier's group of the same ranks: another group)."""
    four, three, other, memory = Group(), Group(), Group(), Group()
    count = Counting()
    exchange.global_step(plans(four), local_keys(4), count)
    assert plans(four) is plans(four)
    assert plans(three) is not plans(four)
    assert plans(other) is not plans(four)
    # the memory tier's group of the same ranks keeps plans of its own
    assert plans(memory) is not plans(four)
    for group, n in ((three, 3), (four, 3)):
        with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
            exchange.global_step(plans(group), [None] * n, count)
    assert count.calls == 1


def test_a_failed_save_forgets_its_plans() -> None:
    """After "does not hold", every rank drops its plans: the next save plans afresh."""
    group, count = Group(), Counting()
    with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
        exchange.global_step(plans(group), [None] * 4, count)
    exchange.global_step(plans(group), local_keys(4), count)
    plans(group).local = scale.simulate(MODEL, 4).dcp_plans[0]  # what a rank keeps
    staging.forget(group)
    assert group not in staging._PLANS
    with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
        exchange.global_step(plans(group), [None] * 4, count)
    held = len(staging._PLANS)
    del group  # a group torch dropped takes its plans along
    assert len(staging._PLANS) == held - 1


_GROUPS_JOB = """
import sys
import torch.distributed as dist
from functional_ckpt._src.distributed.groups import checkpoint_group
from functional_ckpt._src.save import staging
from functional_ckpt._src.save.exchange import PlanCache

def plans(group):
    return staging.plans(group, PlanCache)

def init(name):
    dist.init_process_group(
        "gloo", store=dist.FileStore(sys.argv[1] + name, 1), rank=0, world_size=1
    )

init("/one")
save, memory = checkpoint_group(), checkpoint_group(purpose="memory")
plans(save).keys = [()]
assert plans(checkpoint_group()) is plans(save)  # found again
assert memory is not save and plans(memory).keys is None
dist.destroy_process_group()
init("/two")
assert plans(checkpoint_group()).keys is None  # a new job plans afresh
print("ok")
"""


def test_real_checkpoint_groups_hold_their_own_plans(tmp_path: Path) -> None:
    """On gloo groups: a group found again holds its plans, the memory tier's group of
    the same ranks holds others, and a re-initialized job holds none."""
    import os

    (tmp_path / "job.py").write_text(_GROUPS_JOB)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    done = prefork.run(
        [sys.executable, str(tmp_path / "job.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_keys_and_results_travel_and_bad_ones_name_the_rank() -> None:
    """What a rank sends is read back exactly; anything else fails naming the rank."""
    from functional_ckpt._src.format.manifest import Chunk

    keys = local_keys(2)[1]
    assert keys is not None
    assert exchange.parse_keys(exchange.keys_payload(keys), 1) == keys
    assert exchange.parse_keys(None, 1) is None
    for bad in ([["w", [0], -1]], [["w", [-1], 4]], [[1, None, 4]], "x", [["w", None]]):
        with pytest.raises(fc.errors.CheckpointError, match="rank 3 sent an invalid"):
            exchange.parse_keys(bad, 3)
    written = [("w", Chunk((0, 4), (2, 4), "__1_0.distcp", 0, 96, 64, 32, 7, 9))]

    def chunks(sent: exchange.Sent | None) -> list[tuple[str, Chunk]]:
        assert sent is not None and sent.boxes is not None
        rows = zip(sent.boxes, sent.table.tolist(), strict=True)
        return [(k, Chunk(o, s, sent.files[v[0]], *v[1:])) for (k, o, s), v in rows]

    assert chunks(exchange.parse_results(exchange.results_payload(written), 1)) == written
    report, sent, none = exchange.parse_written(exchange.written_payload(written), 1)
    assert (report, chunks(sent), none) == (b"", written, {})
    part = {"__1_0.distcp": 96, "__1_1.distcp": 8}  # the files of a part of its own
    assert exchange.parse_written(exchange.written_payload(written, part=part), 1)[2] == part
    for bad_part in ({"__0_0.distcp": 1}, {"../x": 1}, {"__1_0.distcp": -1}, ["__1_0.distcp"]):
        with pytest.raises(fc.errors.CheckpointError, match="rank 1 reported invalid files"):
            exchange.parse_written(codec.encode([b"", [[], b"", None], bad_part]), 1)
    with pytest.raises(fc.errors.CheckpointError, match="rank 4 reported invalid"):
        exchange.parse_written(b"\x92\xa1x\xc0", 4)  # ["x", None]: no report bytes
    files, numbers, boxes = exchange.results_payload(written)
    crc = bytearray(numbers)
    crc[5 * 8 + 4] = 1  # a CRC32 of 33 bits
    for bad_results in (
        [files, numbers[:-1], boxes],  # not whole integers
        [files, numbers, [["w", boxes[0][1][:-8]]]],  # a box of half a dimension
        [files, numbers[:8], boxes],  # fewer numbers than a chunk has
        [[3], numbers, boxes],
        [[], numbers, boxes],  # a chunk in a file it does not name
        [files, bytes(crc), boxes],
        [files, numbers, [["w"]]],
        [files, numbers, []],  # fewer boxes than chunks
        {"w": 1},
    ):
        with pytest.raises(fc.errors.CheckpointError, match="rank 5 reported invalid"):
            exchange.parse_results(bad_results, 5)
    assert exchange.parse_drops([0, 2], 3) == (0, 2)
    for bad_drops in ([3], [-1], ["0"], None):
        with pytest.raises(fc.errors.CheckpointError, match="coordinator sent an invalid"):
            exchange.parse_drops(bad_drops, 3)


def test_merged_results_give_each_file_its_largest_end_in_any_order() -> None:
    """Each rank's chunks arrive as a run of its own file, but any order merges the
    same: every key's chunks in arrival order, every file as long as its last blob."""
    from functional_ckpt._src.format.manifest import Chunk

    def c(file: str, offset: int, length: int, row: int) -> Chunk:
        return Chunk((row, 0), (1, 4), file, offset, length, offset + 8, 16, 1, 2)

    a, b = "__0_0.distcp", "__1_0.distcp"
    results = [("w", c(a, 0, 24, 0)), ("v", c(a, 24, 24, 0)), ("w", c(b, 0, 24, 1))]
    results += [("v", c(a, 48, 10, 1)), ("w", c(b, 24, 4, 2))]  # back to a, then b again
    sent = [exchange.parse_results(exchange.results_payload(results[:2]), 0)]
    sent.append(exchange.parse_results(exchange.results_payload(results[2:]), 1))
    sent.append(exchange.parse_results(exchange.results_payload([]), 2))
    tree = Tree((), ((), (), ()))
    chunks, sizes, _ = splice.merge(exchange.PlanCache(), sent, tree, (), False)
    assert sizes == {a: 58, b: 28, "__2_0.distcp": 0}
    assert [x.offsets for x in chunks["w"]] == [(0, 0), (1, 0), (2, 0)]
    assert [x.file for x in chunks["v"]] == [a, a]
    assert splice.merge(exchange.PlanCache(), sent, tree, (), True)[1] == {a: 58, b: 28}


def test_messages_that_cannot_be_read_fail_as_checkpoint_errors() -> None:
    """What a peer sends is checked before it is used: a report that is no bytes, a
    reply that is no list of (rank, report) pairs, a chunk outside a shard file."""
    from functional_ckpt._src import codec
    from functional_ckpt._src.format.manifest import Chunk

    ok = codec.encode([b"", [], []])
    for report in ("text", 7, [300], 10**3, True):
        with pytest.raises(fc.errors.CheckpointError, match="rank 1 sent an invalid"):
            multi_rank.coordinate(
                [ok, codec.encode([report, None, None])], (), exchange.PlanCache()
            )
    for told in ([[[1]], None], [[[1, "x"]], None], [[["a", b"x"]], None], [[[1, b""]], 3], "x"):
        with pytest.raises(fc.errors.CheckpointError, match="invalid reply"):
            exchange.parse_reply(codec.encode(told))
    with pytest.raises(fc.errors.CheckpointError, match="invalid reply"):
        exchange.parse_reply(b"\xc1")  # no msgpack at all
    assert exchange.parse_reply(exchange.reply({2: b"E\0m"}, None)) == ({2: b"E\0m"}, None)
    for name in ("../x", "/etc/passwd", "manifest.msgpack"):
        sent = exchange.results_payload([("w", Chunk((0,), (2,), name, 0, 9, 1, 8, 3, 4))])
        with pytest.raises(fc.errors.CheckpointError, match="not a shard file"):
            exchange.parse_results(sent, 2)


def test_a_failure_whose_message_cannot_be_made_is_still_reported() -> None:
    """A rank that cannot say why it failed would skip the next exchange and leave
    every other rank waiting out the timeout: its report is made anyway."""
    from functional_ckpt._src.distributed import groups

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise AttributeError("no message")

    told = groups.report(Unprintable())
    assert told.startswith(b"Unprintable\0") and b"could not be made" in told
    report, chunks, _ = exchange.parse_written(exchange.written_payload([], Unprintable()), 1)
    assert report.startswith(b"Unprintable\0") and chunks is None
    assert exchange.rank_payload(None, None, Unprintable())  # type: ignore[arg-type]


def test_the_first_round_carries_the_arguments_and_is_checked() -> None:
    """The coordinator's directory name and arguments, read back; anything else sent
    as them is the coordinator's invalid round, never a path to write under."""
    from functional_ckpt._src.distributed.topology import topology
    from functional_ckpt._src.save.job import SaveJob
    from functional_ckpt._src.save.options import SaveOptions

    job = SaveJob(Path("r/ck"), None, SaveOptions(base=Path("r/prev")), topology(), True)
    sent = exchange.first_round("ck.tmp-0123456789ab", job)
    name, args = exchange.parse_first_round(sent)
    assert name == "ck.tmp-0123456789ab" and args == exchange.arguments(job)
    assert args["path"] == "ck" and args["base"] == "prev" and args["staging"] is None
    assert exchange.parse_first_round(b"") == ("", None)
    assert exchange.disagreement(job, args, 1, "save r/ck") is None
    other = SaveJob(Path("elsewhere/ck"), None, SaveOptions(), topology(), True)
    told = exchange.disagreement(other, args, 1, "save elsewhere/ck")
    assert told is not None and "disagree on base: rank 0 passed 'prev', rank 1 None" in str(told)
    for bad in ("../ck.tmp-0123456789ab", "ck", 3):
        with pytest.raises(fc.errors.CheckpointError, match="invalid first round"):
            exchange.parse_first_round(codec.encode([bad, {}]))
    with pytest.raises(fc.errors.CheckpointError, match="invalid first round"):
        exchange.parse_first_round(b"\xff")
    sizes = {"__0_0.distcp": 4, "__1_0.distcp": 0, "__1_1.distcp": 8}
    present = {"__0_0.distcp"}.__contains__
    assert exchange.unreported(sizes, present, {"__1_1.distcp": 8}) == ["__1_0.distcp"]


def _saved_again(world: scale.World, renew: Any) -> tuple[bytes, list[bytes], bytes]:
    """The coordinator's files for a second save of ``world``'s layout whose chunks are
    ``renew(chunk)`` (every rank wrote its last plan: no boxes sent)."""
    new = [[(k, renew(c)) for k, c in r] for r in world.results]
    again = [exchange.written_payload(r, boxes=False) for r in new]
    return scale.fc_coordinator(dataclasses.replace(world, written_again=again), again=True)


def _saved_afresh(world: scale.World, renew: Any) -> tuple[bytes, list[bytes], bytes]:
    """The same chunks saved by a coordinator that holds no plan (every box sent)."""
    new = [exchange.written_payload([(k, renew(c)) for k, c in r]) for r in world.results]
    return scale.fc_coordinator(dataclasses.replace(world, written=new, plans=exchange.PlanCache()))


@pytest.mark.parametrize("change", ["checksums", "lengths"])
def test_a_save_of_the_layout_saved_last_writes_what_a_first_save_writes(
    change: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parts' rows packed from every rank's columns (no chunk made), and
    ``.metadata`` kept, are byte for byte what a coordinator holding no plan writes of
    the same chunks; a layout whose lengths changed (compressed chunks) is merged
    afresh, with the same result."""
    world = scale.simulate(MODEL, 4)
    firsts = Counting()
    real = splice._recipe
    monkeypatch.setattr(splice, "_recipe", lambda *a: (firsts.__call__([]), real(*a))[1])

    def renew(c: Any) -> Any:
        if change == "checksums":
            return c._replace(crc32=c.crc32 ^ 0xFFFF, hcrc32=(c.hcrc32 + 77) % 2**32)
        return c._replace(length=c.length + 8, zstd=1) if c.offsets[:1] == (0,) else c

    first = scale.fc_coordinator(world)
    again = _saved_again(world, renew)
    assert firsts.calls == (1 if change == "checksums" else 2)
    afresh = _saved_afresh(world, renew)
    assert again == afresh and again != first
    _, parts, _ = again
    assert len(parts) == 4 and all(p[:-4] and p[-4:] for p in parts)


def test_chunks_without_boxes_from_a_plan_the_coordinator_does_not_hold_fail() -> None:
    world = scale.simulate(MODEL, 4)
    sent = [exchange.parse_written(w, r)[1] for r, w in enumerate(world.written_again)]
    with pytest.raises(fc.errors.CheckpointError, match="rank 0 reported the chunks of a plan"):
        splice.merge(exchange.PlanCache(), sent, Tree(world.plan.entries, ()), (), False)
