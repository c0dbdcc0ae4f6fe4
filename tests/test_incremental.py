"""Incremental checkpoints: unchanged bytes are shared with the base, never written again.

Every incremental checkpoint must stay self-contained (restore, verify, stock
``dcp.load``), survive the deletion of its base, report damage in a shared file
like the base does, and never take a changed tensor for an unchanged one.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.cli import ui
from functional_ckpt._src.format import naming
from functional_ckpt._src.restore.read import vetted_view
from functional_ckpt._src.save import incremental
from functional_ckpt._src.storage import committed, usage
from tests import prefork

REPO = Path(__file__).resolve().parent.parent


def make_state(seed: int = 0) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model": {
            "backbone": torch.randn(256, 256, generator=g),  # frozen: 256 KiB
            "embed": torch.randn(64, 128, generator=g).to(torch.bfloat16),  # frozen
            "head": torch.randn(16, 16, generator=g),  # trained
        },
        "optimizer": {"m": torch.zeros(16, 16)},
        "rng": {"torch": torch.arange(4)},
        "step": 0,
    }


def files_of(path: Path) -> dict[str, dict[str, Any]]:
    files: dict[str, dict[str, Any]] = committed.read_manifest(path)["files"]
    return files


def train(state: dict[str, Any], step: int) -> None:
    state["model"]["head"].add_(0.5)  # in place: version counters move
    state["optimizer"]["m"].add_(1.0)
    state["step"] = step


def assert_same(back: Any, state: dict[str, Any]) -> None:
    for key in ("backbone", "embed", "head"):
        assert torch.equal(back["model", key], state["model"][key]), key
        assert back["model", key].dtype == state["model"][key].dtype
    assert torch.equal(back["optimizer", "m"], state["optimizer"]["m"])
    assert back["step"] == state["step"]


def test_base_deleted_then_incremental_restores_bit_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = make_state()
    first = fc.save(tmp_path / "a", state)
    train(state, 1)
    second = fc.save(tmp_path / "b", state, base=tmp_path / "a")

    files = files_of(tmp_path / "b")
    reused = [n for n, info in files.items() if info.get("reused")]
    assert reused == ["__0_1.distcp"]
    base_stat = os.stat(tmp_path / "a" / "__0_0.distcp")
    assert os.stat(tmp_path / "b" / "__0_1.distcp").st_ino == base_stat.st_ino
    assert base_stat.st_nlink == 2
    # Only the trained tensors (and the small files) were written again.
    new = os.stat(tmp_path / "b" / "__0_0.distcp").st_size
    assert new < 0.05 * files_of(tmp_path / "a")["__0_0.distcp"]["size"]
    assert second.tensor_bytes == first.tensor_bytes

    summary = fc.inspect(tmp_path / "b")
    assert summary.shared_bytes == files["__0_1.distcp"]["size"]
    assert summary.added_bytes == summary.file_bytes - summary.shared_bytes
    assert fc.inspect(tmp_path / "a").shared_bytes == base_stat.st_size
    assert cli.main(["inspect", str(tmp_path / "b")]) == 0
    assert "shared with other checkpoints" in capsys.readouterr().out
    assert cli.main(["ls", str(tmp_path)]) == 0
    both = usage.disk_bytes([tmp_path / "a", tmp_path / "b"])
    assert both < sum(fc.inspect(tmp_path / n).file_bytes for n in "ab")
    assert f"{ui.human(both)} in all" in capsys.readouterr().out  # a shared file counts once
    assert cli.main(["ls", "--json", str(tmp_path)]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["b"]["shared"] == rows["a"]["shared"] == base_stat.st_size

    train(state, 2)  # a checkpoint may be its own base when it is replaced
    fc.save(tmp_path / "b", state, base=tmp_path / "b", overwrite=True)
    assert_same(fc.restore(tmp_path / "b"), state)
    assert os.stat(tmp_path / "b" / "__0_1.distcp").st_ino == base_stat.st_ino

    shutil.rmtree(tmp_path / "a")  # pruning the base never breaks the checkpoint
    back = fc.restore(tmp_path / "b")
    assert_same(back, state)
    assert torch.equal(back["rng", "torch"], state["rng"]["torch"])
    assert fc.verify(tmp_path / "b").ok
    assert fc.inspect(tmp_path / "b").shared_bytes == 0  # nobody else holds the file now

    import torch.distributed.checkpoint as dcp

    sd = {"model.backbone": torch.zeros(256, 256), "model.head": torch.zeros(16, 16)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, checkpoint_id=str(tmp_path / "b"))
    assert torch.equal(sd["model.backbone"], state["model"]["backbone"])
    assert torch.equal(sd["model.head"], state["model"]["head"])


def corrupt(path: Path, key: tuple[str, ...]) -> None:
    chunk = vetted_view(path).tensors[key].chunks[0]
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + 7)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x55]))


def test_a_damaged_shared_file_is_reported_by_every_checkpoint_using_it(tmp_path: Path) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)
    train(state, 1)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    corrupt(tmp_path / "a", ("model", "backbone"))
    for name in ("a", "b"):
        report = fc.verify(tmp_path / name)
        assert not report.ok
        assert any("model.backbone" in str(p) or "backbone" in str(p) for p in report.problems)
        with pytest.raises(fc.errors.CorruptCheckpoint):
            fc.restore(tmp_path / name)


def test_data_and_numpy_writes_are_not_taken_for_unchanged(tmp_path: Path) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")  # this process now knows b's counters
    backbone, embed = state["model"]["backbone"], state["model"]["embed"]
    versions = (backbone._version, embed._version)
    backbone.data[3, 5] += 1.0  # through .data: its own version counter
    backbone.numpy()[200, 7] = 42.0  # through numpy: no counter at all
    embed.data.view(torch.int16)[1, 2] += 1  # one bit of one element
    assert (backbone._version, embed._version) == versions  # the counters cannot tell
    fc.save(tmp_path / "c", state, base=tmp_path / "b")
    assert_same(fc.restore(tmp_path / "c"), state)
    assert fc.verify(tmp_path / "c").ok

    # async saves, staged or not, decide on the bytes they commit
    backbone.numpy()[0, 0] = -1.0
    pending = fc.save_async(tmp_path / "d", state, base=tmp_path / "c")
    pending.wait_staged()
    pending.result()
    backbone.numpy()[0, 1] = -2.0
    pending = fc.save_async(tmp_path / "e", state, base=tmp_path / "d", staging="none")
    pending.result()
    assert_same(fc.restore(tmp_path / "e"), state)
    assert fc.restore(tmp_path / "d")["model", "backbone"][0, 1] != -2.0


def test_a_changed_layout_is_written_in_full(tmp_path: Path) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)
    other = {
        "model": {
            "backbone": state["model"]["backbone"].reshape(128, 512),  # same bytes, new shape
            "embed": state["model"]["embed"].float(),  # new dtype
            "head2": state["model"]["head"],  # new key
        },
        "optimizer": {"m": state["optimizer"]["m"]},
        "step": 0,
    }
    fc.save(tmp_path / "b", other, base=tmp_path / "a")
    files = files_of(tmp_path / "b")
    # only optimizer.m kept its layout, and it is too small a part of the base's file
    assert not any(info.get("reused") for info in files.values())
    back = fc.restore(tmp_path / "b")
    assert torch.equal(back["model", "backbone"], other["model"]["backbone"])
    assert back["model", "embed"].dtype == torch.float32
    assert torch.equal(back["model", "head2"], state["model"]["head"])

    # a partial layout change: the unchanged part is still shared
    state["model"]["head"] = torch.zeros(4)
    fc.save(tmp_path / "c", state, base=tmp_path / "a")
    assert any(info.get("reused") for info in files_of(tmp_path / "c").values())
    assert torch.equal(fc.restore(tmp_path / "c")["model", "head"], torch.zeros(4))


def test_a_mostly_dead_base_file_is_not_shared(tmp_path: Path) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)
    state["model"]["backbone"].add_(1.0)  # most of the base's file is now dead
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    files = files_of(tmp_path / "b")
    assert not any(info.get("reused") for info in files.values())
    assert os.stat(tmp_path / "a" / "__0_0.distcp").st_nlink == 1
    assert_same(fc.restore(tmp_path / "b"), state)


def test_files_are_copied_where_links_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)

    def no_link(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.EXDEV, "cross-device link")

    monkeypatch.setattr(incremental.os, "link", no_link)
    monkeypatch.setattr(incremental.os, "copy_file_range", no_link)  # an older kernel
    train(state, 1)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    assert files_of(tmp_path / "b")["__0_1.distcp"]["reused"]
    assert os.stat(tmp_path / "b" / "__0_1.distcp").st_nlink == 1
    assert fc.inspect(tmp_path / "b").shared_bytes == 0
    shutil.rmtree(tmp_path / "a")
    assert_same(fc.restore(tmp_path / "b"), state)
    assert fc.verify(tmp_path / "b").ok


def test_an_unusable_base_is_an_error_for_save_and_a_full_save_for_the_manager(
    tmp_path: Path,
) -> None:
    state = make_state()
    with pytest.raises(fc.errors.CheckpointError, match=r"base=.*missing"):
        fc.save(tmp_path / "x", state, base=tmp_path / "missing")
    assert not (tmp_path / "x").exists()
    with pytest.raises(TypeError, match="base="):
        fc.save(tmp_path / "x", state, base=3)  # type: ignore[arg-type]

    with fc.CheckpointManager(tmp_path / "run", tiers=(fc.manager.Disk(incremental=True),)) as mgr:
        mgr.maybe_save(state, step=1)
        (mgr.path(1) / "manifest.msgpack").write_bytes(b"garbage")  # damaged base
        train(state, 2)
        mgr.maybe_save(state, step=2)
        assert not any(info.get("reused") for info in files_of(mgr.path(2)).values())
    assert_same(fc.restore(tmp_path / "run" / "step_000000002"), state)


@pytest.mark.parametrize("async_save", [False, True])
def test_manager_chains_saves_and_retention_never_breaks_a_kept_one(
    tmp_path: Path, async_save: bool
) -> None:
    state = make_state()
    saved: dict[int, dict[str, torch.Tensor]] = {}
    with fc.CheckpointManager(
        tmp_path / "run",
        keep=fc.keep_last(2),
        tiers=(fc.manager.Disk(incremental=True),),
        async_save=async_save,
    ) as mgr:
        for step in range(1, 6):
            train(state, step)
            mgr.maybe_save(state, step=step)
            mgr.wait_staged()
            saved[step] = {k: v.clone() for k, v in state["model"].items()}
        mgr.wait()
        assert mgr.steps() == [4, 5]
        for step in (4, 5):
            files = files_of(mgr.path(step))
            assert any(info.get("reused") for info in files.values())
            back = fc.restore(mgr.path(step))
            for k, v in saved[step].items():
                assert torch.equal(back["model", k], v)
            assert fc.verify(mgr.path(step)).ok
        # steps 1-3 are gone; the frozen bytes written at step 1 live on in 4 and 5
        frozen = [mgr.path(s) / n for s in (4, 5) for n, i in files_of(mgr.path(s)).items()]
        inodes = {os.stat(p).st_ino for p in frozen if files_of(p.parent)[p.name].get("reused")}
        assert len(inodes) == 1


def test_fork_shares_the_source_files(tmp_path: Path) -> None:
    state = make_state()
    src = tmp_path / "run" / "step_000000007"
    fc.save(src, {**state, "step": 7})
    forked = fc.manager.fork(src, tmp_path / "fork")
    assert os.stat(forked / "__0_1.distcp").st_ino == os.stat(src / "__0_0.distcp").st_ino
    # nothing changed: no tensor is written again, only the values for stock DCP readers
    manifest = committed.read_manifest(forked)
    chunks = [c for e in manifest["entries"] for c in e.get("chunks", ())]
    own = [c for c in chunks if c["file"] == "__0_0.distcp"]
    assert own == [] and (forked / "__0_0.distcp").stat().st_size < 4096
    shutil.rmtree(src)
    assert_same(fc.restore(forked), {**state, "step": 7})


KILLER = """
import sys, torch, functional_ckpt as fc
from pathlib import Path
root = Path(sys.argv[1])
base = {"w%d" % i: torch.full((1 << 18,), 1.0) for i in range(8)}
fc.save(root / "base", base)
print("ready", flush=True)
v = 1
while True:
    v += 1
    state = dict(base, changed=torch.full((1 << 18,), float(v)))
    fc.save(root / ("ck%06d" % v), state, base=root / "base")
