"""The memory tier across nodes: a lost node resumes from the replicas of its shards.

Four real ranks (tests/memory_job.py) as two simulated nodes of two, each node with
a memory folder of its own; they are SIGKILLed for real, and a node's folder is
deleted as a lost node loses its RAM. The run then resumes from the newest memory
step, the lost node's shards fetched from their holders, bit-identical to a run
never interrupted; a kill inside a replication commits that step nowhere; a damaged
replica is found by its checksums.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.manager.memory_replicas import holders_of, layout_of
from tests import prefork
from tests.patience import HANG
from tests.test_memory import committed

REPO = Path(__file__).resolve().parent.parent
JOB = REPO / "tests" / "memory_job.py"
STEPS = 12
WORLD = 4


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _env(**extra: str) -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "FCKPT_TIMEOUT": str(int(HANG)),
        **extra,
    }


def two_nodes(
    base: Path, *args: str, wait_for: int | None = None, world: int = WORLD, nodes: int = 2
) -> list[tuple[int, str]]:
    """The job on ``world`` ranks, as torchrun on ``nodes`` machines starts them.

    With ``wait_for``, once that rank has ended the others are SIGKILLed (they wait for
    it in a collective): the whole job is lost, as when a node dies mid-step.
    """
    port, per_node = _port(), world // nodes
    procs = [
        prefork.Popen(
            [sys.executable, str(JOB), str(base), str(STEPS), *args],
            env=_env(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % per_node),
                LOCAL_WORLD_SIZE=str(per_node),
                GROUP_RANK=str(rank // per_node),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world)
    ]
    try:
        if wait_for is not None:
            procs[wait_for].wait(timeout=HANG)
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGKILL)
        return [(p.wait(timeout=HANG), p.communicate()[0]) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def torchrun(base: Path, *args: str) -> list[tuple[int, str]]:
    """The job under one ``torchrun --nproc_per_node=4``: the domains come from
    ``Memory(domain=...)`` (ranks 0, 1 and 2, 3).

    The port is free when chosen but torchrun binds it later: when another process
    took it meanwhile (no rank started: EADDRINUSE), the job is launched again on
    another port.
    """
    for attempt in range(5):
        log = base / f"torchrun-logs-{attempt}"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
            "--master_port", _port(), "--log_dir", str(log), "--redirects", "3",
            str(JOB), str(base), str(STEPS), *args,
        ]  # fmt: skip
        done = prefork.run(
            cmd, env=_env(DOMAIN_SIZE="2"), capture_output=True, text=True, timeout=HANG
        )
        outs = sorted(log.rglob("stdout.log"), key=lambda p: int(p.parent.name))
        if outs or "EADDRINUSE" not in done.stderr:
            break
    assert len(outs) == WORLD, (done.stdout, done.stderr[-3000:])
    return [(done.returncode, p.read_text()) for p in outs]


def lines(out: str, tag: str) -> list[str]:
    return [line.split(" ", 1)[1] for line in out.splitlines() if line.startswith(tag + " ")]


def resumed(runs: list[tuple[int, str]]) -> list[list[Any]]:
    return [json.loads(lines(out, "RESUMED")[0]) for _, out in runs]


def finals(runs: list[tuple[int, str]]) -> list[str]:
    for code, out in runs:
        assert code == 0, out[-4000:]
    return [lines(out, "FINAL")[0] for _, out in runs]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Each rank's final state after an uninterrupted run (under torchrun)."""
    base = tmp_path_factory.mktemp("reference")
    runs = torchrun(base)
    assert [r[0] for r in resumed(runs)] == [None] * WORLD
    assert not (base / "mem-a").exists() and not (base / "mem-b").exists()  # closed: gone
    return finals(runs)


