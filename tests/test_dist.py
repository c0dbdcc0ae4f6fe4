"""Multi-rank checkpoints with real processes on gloo: FSDP2 resume, resharding, dead ranks."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.storage import committed
from tests import prefork
from tests.dist_job import full_tensors
from tests.exact import assert_exact
from tests.patience import HANG

JOB = Path(__file__).with_name("dist_job.py")
REPO = JOB.parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(
    world: int,
    *args: str,
    timeout: float = HANG,
    env: dict[str, str] | None = None,
    job: Path = JOB,
) -> list[prefork.Popen]:
    """``job`` (a script of tests/) on ``world`` gloo ranks on this machine."""
    port = str(free_port())
    procs = []
    for rank in range(world):
        penv = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO),
            **(env or {}),
        }
        procs.append(
            prefork.Popen(
                [sys.executable, str(job), *args],
                env=penv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def wait_all(procs: list[prefork.Popen], timeout: float = HANG) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        out.append((p.returncode, stdout, stderr))
    return out


def run_ok(world: int, *args: str) -> None:
    for rc, _, err in wait_all(launch(world, *args)):
        assert rc == 0, err[-3000:]


def losses(root: Path, rank: int) -> list[tuple[int, str]]:
    words = (root / f"losses.{rank}.txt").read_text().split()
    return [(int(a), b) for a, b in zip(words[::2], words[1::2], strict=True)]


def copied(shard_save: Callable[[int], Path], to: Path, *worlds: int) -> None:
    """The saves of ``shard_save`` for ``worlds`` copied into ``to``, to change there."""
    for world in worlds:
        shutil.copytree(shard_save(world), to / f"w{world}")


def test_fsdp2_sigkill_of_one_rank_resumes_bit_identically(tmp_path: Path) -> None:
    ref, run = tmp_path / "ref", tmp_path / "run"
    ref.mkdir()
    run.mkdir()
    run_ok(2, "train", str(ref), "10")
    procs = launch(2, "train", str(run), "10", "1", "7")
    rank1 = procs[1]
    rank1.wait(timeout=HANG)
    assert rank1.returncode == -9  # SIGKILLed mid-run
    procs[0].kill()  # the job is dead; the scheduler takes the survivor down too
    wait_all(procs)
    assert not (run / "final").exists()
    run_ok(2, "train", str(run), "10")
    for rank in range(2):
        reference = dict(losses(ref, rank))
        for step, loss in losses(run, rank):
            assert loss == reference[step], f"rank {rank} step {step}"
    a = fc.restore(ref / "final", partial=True)
    b = fc.restore(run / "final", partial=True)
    assert_exact(fc.codec.to_python(a), fc.codec.to_python(b))


def test_reshard_4_to_2_and_1_and_1_to_2(tmp_path: Path, shard_save: Callable[[int], Path]) -> None:
    copied(shard_save, tmp_path, 4, 2)
    assert fc.verify(tmp_path / "w4").ok and fc.inspect(tmp_path / "w4").world_size == 4
    run_ok(2, "shard-restore", str(tmp_path))  # 4 -> 2 and 2 -> 2

    # 4 -> 1 without a process group: full tensors assembled from the shards
    template = {
        "w": torch.zeros(10, 6),
        "e": torch.zeros(5, 3, 2, dtype=torch.bfloat16),
        "r": torch.zeros(10, 6),
        "b": torch.zeros(7, dtype=torch.int64),
        "step": 0,
    }
    back = fc.restore(tmp_path / "w4", template, partial=True)
    from tests.dist_job import full_tensors

    full = full_tensors()
    assert torch.equal(back["w"], full["w"]) and torch.equal(back["e"], full["e"])
    assert torch.equal(back["r"], full["w"] * 2)
    with pytest.raises(fc.errors.TemplateMismatch, match="saved by 4 ranks"):
        fc.restore(tmp_path / "w4", {**template, "loader": {"pos": 0, "seed": 0}})

    # 1 -> 2: a single-process checkpoint restored into DTensor shards
    single = {**full, "r": full["w"] * 2, "step": 11, "loader": {"pos": 0, "seed": 0}}
    fc.save(tmp_path / "solo" / "w1", single)
    run_ok(2, "plain-restore", str(tmp_path / "solo"))


def test_a_rank_killed_during_save_commits_nothing(tmp_path: Path) -> None:
    procs = launch(2, "kill-in-save", str(tmp_path), env={"FCKPT_TIMEOUT": "30"})
    results = wait_all(procs, timeout=HANG)
    assert results[1][0] == -9
    rc, out, err = results[0]
    assert rc == 3, out + err[-2000:]
    assert "raised after" in out and "nothing" in out
    seconds = float(out.split("raised after ")[1].split("s:")[0])
    assert seconds < 300  # the configured 30 s, not the 600 s default and not a hang
    assert not (tmp_path / "ck").exists()


def test_a_coordinator_killed_after_its_commit_leaves_the_other_ranks_parts_kept(
    tmp_path: Path,
) -> None:
    """Ranks that keep parts (no file system shared with the coordinator) and never hear
    the verdict cannot know whether the step committed: each keeps its part, which
    alone is never a checkpoint, so a checkpoint the coordinator did commit is whole."""
    results = wait_all(launch(2, "kill-after-commit", str(tmp_path), env={"FCKPT_TIMEOUT": "30"}))
    assert results[0][0] == -9, results[0][2][-3000:]
    rc, out, err = results[1]
    assert rc == 3, out + err[-3000:]
    assert "SAVED 1" in out
    told = out.split("RAISED ", 1)[1]
    assert "nothing committed" not in told, told
    assert "may have committed" in told and "kept" in told and "step_2" in told, told
    coordinator, part = tmp_path / "r0" / "step_2", tmp_path / "r1" / "step_2"
    assert classify(coordinator) is Kind.COMMITTED
    assert sorted(p.name for p in part.iterdir()) == [naming.shard_name(1)]
    assert fc.CheckpointManager(tmp_path / "r1", read_only=True).steps() == []  # a part only
    lacking = fc.verify(coordinator)  # the coordinator's copy lacks rank 1's file
    assert not lacking.ok and naming.shard_name(1) in str(lacking), str(lacking)
    shutil.copy2(part / naming.shard_name(1), coordinator)  # what a remote tier does
    assert fc.verify(coordinator).ok
    full = full_tensors()
    like = {k: torch.empty_like(full[k]) for k in ("w", "e")}
    back = fc.restore(coordinator, like, partial=True)  # one process: no per-rank state
    assert torch.equal(back["w"], full["w"]) and torch.equal(back["e"], full["e"])


def test_incremental_saves_across_ranks_share_each_ranks_unchanged_shards(tmp_path: Path) -> None:
    run_ok(2, "incremental", str(tmp_path))
    from tests.dist_job import chunk_files

    files = committed.every_file(tmp_path / "c")  # the index's table and each part's
    data = sorted(chunk_files(tmp_path / "c"))
    assert data and all(files[n].get("reused") for n in data), files  # c wrote no tensor
    own = [n for n in files if n.endswith(".distcp") and not files[n].get("reused")]
    assert own == ["__0_0.distcp"] and files[own[0]]["size"] < 4096  # values for stock readers
    assert {n.split("_")[2] for n in data} == {"0", "1"}  # both ranks' shards
    assert fc.verify(tmp_path / "c").ok


def test_manager_decisions_agree_and_async_saves_work_across_ranks(tmp_path: Path) -> None:
    run_ok(2, "manager", str(tmp_path))
    assert fc.CheckpointManager(tmp_path / "run", read_only=True).steps() == [0]
    # the export gathered the sharded weights from both ranks into full tensors
    from safetensors.torch import load_file

    from tests.dist_job import full_tensors

    export = tmp_path / "run" / "exports" / "step_000000002" / "model.safetensors"
    assert torch.equal(next(iter(load_file(str(export)).values())), full_tensors()["w"])
    run_ok(2, "async-save", str(tmp_path))
    assert fc.verify(tmp_path / "copy").ok and fc.verify(tmp_path / "write").ok


def test_every_failing_rank_is_named_with_its_error_type(tmp_path: Path) -> None:
    """Two ranks fail differently: the healthy rank's RankFailed names both, with types."""
    import json

    run_ok(3, "ranks-fail", str(tmp_path))
    told = {r: json.loads((tmp_path / f"error.{r}.json").read_text()) for r in range(3)}
    assert told[0]["type"] == "RankFailed"
    failures = told[0]["failures"]
    assert sorted(failures) == ["1", "2"]
    assert failures["1"] == ["UnsupportedValue", "rank one cannot store this"]
    # the disk error arrives as the project's own, naming the checkpoint and the cause
    assert failures["2"][0] == "CheckpointError"
    assert "no space left" in failures["2"][1] and "ck" in failures["2"][1]
    assert "rank 1 failed: UnsupportedValue: rank one" in told[0]["str"]
    assert "rank 2 failed: CheckpointError:" in told[0]["str"]
    # a failing rank raises its own error (catchable by type), noting the other failure
    assert told[1]["type"] == "UnsupportedValue"
    assert any("rank 2 failed: CheckpointError" in n for n in told[1]["notes"])
    assert told[2]["type"] == "CheckpointError"
    assert any("rank 1 failed: UnsupportedValue" in n for n in told[2]["notes"])
    assert not (tmp_path / "ck").exists()


