"""accelerate: a prepared model, optimizer, scheduler and stateful loader resume bit-identically.

A real ``Accelerator(cpu=True)`` prepares everything, the loop shuffles and draws
random numbers (dropout) every step; stopped mid-epoch at step 5, saved with
``fc.save`` (no ``save_state``, so no pickles), restored into fresh objects and
resumed with ``iter_resumed``, it must see the same batches and losses, the next
epoch included, and end with the same weights as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration
from torchdata.stateful_dataloader import StatefulDataLoader

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt.errors import TemplateMismatch
from functional_ckpt.integrations import accelerate as fc_accelerate

STEPS, STOP = 12, 5  # 4 batches an epoch


def setup(seed: int) -> tuple[Accelerator, Any, Any, Any, Any]:
    torch.manual_seed(seed)
    accelerator = Accelerator(
        cpu=True, dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)
    )
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, 3)
    data = [torch.full((3,), float(i)) for i in range(16)]
    loader = StatefulDataLoader(data, batch_size=4, shuffle=True)
    return accelerator, *accelerator.prepare(model, opt, loader, sched)


def train(
    acc: Accelerator, model: Any, opt: Any, loader: Any, sched: Any, log: list[Any], stop: int,
    it: Iterator[Any] | None = None,
) -> None:  # fmt: skip
    while len(log) < stop:
        for batch in iter(loader) if it is None else it:
            loss = model(batch).pow(2).mean()
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            log.append((batch[:, 0].tolist(), loss.item()))
            if len(log) == stop:
                return
        it = None


def test_prepared_objects_resume_bit_identically(tmp_path: Path) -> None:
    acc, model_full, *rest = setup(0)
    full: list[Any] = []
    train(acc, model_full, *rest, full, STEPS)

    acc, model, opt, loader, sched = setup(0)
    log: list[Any] = []
    train(acc, model, opt, loader, sched, log, STOP)
    acc.step = 7  # the accumulation counter travels too
    state = fc_accelerate.capture(acc, model=model, optimizer=opt, scheduler=sched, loader=loader)
    fc.save(tmp_path / "ck", state)
    assert {p.name for p in (tmp_path / "ck").iterdir()} <= {
        naming.COMMIT_MARKER, naming.MANIFEST, naming.DCP_METADATA, "__0_0.distcp"
    }  # fmt: skip

    acc, model, opt, loader, sched = setup(1)
    like = fc_accelerate.capture(acc, model=model, optimizer=opt, scheduler=sched, loader=loader)
    restored = fc.restore(tmp_path / "ck", like=like)
    it = fc_accelerate.iter_resumed(
        acc, restored, loader, model=model, optimizer=opt, scheduler=sched
    )
    assert acc.step == 7
    resumed = list(log)
    train(acc, model, opt, loader, sched, resumed, STEPS, it)
    assert resumed == full
    for a, b in zip(model_full.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(TemplateMismatch, match="accelerator"):
        fc_accelerate.apply(acc, fc.capture(model=model), model=model)