"""


def test_sigkill_during_incremental_saves_leaves_the_base_intact(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for trial, delay in enumerate((0.7,)):  # saves run back to back: the kill lands in one
        root = tmp_path / f"t{trial}"
        root.mkdir()
        proc = prefork.Popen(
            [sys.executable, "-c", KILLER, str(root)], stdout=subprocess.PIPE, env=env
        )
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert fc.verify(root / "base").ok
        back = fc.restore(root / "base")
        assert all(
            bool((t == 1.0).all()) for t in back.values(include_nested=True, leaves_only=True)
        )
        for p in root.iterdir():
            if naming.is_temporary_name(p.name):
                with pytest.raises(fc.errors.IncompleteCheckpoint):
                    fc.restore(p)
            elif p.name != "base":
                v = float(p.name[2:])
                got = fc.restore(p)
                assert bool((got["changed"] == v).all()) and bool((got["w0"] == 1.0).all())
        newest = max((p for p in root.iterdir() if p.name.startswith("ck")), default=None)
        if newest is not None and not naming.is_temporary_name(newest.name):
            assert fc.verify(newest).ok


# --------------------------------------------------------------------------- trust memory


def _count_comparisons(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = incremental._stored_equals

    def counted(*args: Any) -> bool:
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(incremental, "_stored_equals", counted)
    return calls


def test_a_plain_save_feeds_the_trust_of_the_next_incremental_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fc.save(a) then fc.save(b, base=a) in one process compares no byte of a."""
    from functional_ckpt._src.save.staging import PROCESS_TRUST

    state = make_state()
    calls = _count_comparisons(monkeypatch)
    fc.save(tmp_path / "a", state)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    assert calls == []  # this process wrote a's files: trusted, no comparison
    assert fc.inspect(tmp_path / "b").shared_bytes > 0
    PROCESS_TRUST.clear()  # as if another process had written c
    fc.save(tmp_path / "c", state, base=tmp_path / "b")
    assert len(calls) == 5  # every shared chunk compared byte for byte
    assert fc.inspect(tmp_path / "c").shared_bytes > 0  # compared, equal, shared
    for name in "abc":
        assert fc.verify(tmp_path / name).ok


