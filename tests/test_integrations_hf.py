"""Hugging Face Trainer with FunctionalTrainerMixin: real Trainer runs, resumed bit-identically.

A tiny GPT-2 (dropout on, so every step draws random numbers) trains for 10 steps
with a linear schedule and checkpoints every 4 steps (6 steps an epoch: both
checkpoints are mid-epoch). A second run is stopped at step 4, and a third,
built from a differently initialised model, resumes from its checkpoint with
``train(resume_from_checkpoint=True)`` and must end where the uninterrupted run
ended, loss for loss and bit for bit.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import functional_ckpt as fc
import functional_ckpt.integrations.hf as fc_hf
from functional_ckpt._src.format import naming
from functional_ckpt.integrations.hf import (
    FunctionalTrainer,
    is_stock_checkpoint,
    load_trainer_checkpoint,
)

OUR_FILES = {naming.COMMIT_MARKER, naming.MANIFEST, naming.DCP_METADATA}


class StopAt(TrainerCallback):
    """Ends training after ``step`` as a crash would (its checkpoint is written first)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_training_stop = True


def trainer(
    out: Path, init_seed: int, stop: int | None = None, cls: type[Trainer] = FunctionalTrainer
) -> Any:
    torch.manual_seed(init_seed)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    )
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 64, (12, 8), generator=g)
    args = TrainingArguments(
        str(out),
        max_steps=10,
        per_device_train_batch_size=2,
        save_steps=4,
        save_total_limit=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=7,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
    )
    return cls(
        model=model,
        args=args,
        train_dataset=[{"input_ids": r, "labels": r} for r in rows],
        callbacks=[StopAt(stop)] if stop is not None else None,
    )


def losses(t: Trainer) -> list[float]:
    return [h["loss"] for h in t.state.log_history if "loss" in h]


def test_train_stop_resume_bit_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    removed: list[Path] = []
    real_remove = fc_hf.remove_checkpoint

    def spy(path: Path, **kwargs: Any) -> None:
        removed.append(Path(path))
        real_remove(path, **kwargs)

    monkeypatch.setattr(fc_hf, "remove_checkpoint", spy)

    full = trainer(tmp_path / "full", init_seed=0)
    full.train()
    # save_total_limit=2: step 4 went, through the crash-safe delete.
    assert removed == [tmp_path / "full" / "checkpoint-4"]
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-10", "checkpoint-8"]

    out = tmp_path / "run"
    trainer(out, init_seed=0, stop=4).train()
    assert os.listdir(out) == ["checkpoint-4"]
    saved = load_trainer_checkpoint(out / "checkpoint-4")
    assert saved["trainer_state"]["global_step"] == 4
    assert saved["optimizer"]["state"] and set(saved["rng"]) >= {"torch", "numpy", "python"}

    resumed = trainer(out, init_seed=1)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == full.state.global_step == 10
    assert losses(resumed) == losses(full)
    for (name, a), (_, b) in zip(
        full.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()

    # Nothing but checkpoints of this format: no optimizer.pt, rng_state.pth,
    # training_args.bin or trainer_state.json beside them.
    for root in (tmp_path / "full", out):
        for ckpt in root.iterdir():
            assert fc.verify(ckpt).ok
            names = set(os.listdir(ckpt))
            assert names - OUR_FILES == {n for n in names if n.endswith(".distcp")}, names


def test_resume_needs_a_checkpoint_of_this_format(tmp_path: Path) -> None:
    t = trainer(tmp_path / "empty", init_seed=0)
    with pytest.raises(fc.errors.CheckpointNotFound, match="no checkpoint-N"):
        t.train(resume_from_checkpoint=True)
    fc.save(tmp_path / "other", {"w": torch.zeros(2)})
    with pytest.raises(fc.CheckpointError, match=r"not a Trainer checkpoint.*'model'"):
        t.train(resume_from_checkpoint=str(tmp_path / "other"))


def test_best_model_at_end_and_weights_only_checkpoints(tmp_path: Path) -> None:
    t = trainer(tmp_path / "best", init_seed=0)
    t.args.eval_strategy = t.args.save_strategy
    t.args.eval_steps, t.args.max_steps = 4, 8
    t.args.save_only_model = t.args.load_best_model_at_end = True
    t.args.metric_for_best_model, t.args.greater_is_better = "eval_loss", True
    t.eval_dataset = t.train_dataset
    t.train()
    # The loss falls, so the "best" (highest) is the first: its weights, not the last ones.
    assert t.state.best_model_checkpoint == str(tmp_path / "best" / "checkpoint-4")
    best = load_trainer_checkpoint(tmp_path / "best" / "checkpoint-4")
    last = load_trainer_checkpoint(tmp_path / "best" / "checkpoint-8")
    assert set(best) == {"model", "trainer_state"}  # save_only_model: weights to load
    for name, value in t.model.state_dict().items():
        assert torch.equal(value, best["model"][name]), name
    assert not torch.equal(best["model"]["lm_head.weight"], last["model"]["lm_head.weight"])
    with pytest.raises(fc.CheckpointError, match="save_only_model"):
        trainer(tmp_path / "best", init_seed=0).train(resume_from_checkpoint=True)


def test_a_stock_trainer_run_continues_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    full = trainer(tmp_path / "full", init_seed=0, cls=Trainer)
    full.train()
    out = tmp_path / "run"
    trainer(out, init_seed=0, stop=4, cls=Trainer).train()  # the stock Trainer's files
    stock = out / "checkpoint-4"
    assert {"optimizer.pt", "rng_state.pth", "trainer_state.json"} <= set(os.listdir(stock))
    assert is_stock_checkpoint(stock) and not is_stock_checkpoint(tmp_path / "full")

    loads: list[object] = []
    real_load = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        loads.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    resumed = trainer(out, init_seed=1)  # other initial weights: all come from checkpoint-4
    resumed.train(resume_from_checkpoint=True)
    monkeypatch.undo()
    assert loads and all(w is True for w in loads)  # nothing unpickled but plain data

    # As a stock resume: every loss, weight and optimizer moment of the uninterrupted run.
    assert resumed.state.global_step == full.state.global_step == 10
    assert losses(resumed) == losses(full)
    for (name, a), (_, b) in zip(
        full.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    for a, b in zip(
        full.optimizer.state_dict()["state"].values(),
        resumed.optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.lr_scheduler.state_dict() == full.lr_scheduler.state_dict()

    # Its checkpoints are of this format; save_total_limit=2 counts those, and the
    # stock one it went on from is left as the stock Trainer wrote it.
    assert sorted(os.listdir(out)) == ["checkpoint-10", "checkpoint-4", "checkpoint-8"]
    assert fc.verify(out / "checkpoint-10").ok and is_stock_checkpoint(stock)
    with pytest.raises(fc.CheckpointError, match=r"stock transformers Trainer.*resume_from"):
        load_trainer_checkpoint(stock)

    # One that cannot go on exactly is refused, naming what is missing.
    partial = tmp_path / "partial" / "checkpoint-4"
    shutil.copytree(stock, partial)
    (partial / "optimizer.pt").unlink()
    with pytest.raises(fc.CheckpointError, match=r"stock transformers Trainer.*optimizer\.pt"):
        trainer(tmp_path / "partial", init_seed=0).train(resume_from_checkpoint=True)
