"""A Lightning run with async FunctionalCheckpointIO, stopped inside a save to be SIGKILLed.

``python lightning_job.py ROOT`` trains with a checkpoint every 4 steps and a last
one. At the commit of the second ``last.ckpt`` (the one of step 8) it lets every
other save of step 8 finish first, prints ``ready`` and blocks: the parent kills
it there, with ``last.ckpt.tmp-<id>`` fully written but never committed.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit
from functional_ckpt.integrations.lightning import FunctionalCheckpointIO


class Tiny(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(root: Path, steps: int, ckpt: str | None = None, *, async_save: bool = True) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, 4, generator=g), torch.randn(32, 1, generator=g))
    trainer = L.Trainer(
        max_steps=steps,
        plugins=[FunctionalCheckpointIO(async_save=async_save)],
        callbacks=[
            ModelCheckpoint(dirpath=root, every_n_train_steps=4, save_top_k=-1, save_last=True)
        ],
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), DataLoader(data, batch_size=4), ckpt_path=ckpt)
    return trainer


def main() -> None:
    root = Path(sys.argv[1])
    marker = commit.write_commit_marker
    lasts: list[Path] = []

    def stop_at_second_last(tmp: Path, manifest_bytes: bytes, **kwargs: Any) -> None:
        if naming.base_name(tmp.name) == "last.ckpt":
            lasts.append(tmp)
            if len(lasts) == 2:
                me = threading.current_thread()
                for t in threading.enumerate():
                    if t is not me and t.name.startswith("fc-save:") and "step=8" in t.name:
                        t.join()
                print("ready", flush=True)
                threading.Event().wait()
        marker(tmp, manifest_bytes, **kwargs)

    commit.write_commit_marker = stop_at_second_last  # type: ignore[assignment]
    fit(root, 12)
    print("finished", flush=True)


if __name__ == "__main__":
    main()