def test_a_trusted_file_changed_since_is_compared_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = make_state()
    fc.save(tmp_path / "a", state)
    shard = tmp_path / "a" / "__0_0.distcp"
    os.utime(shard, ns=(1, 1))  # not the file this process left (its mtime differs)
    calls = _count_comparisons(monkeypatch)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    assert calls  # no longer trusted: every shared chunk was compared byte for byte


def test_the_manager_owns_its_trust_memory(tmp_path: Path) -> None:
    from functional_ckpt._src.save.staging import PROCESS_TRUST

    one = fc.CheckpointManager(tmp_path / "run", tiers=(fc.manager.Disk(incremental=True),))
    two = fc.CheckpointManager(tmp_path / "other", tiers=(fc.manager.Disk(incremental=True),))
    with one, two:
        assert one._writes.trust is not two._writes.trust
        assert one._writes.trust is not PROCESS_TRUST


def test_the_bytes_a_reused_file_holds_for_its_base_only_are_neither_read_nor_checked(
    tmp_path: Path,
) -> None:
    """What docs/format.md says of the coverage, shown: a byte flipped in a reused file,
    inside the base's tensor that changed since, changes neither fc.verify nor the
    restored state (this checkpoint never names, reads or checks those bytes)."""
    state = make_state()
    fc.save(tmp_path / "a", state)
    old = vetted_view(tmp_path / "a").tensors[("model", "head")].chunks[0]
    train(state, 1)
    fc.save(tmp_path / "b", state, base=tmp_path / "a")
    assert files_of(tmp_path / "b")["__0_1.distcp"]["reused"] and old.file == "__0_0.distcp"
    shutil.rmtree(tmp_path / "a")
    with open(tmp_path / "b" / "__0_1.distcp", "r+b") as f:  # the base's old head
        f.seek(old.data_offset + old.nbytes // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))
    assert fc.verify(tmp_path / "b").ok
    assert_same(fc.restore(tmp_path / "b"), state)
