"""Async saves: what blocks, what is refused, how failures surface, flat memory."""

from __future__ import annotations

import errno
import gc
import os
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.storage import shards


def big_state(n: int = 40, numel: int = 1 << 20) -> dict[str, Any]:
    return {"w": {f"t{i}": torch.full((numel,), float(i)) for i in range(n)}, "step": 1}


@pytest.mark.parametrize("staging", ["copy", "write"])
def test_mutation_after_wait_staged_is_not_in_the_checkpoint(tmp_path: Path, staging: str) -> None:
    state = big_state()
    pending = fc.save_async(tmp_path / "ck", state, staging=staging)  # type: ignore[arg-type]
    pending.wait_staged()
    for t in state["w"].values():
        t.add_(1000.0)  # the loop's optimizer step
    info = pending.result()
    assert info.path == tmp_path / "ck" and pending.done() and pending.exception() is None
    back = fc.restore(tmp_path / "ck")
    for i in range(40):
        assert bool((back["w", f"t{i}"] == float(i)).all())


def test_staging_none_refuses_a_torn_checkpoint(tmp_path: Path) -> None:
    state = big_state()
    pending = fc.save_async(tmp_path / "ck", state, staging="none")
    pending.wait_staged()  # returns at once: nothing is copied
    state["w"]["t39"].mul_(2.0)  # violates the promise while the write runs
    with pytest.raises(fc.errors.ModifiedDuringSave, match="'t39'") as e:
        pending.result()
    assert isinstance(e.value, fc.CheckpointError)
    assert not (tmp_path / "ck").exists()
    assert os.listdir(tmp_path) == []  # the temporary directory is gone too


def test_staging_none_without_mutation_commits_identical_bytes(tmp_path: Path) -> None:
    state = big_state(8)
    fc.save_async(tmp_path / "a", state, staging="none").result()
    fc.save(tmp_path / "b", state)
    a, b = fc.restore(tmp_path / "a"), fc.restore(tmp_path / "b")
    for i in range(8):
        assert torch.equal(a["w", f"t{i}"], b["w", f"t{i}"])
    assert fc.verify(tmp_path / "a").ok


def test_background_failure_surfaces_on_result(tmp_path: Path, monkeypatch: Any) -> None:
    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_shard", disk_full)
    pending = fc.save_async(tmp_path / "ck", big_state(2))
    with pytest.raises(fc.CheckpointError, match="no space left"):
        pending.result()
    assert isinstance(pending.exception(), fc.CheckpointError)
    assert os.listdir(tmp_path) == []


def test_bad_input_raises_at_the_call(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"a": torch.zeros(1)})
    with pytest.raises(fc.errors.CheckpointExists):
        fc.save_async(tmp_path / "ck", {"a": torch.zeros(1)})
    with pytest.raises(fc.errors.UnsupportedValue, match="'bad'"):
        fc.save_async(tmp_path / "x", {"bad": object()})
    with pytest.raises(ValueError, match=r"staging='maybe'\): expected one of 'copy', 'write'"):
        fc.save_async(tmp_path / "y", {"a": torch.zeros(1)}, staging="maybe")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AsyncSave\(staging='maybe'\): expected one of"):
        fc.manager.AsyncSave("maybe")  # type: ignore[arg-type]