def test_a_failure_whose_message_cannot_be_made_fails_every_rank_together(
    tmp_path: Path,
) -> None:
    """Regression: a rank whose error's ``__str__`` raised could not report it, left
    the save's exchanges and made the others wait out the timeout ("did not
    answer"). Now rank 0 learns rank 1's failure by type, and nothing is left."""
    import json

    run_ok(2, "unprintable-fail", str(tmp_path))
    told = {r: json.loads((tmp_path / f"error.{r}.json").read_text()) for r in range(2)}
    assert told[0]["type"] == "RankFailed", told[0]
    assert told[0]["failures"]["1"][0] == "Unprintable"
    assert "could not be made" in told[0]["failures"]["1"][1]
    assert "did not answer" not in told[0]["str"] and "did not answer" not in told[1]["str"]
    assert told[1]["type"] == "CheckpointError" and "Unprintable" in told[1]["str"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.0.json", "error.1.json"]


def test_agree_values_gives_every_value_or_fails_every_rank_together(tmp_path: Path) -> None:
    """One round that is both an agreement and a gather: the values when every rank
    passed; otherwise the failing rank's own error, and RankFailed naming it elsewhere."""
    import json

    run_ok(3, "agree-values", str(tmp_path))
    told = {r: json.loads((tmp_path / f"error.{r}.json").read_text()) for r in range(3)}
    assert told[1]["type"] == "CorruptCheckpoint" and "rank 1 found" in told[1]["str"]
    for r in (0, 2):
        assert told[r]["type"] == "RankFailed", told[r]
        assert told[r]["failures"] == {"1": ["CorruptCheckpoint", "rank 1 found damage"]}
        assert "round two: rank 1 failed" in told[r]["str"]


def test_a_shard_read_straight_into_its_dtensor_still_checks_every_byte(
    tmp_path: Path, shard_save: Callable[[int], Path]
) -> None:
    """A rank reads its saved shard straight into its new DTensor's memory; a byte
    flipped in that shard's data is still found, named by file, on every rank."""
    import json

    from tests.forge import flip

    copied(shard_save, tmp_path, 2)
    run_ok(2, "same-shard-restore", str(tmp_path))  # exact, and every shard read straight
    assert not list(tmp_path.glob("error.*"))
    shard = tmp_path / "w2" / "__1_0.distcp"
    flip(tmp_path / "w2", "w", file=shard.name)
    for rc, _, err in wait_all(
        launch(2, "same-shard-restore", str(tmp_path), env={"FCKPT_TIMEOUT": "120"})
    ):
        assert rc == 0, err[-3000:]
    told = {r: json.loads((tmp_path / f"error.{r}.json").read_text()) for r in range(2)}
    assert told[1]["type"] == "CorruptCheckpoint", told[1]
    assert "'w'" in told[1]["str"] and shard.name in told[1]["str"], told[1]
    assert told[0]["type"] == "RankFailed", told
    assert told[0]["failures"]["1"][0] == "CorruptCheckpoint", told


def test_a_part_damaged_on_one_rank_fails_every_rank_together(
    tmp_path: Path, shard_save: Callable[[int], Path]
) -> None:
    """A restoring rank whose own manifest part is damaged (only it reads that part)
    fails with the part named, and every other rank at once, naming that rank and
    its error: no rank waits out the timeout."""
    import json

    copied(shard_save, tmp_path, 2)
    (part,) = (tmp_path / "w2").glob("manifest.part-*1.msgpack")
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    for rc, _, err in wait_all(
        launch(2, "damaged-part-restore", str(tmp_path), env={"FCKPT_TIMEOUT": "120"})
    ):
        assert rc == 0, err[-3000:]
    told = {r: json.loads((tmp_path / f"error.{r}.json").read_text()) for r in range(2)}
    assert told[0]["type"] == "RankFailed", told[0]
    assert told[0]["failures"]["1"][0] == "CorruptCheckpoint", told[0]
    assert told[1]["type"] == "CorruptCheckpoint" and part.name in told[1]["str"], told[1]
    assert "did not answer" not in told[0]["str"]


def test_rank_failed_without_a_process_group() -> None:
    """The agreement rule itself: healthy ranks get every failure, failing ranks their own."""
    import pickle

    from functional_ckpt._src.distributed.groups import raise_failures

    told = {3: b"TemplateMismatch\0no key 'w'", 1: b"CorruptCheckpoint\0bad crc"}
    with pytest.raises(fc.errors.RankFailed) as caught:
        raise_failures(None, "restore ck", told)
    assert list(caught.value.failures) == [1, 3]  # ordered by rank
    assert str(caught.value) == (
        "restore ck: rank 1 failed: CorruptCheckpoint: bad crc; "
        "rank 3 failed: TemplateMismatch: no key 'w'; nothing was committed"
    )
    again = pickle.loads(pickle.dumps(caught.value))
    assert again.failures == caught.value.failures and str(again) == str(caught.value)
    mine = fc.errors.TemplateMismatch("no key 'w'")
    with pytest.raises(fc.errors.TemplateMismatch) as own:
        raise_failures(mine, "restore ck", told)
    assert own.value is mine and "rank 1 failed: CorruptCheckpoint" in own.value.__notes__[0]
    raise_failures(None, "restore ck", {})  # nobody failed: no error


def test_eight_ranks_save_and_restore_onto_8_and_3_and_move_the_bytes_predicted(
    tmp_path: Path,
) -> None:
    """benchmarks/scale.py's state saved by 8 real ranks: every rank's bytes through
    the checkpoint collectives are what the benchmark's simulation predicts for N=8,
    and the checkpoint restores bit-exact on 8 and on 3 ranks."""
    import json

    sys.path.insert(0, str(REPO / "benchmarks"))
    import scale

    from tests.dist_job import SCALE_MODEL

    run_ok(8, "traffic", str(tmp_path))
    run_ok(3, "traffic", str(tmp_path))
    told = [json.loads((tmp_path / f"traffic.8.{r}.json").read_text()) for r in range(8)]
    world = scale.simulate(scale.Model(**SCALE_MODEL), 8)
    predicted = scale.predict_helpers(world, "ck", told[0]["nbytes"])
    for rank, (got, want) in enumerate(zip(told, predicted, strict=True)):
        assert got["save"]["sent"] == want.sent, (rank, got["save"], want)
        assert got["save"]["received"] == want.received, (rank, got["save"], want)
    # the coordinator alone receives every rank's entries; the others the same few bytes
    assert told[0]["save"]["received"] > 8 * told[1]["save"]["received"]
    assert len({t["save"]["received"] for t in told[1:]}) == 1
    # a restore moves the same few bytes on every rank: each plans and reads its own
    assert len({t["restore"]["received"] for t in told}) == 1
    assert told[0]["restore"]["received"] < 256, told[0]["restore"]
    for world_size in (8, 3):
        for rank in range(world_size):
            back = json.loads((tmp_path / f"traffic.{world_size}.{rank}.json").read_text())
            assert back["checked"] == len(world.plan.targets) - 1  # every tensor but rng
            assert back["restore"]["calls"] >= 1
            if world_size == 8:  # the manifest's index and this rank's own part, no other
                assert back["parts_read"] == [rank], back["parts_read"]
            else:  # reshard= maps every saving rank's per-rank state: all eight parts
                assert back["parts_read"] == list(range(8))
    assert fc.verify(tmp_path / "ck").ok


def test_a_layout_saved_again_reuses_its_plan_and_a_changed_one_never_does(
    tmp_path: Path,
) -> None:
    """The same layout with new values: every rank sends an empty plan and the
    coordinator deduplicates nothing; other shapes, then another key: full plans,
    planned again, each checkpoint restored bit-exact (in the job)."""
    import json

    run_ok(2, "plan-cache", str(tmp_path))
    for rank in range(2):
        told = json.loads((tmp_path / f"plan-cache.{rank}.json").read_text())
        assert told["sent"] == [True, False, True, True], told
    coordinator = json.loads((tmp_path / "plan-cache.0.json").read_text())
    assert coordinator["dedups"] == [1, 1, 2, 3]  # the second save planned nothing
    assert coordinator["merges"] == [1, 1, 2, 3]  # and spliced its parts from columns
    for i in range(4):
        assert fc.verify(tmp_path / f"s{i}").ok
