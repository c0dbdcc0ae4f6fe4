"""Lightning with FunctionalCheckpointIO: real Trainer runs, resumed bit-identically.

A tiny LightningModule whose hyper-parameters hold a Namespace and a Path trains
with ModelCheckpoint (top-2 by loss, so older checkpoints are pruned); a second
run resumes from the end-of-epoch checkpoint with ``ckpt_path=`` and must end
with the very weights and optimizer state of an uninterrupted run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import importlib.util
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

import functional_ckpt as fc
import functional_ckpt.integrations.lightning as fc_lightning
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt.errors import CheckpointError
from functional_ckpt.integrations.lightning import FunctionalCheckpointIO
from tests import prefork

STEPS_PER_EPOCH = 8
JOB = Path(__file__).with_name("lightning_job.py")


@codec.register
@dataclasses.dataclass(frozen=True)
class Schedule:
    warmup: int
    kind: str


STARTED = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)


class Tiny(L.LightningModule):
    def __init__(
        self, args: argparse.Namespace, out: Path, started: dt.datetime, schedule: Schedule
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=0.05)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 3)}


def loader() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=32 // STEPS_PER_EPOCH)


def fit(
    root: Path, steps: int, io: FunctionalCheckpointIO, ckpt: Path | None = None
) -> tuple[Tiny, L.Trainer]:
    L.seed_everything(0, verbose=False)
    model = Tiny(
        argparse.Namespace(lr=0.05, layers=[4, 1]),
        Path("/data/run"),
        STARTED,
        Schedule(2, "cosine"),
    )
    checkpoints = ModelCheckpoint(
        dirpath=root, every_n_train_steps=4, save_top_k=2, monitor="loss", save_last=True
    )
    trainer = L.Trainer(
        max_steps=steps,
        plugins=[io],
        callbacks=[checkpoints],
        accelerator="cpu",
        logger=False,
        enable_checkpointing=True,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(model, loader(), ckpt_path=ckpt)
    return model, trainer


def _flat(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [x for k in sorted(value, key=repr) for x in [k, *_flat(value[k])]]
    if isinstance(value, list | tuple):
        return [x for v in value for x in _flat(v)]
    return [value]


def _same(a: Any, b: Any) -> bool:
    fa, fb = _flat(a), _flat(b)
    return len(fa) == len(fb) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y
        for x, y in zip(fa, fb, strict=True)
    )


def test_fit_prune_and_resume_bit_identically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    removed: list[Path] = []
    real_remove = fc_lightning.remove_checkpoint

    def spy(path: Path, **kwargs: Any) -> None:
        removed.append(Path(path))
        real_remove(path, **kwargs)

    monkeypatch.setattr(fc_lightning, "remove_checkpoint", spy)

    full, full_trainer = fit(tmp_path / "full", 2 * STEPS_PER_EPOCH, FunctionalCheckpointIO())

    # The interrupted run saves asynchronously; fit's teardown waits for the commits.
    root = tmp_path / "resumed"
    fit(root, STEPS_PER_EPOCH, FunctionalCheckpointIO(async_save=True))
    at_epoch_end = root / f"epoch=0-step={STEPS_PER_EPOCH}.ckpt"
    assert (at_epoch_end / naming.COMMIT_MARKER).is_file()
    loaded = FunctionalCheckpointIO().load_checkpoint(at_epoch_end)
    assert loaded["global_step"] == STEPS_PER_EPOCH
    hparams = loaded["hyper_parameters"]
    assert hparams["args"] == argparse.Namespace(lr=0.05, layers=[4, 1])
    assert hparams["out"] == Path("/data/run") and isinstance(hparams["out"], Path)
    assert hparams["started"] == STARTED
    assert hparams["schedule"] == Schedule(2, "cosine")
    assert all(type(t) is torch.Tensor for t in loaded["state_dict"].values())

    resumed, trainer = fit(root, 2 * STEPS_PER_EPOCH, FunctionalCheckpointIO(), at_epoch_end)
    assert trainer.global_step == full_trainer.global_step == 2 * STEPS_PER_EPOCH
    assert _same(full.state_dict(), resumed.state_dict())
    assert _same(full_trainer.optimizers[0].state_dict(), trainer.optimizers[0].state_dict())
    assert trainer.lr_scheduler_configs[0].scheduler.state_dict() == (
        full_trainer.lr_scheduler_configs[0].scheduler.state_dict()
    )

    # Top-2 by loss, last, and the one resumed from (Lightning never prunes that one):
    # the rest were pruned through the crash-safe delete.
    kept = {p.name for p in root.iterdir()}
    best = {Path(p).name for p in trainer.checkpoint_callback.best_k_models}
    assert kept == best | {"last.ckpt", at_epoch_end.name}
    assert removed and all(not p.exists() for p in removed)
    assert {p.name for p in removed} & {"epoch=0-step=4.ckpt", "epoch=1-step=12.ckpt"}
    assert not any(naming.is_temporary_name(n) for n in os.listdir(root))


def test_async_failures_surface_and_bad_arguments_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def disk_full(path: Path, state: Any, **kwargs: Any) -> CheckpointInfo:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fc_lightning, "save", disk_full)  # on the background thread
    io = FunctionalCheckpointIO(async_save=True)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "a")
    with pytest.raises(OSError, match="No space left"):
        io.teardown()
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "b")
    io._jobs[-1][1].exception()
    with pytest.raises(OSError, match="No space left"):  # the next call raises it
        io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "c")
    io.teardown()
    monkeypatch.undo()

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        FunctionalCheckpointIO().save_checkpoint({"w": torch.zeros(2)}, tmp_path / "taken")
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        io.remove_checkpoint(tmp_path / "taken")
    assert (tmp_path / "taken" / "notes.txt").read_text() == "not a checkpoint"
    fc.save(tmp_path / "kept", {"w": torch.zeros(2)})
    (tmp_path / "last.ckpt").symlink_to("kept")  # what save_last="link" makes
    io.remove_checkpoint(tmp_path / "last.ckpt")
    assert not os.path.lexists(tmp_path / "last.ckpt") and fc.verify(tmp_path / "kept").ok
    with pytest.raises(CheckpointError, match="storage_options"):
        io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "x", storage_options={"a": 1})
    with pytest.raises(CheckpointError, match="map_location"):
        io.load_checkpoint(tmp_path / "x", map_location=lambda s, loc: s)


def lightning_job() -> Any:
    spec = importlib.util.spec_from_file_location("lightning_job", JOB)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("async_save", [False, True])
def test_last_is_committed_before_each_checkpoint_of_its_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, async_save: bool
) -> None:
    order: list[tuple[str, str | None]] = []
    real_save = fc_lightning.save

    def spy(path: Path, state: Any, **kwargs: Any) -> CheckpointInfo:
        base = kwargs.get("base")
        order.append((Path(path).name, None if base is None else Path(base).name))
        return real_save(path, state, **kwargs)

    monkeypatch.setattr(fc_lightning, "save", spy)
    trainer = lightning_job().fit(tmp_path, 12, async_save=async_save)
    assert order == [
        ("epoch=0-step=4.ckpt", None),  # the run's first: no last checkpoint yet
        ("last.ckpt", None),
        ("last.ckpt", None),  # step 8's state, before its own checkpoint
        ("epoch=0-step=8.ckpt", "last.ckpt"),  # sharing last.ckpt's files
        ("last.ckpt", None),  # as Lightning asks
        ("last.ckpt", None),
        ("epoch=1-step=12.ckpt", "last.ckpt"),
        ("last.ckpt", None),
    ]
    trainer.save_checkpoint(tmp_path / "manual.ckpt")  # not ModelCheckpoint's: no last follows
    trainer.strategy.checkpoint_io.teardown()
    assert order[8:] == [("manual.ckpt", None)]
    step = {
        p.name: FunctionalCheckpointIO().load_checkpoint(p)["global_step"]
        for p in tmp_path.iterdir()
    }
    assert step == {
        "manual.ckpt": 12,
        "epoch=0-step=4.ckpt": 4,
        "epoch=0-step=8.ckpt": 8,
        "epoch=1-step=12.ckpt": 12,
        "last.ckpt": 12,
    }


def test_sigkill_during_an_async_save_leaves_last_current_and_no_leftover(
    tmp_path: Path,
) -> None:
    root = tmp_path / "ckpts"
    job = Path(__file__).with_name("lightning_job.py")
    env = {**os.environ, "PYTHONPATH": str(job.parent.parent)}
    proc = prefork.Popen([sys.executable, str(job), str(root)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == b"ready"  # inside the save of step 8
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()

    def step(path: Path) -> int:
        return int(FunctionalCheckpointIO().load_checkpoint(path)["global_step"])

    leftovers = [p for p in root.iterdir() if naming.is_temporary_name(p.name)]
    assert [naming.base_name(p.name) for p in leftovers] == ["last.ckpt"]
    committed = [p for p in root.iterdir() if (p / naming.COMMIT_MARKER).is_file()]
    assert root / "last.ckpt" in committed
    # Whatever the kill interrupted, last.ckpt is as new as every committed checkpoint.
    assert max(step(p) for p in committed) == step(root / "last.ckpt")

    # Files of others that merely look like leftovers are never touched.
    (root / "notes.ckpt.tmp-0123456789ab").mkdir()
    (root / "notes.ckpt.tmp-0123456789ab" / "notes.txt").write_text("mine")
    (root / "link.ckpt.tmp-0123456789ab").symlink_to(root / "last.ckpt")
    # Committed leftovers are never deleted: kept where the name is taken, else put back.
    os.rename(
        fc.save(tmp_path / "a", {"w": 1}).path, root / "epoch=0-step=4.ckpt.trash-0123456789ab"
    )
    os.rename(fc.save(tmp_path / "b", {"w": 2}).path, root / "spare.ckpt.tmp-0123456789ab")

    trainer = lightning_job().fit(root, 12, ckpt="last")  # resumes from last.ckpt, saves again
    assert trainer.global_step == 12
    assert not any(p.exists() for p in leftovers)  # the killed save's copy is gone
    assert (root / "notes.ckpt.tmp-0123456789ab" / "notes.txt").read_text() == "mine"
    assert (root / "link.ckpt.tmp-0123456789ab").is_symlink()
    assert (root / "epoch=0-step=4.ckpt.trash-0123456789ab" / naming.COMMIT_MARKER).is_file()
    assert fc.codec.to_python(fc.restore(root / "spare.ckpt")) == {"w": 2}
    assert step(root / "last.ckpt") == 12


def test_async_saves_refuse_what_save_would_at_the_call(tmp_path: Path) -> None:
    io = FunctionalCheckpointIO(async_save=True)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "taken")
    with pytest.raises(fc.errors.UnsupportedValue, match=r"state\['hp'\]"):
        io.save_checkpoint({"w": torch.zeros(2), "hp": object()}, tmp_path / "a")
    assert not io._jobs and not (tmp_path / "a").exists()
    w = torch.zeros(2)
    io.save_checkpoint({"w": w}, tmp_path / "a")
    w.add_(1)  # training goes on: the save holds the values of the call
    io.teardown()
    assert torch.equal(fc.restore(tmp_path / "a")["w"], torch.zeros(2))