def test_staging_write_copies_nothing_and_is_staged_once_the_files_hold_every_byte(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """``write`` reads the live tensors into the files: no buffers, and staged only once
    the last byte is written and checksummed (never while the write still reads)."""
    state = big_state(8)
    stager = fc.checkpoint.Stager()
    seen: list[bool] = []
    original = shards.write_shard

    def watched(*args: Any, **kwargs: Any) -> Any:
        out = original(*args, **kwargs)
        seen.append(pending_box[0]._staged.is_set())  # not staged while tensors are read
        return out

    pending_box: list[Any] = []
    monkeypatch.setattr(shards, "write_shard", watched)
    started = fc.save_async(tmp_path / "ck", state, staging="write", stager=stager)
    pending_box.append(started)
    started.wait_staged()
    assert seen == [False]
    for t in state["w"].values():
        t.zero_()
    started.result()
    assert stager.allocations == 0 and stager.nbytes == 0
    back = fc.restore(tmp_path / "ck")
    assert all(bool((back["w", f"t{i}"] == float(i)).all()) for i in range(8))
    assert fc.verify(tmp_path / "ck").ok


def test_staging_write_failure_still_releases_the_caller(tmp_path: Path, monkeypatch: Any) -> None:
    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_shard", disk_full)
    pending = fc.save_async(tmp_path / "ck", big_state(2), staging="write")
    pending.wait_staged()  # a failed write is staged too: the caller goes on
    with pytest.raises(fc.CheckpointError, match="no space left"):
        pending.result()
    assert os.listdir(tmp_path) == []


def test_staging_buffers_are_reused_and_memory_stays_flat(tmp_path: Path) -> None:
    stager = fc.checkpoint.Stager()
    state = big_state(16, 1 << 17)  # 8 MiB
    proc = psutil.Process()

    def one(i: int) -> None:
        fc.save_async(tmp_path / "ck", state, overwrite=True, stager=stager).result()

    for i in range(20):
        one(i)
    gc.collect()
    rss0 = proc.memory_info().rss
    for i in range(200):
        one(i)
    gc.collect()
    growth = proc.memory_info().rss - rss0
    assert stager.allocations == 1
    assert growth < 24 << 20, f"RSS grew by {growth >> 20} MiB over 200 saves"


def test_stager_reallocates_when_shapes_change(tmp_path: Path) -> None:
    stager = fc.checkpoint.Stager()
    fc.save_async(tmp_path / "a", {"w": torch.ones(4)}, stager=stager).result()
    fc.save_async(tmp_path / "b", {"w": torch.ones(5)}, stager=stager).result()
    assert stager.allocations == 2
    assert torch.equal(fc.restore(tmp_path / "b")["w"], torch.ones(5))


def test_staging_copies_a_state_of_many_tensors_in_parallel_exactly(tmp_path: Path) -> None:
    # Past 8 MiB the host copies are split over threads: mixed sizes and dtypes, a
    # non-contiguous view, every byte staged before wait_staged() returns.
    gen = torch.Generator().manual_seed(3)
    state: dict[str, torch.Tensor] = {
        f"w{i}": torch.randn(1 << (10 + i % 8), generator=gen) for i in range(300)
    }
    state["big"] = torch.randn(1 << 22, generator=gen)
    state["half"] = torch.randn(64, 1024, generator=gen).half().t()
    state["ints"] = torch.arange(1 << 16)
    expected = {k: v.clone() for k, v in state.items()}
    pending = fc.save_async(tmp_path / "ck", state)
    pending.wait_staged()
    for t in state.values():
        t.zero_()
    pending.result()
    back = fc.restore(tmp_path / "ck")
    for k, v in expected.items():
        assert torch.equal(back[k], v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_staging_uses_pinned_buffers(tmp_path: Path) -> None:
    state = {"w": torch.randn(1 << 20, device="cuda"), "b": torch.arange(10, device="cuda")}
    expected = {k: v.cpu() for k, v in state.items()}
    stager = fc.checkpoint.Stager()
    pending = fc.save_async(tmp_path / "ck", state, stager=stager)
    pending.wait_staged()
    state["w"].add_(1.0)
    pending.result()
    back = fc.restore(tmp_path / "ck")
    assert torch.equal(back["w"], expected["w"]) and torch.equal(back["b"], expected["b"])
    assert all(b.is_pinned() for b in stager._buffers)


def test_manager_async_failure_surfaces_on_the_next_call(tmp_path: Path, monkeypatch: Any) -> None:
    mgr = fc.CheckpointManager(tmp_path / "run", fc.every_steps(1), async_save=True)
    mgr.maybe_save(big_state(2), step=1)
    mgr.wait()
    real = shards.write_shard

    def disk_full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shards, "write_shard", disk_full)
    assert mgr.maybe_save(big_state(2), step=2)  # starts; fails in the background
    assert mgr._writes.pending is not None
    mgr._writes.pending.exception()  # let it finish
    with pytest.raises(fc.CheckpointError, match="no space left"):
        mgr.maybe_save(big_state(2), step=3)
    monkeypatch.setattr(shards, "write_shard", real)
    assert mgr.maybe_save(big_state(2), step=3)  # training continues
    mgr.close()
    assert fc.CheckpointManager(tmp_path / "run", read_only=True).steps() == [1, 3]


def test_manager_async_close_raises_a_pending_failure(tmp_path: Path, monkeypatch: Any) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("writer exploded")

    monkeypatch.setattr(shards, "write_shard", boom)
    mgr = fc.CheckpointManager(tmp_path / "run", fc.every_steps(1), async_save=True)
    mgr.maybe_save(big_state(2), step=1)
    with pytest.raises(RuntimeError, match="writer exploded"):
        mgr.close()


@pytest.mark.parametrize("staging", ["copy", "write"])
def test_manager_wait_staged_then_mutate(tmp_path: Path, staging: str) -> None:
    state = big_state(8)
    with fc.CheckpointManager(
        tmp_path / "run",
        fc.every_steps(2),
        fc.keep_last(2),
        async_save=fc.manager.AsyncSave(staging),  # type: ignore[arg-type]
    ) as mgr:
        for step in range(1, 9):
            mgr.maybe_save(state, step=step)
            mgr.wait_staged()
            for t in state["w"].values():
                t.add_(1.0)  # the optimizer step, right after wait_staged
    steps = fc.CheckpointManager(tmp_path / "run", read_only=True).steps()
    assert steps == [6, 8]
    back = fc.restore(tmp_path / "run" / "step_000000008")
    # values at step 8 were i + 7 (seven increments happened before the save at step 8)
    assert all(bool((back["w", f"t{i}"] == float(i + 7)).all()) for i in range(8))


def test_an_async_save_holds_the_values_as_they_were_at_the_call(tmp_path: Path) -> None:
    """Values are encoded when the save is started: a later in-place change is not saved."""
    config = {"lr": [0.1, 0.2], "name": "a"}
    stager = fc.checkpoint.Stager()
    pending = fc.save_async(tmp_path / "ck", {"w": torch.ones(1 << 20), "config": config},
                            stager=stager)  # fmt: skip
    config["lr"].append(0.3)  # the loop goes on and changes its own dict
    config["name"] = "b"
    pending.result()
    back = fc.codec.to_python(fc.restore(tmp_path / "ck")["config"])
    assert back == {"lr": [0.1, 0.2], "name": "a"}
    assert fc.verify(tmp_path / "ck").ok