@pytest.fixture(scope="module")
def died_at_7(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A job SIGKILLed on every rank once memory step 7 is committed (node folders at
    ``[6, 7]``, the disk at ``[5]``): its folder, and a copy of it as the kills left it."""
    base = tmp_path_factory.mktemp("died-at-7")
    work, kept = base / "work", base / "kept"
    runs = two_nodes(work, "--die-at", "7")
    assert [code for code, _ in runs] == [-signal.SIGKILL] * WORLD
    subprocess.run(["cp", "-a", str(work), str(kept)], check=True)  # hard links kept
    return work, kept


@pytest.fixture
def died(died_at_7: tuple[Path, Path]) -> Path:
    """The folder of :func:`died_at_7` as the kills left it, at the same path: a memory
    tier's folder belongs to the root of that real path (its mark names it)."""
    work, kept = died_at_7
    shutil.rmtree(work)
    subprocess.run(["cp", "-a", str(kept), str(work)], check=True)
    return work


def test_holders_are_the_same_local_rank_on_the_next_nodes() -> None:
    assert holders_of([0, 0, 2, 2], 2) == ((2,), (3,), (0,), (1,))
    assert holders_of(["a", "a", "b", "b", "c", "c"], 3) == (
        (2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3),
    )  # fmt: skip
    assert holders_of([0, 0, 0, 1], 2) == ((3,), (3,), (3,), (0,))
    assert layout_of([1, 1, 2, 2], [0, 0, 2, 2], None).replicas == 2
    assert layout_of([1, 1, 1, 1], [0, 0, 0, 0], None).replicas == 1
    with pytest.raises(fc.CheckpointError, match=r"replicas=3\): only 2 failure domain"):
        layout_of([1, 1, 2, 2], [0, 0, 2, 2], 3)


def test_a_folder_another_rank_makes_meanwhile_is_taken_as_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ranks of a node make their shared folder at once: one of them finds it gone
    from "missing" to "there" between two looks, which is no error."""
    from functional_ckpt._src.storage import durable

    folder = tmp_path / "mem-a"
    real, looks = Path.is_dir, [0]

    def racing(self: Path) -> bool:
        if self == folder:
            looks[0] += 1
            if looks[0] == 1:  # the first look: not there yet; then another rank makes it
                folder.mkdir()
                return False
        return real(self)

    monkeypatch.setattr(Path, "is_dir", racing)
    durable.make_dirs(folder)
    assert real(folder) and looks[0] >= 2
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(NotADirectoryError):
        durable.make_dirs(tmp_path / "file")


def test_memory_tier_saves_across_nodes_are_incremental(tmp_path: Path) -> None:
    """Every rank, in either node's folder, writes only what changed: its chunk of
    the frozen tensor is taken from the last step its own folder holds."""
    runs = two_nodes(tmp_path)
    finals(runs)
    for rank, (_, out) in enumerate(runs):
        reused = json.loads(lines(out, "REUSED")[0])
        assert len(reused) >= STEPS - 1, (rank, reused)
        assert reused[0] == 0 and all(n == 1 for n in reused[1:]), (rank, reused)


def test_a_lost_node_resumes_from_the_replicas_bit_identically(
    died: Path, reference: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    mem_a, mem_b = died / "mem-a", died / "mem-b"
    assert committed(mem_a) == committed(mem_b) == [6, 7]
    for folder in (mem_a, mem_b):  # each node's folder: normal, complete checkpoints
        assert fc.verify(folder / step_name(7)).ok
    assert committed(died / "root") == [5]
    assert cli.main(["ls", "--json", str(died / "root")]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "memory"]
    assert [(r["step"], r["replicas"], r["whole"]) for r in rows] == [(6, 2, True), (7, 2, True)]
    assert cli.main(["ls", str(died / "root")]) == 0
    out = capsys.readouterr().out
    assert "REPLICAS" in out and "2 confirmed" in out, out
    shutil.rmtree(mem_b)  # node b is lost, and its RAM with it
    # A copy of this run's step 6 named step_10 is damage: no obstacle to the save of 10.
    shutil.copytree(mem_a / step_name(6), mem_a / step_name(10), symlinks=True)
    runs = two_nodes(died)
    got = resumed(runs)
    assert [g[0] for g in got] == [7] * WORLD, got  # the memory tier's step, not the disk's 5
    fetched = got[2][1]["fetched"]  # node b's folder, from node a's ranks
    assert fetched and set(fetched.values()) <= {0, 1}, got
    assert {"__2_0.distcp", "__3_0.distcp", "manifest.msgpack"} <= set(fetched), fetched
    assert got[0][1]["fetched"] == {}  # node a had it all
    # Nothing was checked twice: the read checks every byte it takes, and each copy
    # node b received was read, there or at its source.
    assert [g[3] for g in got] == [0] * WORLD, got
    assert not any(g[2] for g in got), got
    assert finals(runs) == reference
    for rank, (_, out) in enumerate(runs):
        told = [w for w in json.loads(lines(out, "WARNINGS")[0]) if "step 10" in w]
        assert not told, (rank, told)  # was "failed (...): not a checkpoint of this run"


def test_a_kill_inside_a_replication_commits_that_step_nowhere(
    tmp_path: Path, reference: list[str]
) -> None:
    # Round 3: the disk tier's save of step 5 cannot commit first (the memory save of
    # step 4 waits for round 3, and every rank waits for rank 2).
    runs = two_nodes(tmp_path, "--die-in-round", "3", "--die-rank", "2", wait_for=2)
    assert runs[2][0] == -signal.SIGKILL
    for folder in (tmp_path / "mem-a", tmp_path / "mem-b"):
        # step 3 written, never replicated (1 made room for it: keep=2 counts it)
        assert committed(folder) == [2], folder
        assert not (folder / step_name(3)).exists()
    assert committed(tmp_path / "root") == []
    runs = two_nodes(tmp_path)
    assert [g[0] for g in resumed(runs)] == [2] * WORLD
    assert finals(runs) == reference


def test_a_failed_replication_warns_every_rank_and_training_goes_on(
    tmp_path: Path, reference: list[str]
) -> None:
    """Rank 0 has no room for rank 2's replica of step 3: the step is committed nowhere,
    every rank reports it, the disk tier and the next rounds are unaffected."""
    runs = two_nodes(tmp_path, "--full-in-round", "3", "--die-rank", "0")
    assert finals(runs) == reference
    for _, out in runs:
        told = " ".join(json.loads(lines(out, "WARNINGS")[0]))
        assert "memory-tier checkpoint of step 3 failed" in told, told
        assert "step 2 failed" not in told and "step 4 failed" not in told, told
    assert committed(tmp_path / "root") == [10, 12]


def test_a_damaged_replica_is_refetched_or_the_disk_tier_used(
    died: Path, reference: list[str]
) -> None:
    mem_a, mem_b = died / "mem-a", died / "mem-b"
    # Node a's own copy of rank 0's file is damaged: node b's replica of it is used.
    corrupt_file(mem_a / step_name(7) / "__0_0.distcp")
    runs = two_nodes(died, "--die-at", "8")  # resumes at 7, dies once 8 is in memory
    got = resumed(runs)
    assert [g[0] for g in got] == [7] * WORLD, got
    assert got[0][1]["fetched"] == {"__0_0.distcp": 2}, got
    # the read found the damage; then every copy was checked and an intact one taken
    assert "__0_0.distcp" in got[0][2][0] and "every copy is checked" in got[0][2][0], got
    assert got[0][3] == 1 and got[2][3] == 1, got  # each keeper checked its folder once
    assert fc.verify(mem_a / step_name(7)).ok  # repaired
    # Node b is lost and node a's copies of rank 2's file are damaged: no intact copy
    # of step 8 is left anywhere, nor of 7: the disk tier's step 5 is used.
    shutil.rmtree(mem_b)
    for step in (7, 8):
        corrupt_file(mem_a / step_name(step) / "__2_0.distcp")
    # And another run's checkpoint of step 10 is put in node a's folder: the memory-tier
    # save of step 10 is refused on every rank before a byte is written, theirs is left
    # as it is, and training, the later memory saves and the disk's step 10 go on.
    with fc.CheckpointManager(died / "theirs") as mgr:
        mgr.maybe_save({"w": torch.zeros(2)}, step=10)
    shutil.copytree(died / "theirs" / step_name(10), mem_a / step_name(10))
    runs = two_nodes(died)
    got = resumed(runs)
    assert [g[0] for g in got] == [5] * WORLD, got
    assert any("no intact copy" in w and "__2_0.distcp" in w for w in got[0][2]), got[0][2]
    assert finals(runs) == reference
    for rank, (_, out) in enumerate(runs):
        told = [w for w in json.loads(lines(out, "WARNINGS")[0]) if "step 10 failed" in w]
        assert len(told) == 1 and "not a checkpoint of this run" in told[0], (rank, told)
    theirs = fc.inspect(mem_a / step_name(10)).metadata["run"]
    assert theirs == fc.inspect(died / "theirs" / step_name(10)).metadata["run"]
    assert committed(died / "root") == [10, 12]


def corrupt_file(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    os.chmod(path, 0o644)
    path.write_bytes(bytes(raw))


def test_another_world_size_says_so_and_resumes_from_the_disk_tier(died: Path) -> None:
    runs = two_nodes(died, world=2)  # the job comes back on half the ranks
    got = resumed(runs)
    assert [g[0] for g in got] == [5, 5], got  # the disk tier reshards; the memory tier cannot
    told = " ".join(got[0][2])
    assert "saved by 4 ranks and this run has 2" in told and "disk tier" in told, told
    for code, out in runs:
        assert code == 0 and lines(out, "FINAL"), out[-3000:]


def test_two_histories_sharing_a_step_are_never_mixed(died: Path, reference: list[str]) -> None:
    mem_a, mem_b = died / "mem-a", died / "mem-b"
    old_b = died / "old-b"
    shutil.copytree(mem_b, old_b, symlinks=True)  # node b's RAM, as it was
    shutil.rmtree(mem_a)
    shutil.rmtree(mem_b)  # a relaunch elsewhere: from the disk's step 5, another step 7
    runs = two_nodes(died, "--die-at", "7")
    assert [code for code, _ in runs] == [-signal.SIGKILL] * WORLD
    assert [g[0] for g in resumed(runs)] == [5] * WORLD
    assert committed(mem_a) == committed(old_b) == [6, 7]
    shutil.rmtree(mem_b)
    old_b.rename(mem_b)  # the old node came back with its RAM
    runs = two_nodes(died)
    # its steps 6 and 7 left the trunk when the relaunch saved on from step 5: node b drops
    # them, and every rank resumes the trunk's step 7 (node b's parts from node a's replicas)
    assert [g[0] for g in resumed(runs)] == [7] * WORLD
    assert finals(runs) == reference


def test_after_wait_every_rank_lists_the_memory_steps_committed(tmp_path: Path) -> None:
    """Two ranks share one folder, its keeper commits late: ``wait()`` on either rank
    returns with the step committed, so every rank lists (and restores) the same steps."""
    from tests.test_dist import launch, wait_all

    root, folder = tmp_path / "root", tmp_path / "ram"
    job = Path(__file__).with_name("memory_wait_job.py")
    for rc, _, err in wait_all(launch(2, str(root), str(folder), job=job)):
        assert rc == 0, err[-3000:]
    held = [json.loads((root / f"held.{r}.json").read_text()) for r in range(2)]
    assert [h["memory"] for h in held] == [[6, 7], [6, 7]], held
    assert all(h == {"disk": [2, 4, 6], "memory": [6, 7], "restored": [True, True]} for h in held)


def test_a_state_of_replicated_tensors_resumes_from_the_memory_tier(tmp_path: Path) -> None:
    """Every tensor replicated (one rank writes it, the others none) and per-rank values:
    the step in RAM was saved by every rank all the same, and is resumed, not the disk's."""
    runs = two_nodes(tmp_path, "--plain", "--die-at", "7")
    assert [code for code, _ in runs] == [-signal.SIGKILL] * WORLD
    assert committed(tmp_path / "mem-a") == committed(tmp_path / "mem-b") == [6, 7]
    assert committed(tmp_path / "root") == [5]
    runs = two_nodes(tmp_path, "--plain")
    got = resumed(runs)
    assert [g[0] for g in got] == [7] * WORLD, got
    assert not any(g[2] for g in got), got
    pos = [int(final.rsplit("-", 1)[1]) for final in finals(runs)]
    assert pos == [rank + 4 * STEPS for rank in range(WORLD)], pos


def test_a_step_only_ram_holds_is_deleted_from_every_node(tmp_path: Path) -> None:
    """Step 11, in the memory tier only (the disk saves every 5 steps), is deleted from
    each node's folder, its replicas with it, on every rank alike."""
    runs = two_nodes(tmp_path, "--delete", "11")
    finals(runs)
    held = [json.loads(lines(out, "HELD")[0]) for _, out in runs]
    assert held == [[[12], [10, 12]]] * WORLD, held


def test_a_rollback_across_nodes_leaves_a_step_held_in_part_with_the_ram(tmp_path: Path) -> None:
    """Four nodes of one rank, two copies of each shard: no node's folder holds step 11
    (RAM only: the disk saves every 5 steps) whole. A rollback to 10 still branches 12,
    on every rank alike, and says that 11 is dropped rather than failing; a rollback to
    11 itself is refused, saying why, before anything moves."""
    runs = two_nodes(tmp_path, "--rollback", "10", nodes=4)
    finals(runs)
    refused = [json.loads(lines(out, "REFUSED")[0]) for _, out in runs]
    assert all("rollback(11): not on disk, and " in r and "some ranks" in r for r in refused), (
        refused
    )
    rolled = [json.loads(lines(out, "ROLLED")[0]) for _, out in runs]
    assert rolled == [[[], [10], {"b": [12]}]] * WORLD, rolled
    told = json.loads(lines(runs[0][1], "WARNINGS")[0])
    assert any("rollback(10) drops steps [11]" in w for w in told), told
