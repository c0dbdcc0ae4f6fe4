"""torchdata StatefulDataLoader: a run interrupted mid-epoch resumes bit-identically.

The loop shuffles (the sampler seeds itself from the global generator when the
iterator is created) and draws random numbers every step (dropout and an
explicit ``torch.randn``). Interrupted at step 7 (of 5-batch epochs), saved,
restored into fresh objects and resumed with ``iter_resumed``, it must see the
same batches and draws and end with the same weights as an uninterrupted run.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import functional_ckpt as fc
from functional_ckpt.errors import TemplateMismatch
from functional_ckpt.integrations.torchdata import iter_resumed

STEPS, STOP = 15, 7


def setup(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, StatefulDataLoader[Any]]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    data = [torch.full((3,), float(i)) for i in range(20)]
    return (
        model,
        torch.optim.AdamW(model.parameters(), lr=0.01),
        StatefulDataLoader(data, batch_size=4, shuffle=True),
    )


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    loader: StatefulDataLoader[Any],
    log: list[Any],
    stop: int,
    it: Iterator[Any] | None = None,
) -> None:
    """Train until ``len(log) == stop``, finishing ``it`` (a started epoch) first."""
    while len(log) < stop:
        for batch in iter(loader) if it is None else it:
            noise = torch.randn(())
            loss = (model(batch) + noise).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            log.append((batch[:, 0].tolist(), noise.item(), loss.item()))
            if len(log) == stop:
                return
        it = None


def test_interrupted_mid_epoch_resumes_bit_identically(tmp_path: Path) -> None:
    model_full, opt, loader = setup(0)
    full: list[Any] = []
    train(model_full, opt, loader, full, STEPS)

    model, opt, loader = setup(0)
    log: list[Any] = []
    train(model, opt, loader, log, STOP)
    fc.save(tmp_path / "ck", fc.capture(model=model, optimizer=opt, loader=loader, step=STOP))
    assert log == full[:STOP]

    def resume(order: str) -> tuple[list[Any], torch.nn.Module]:
        model, opt, loader = setup(1)  # another process: other weights, other generator states
        like = fc.capture(model=model, optimizer=opt, loader=loader, step=0)
        state = fc.restore(tmp_path / "ck", like=like)
        if order == "recipe":
            it = iter_resumed(state, loader, model=model, optimizer=opt)
        else:  # generators first, then the iterator draws its seed from them
            fc.apply(state, model=model, optimizer=opt, loader=loader)
            it = iter(loader)
        rest = list(log)
        train(model, opt, loader, rest, STEPS, it)
        return rest, model

    resumed, model_resumed = resume("recipe")
    assert resumed == full
    for a, b in zip(model_full.parameters(), model_resumed.parameters(), strict=True):
        assert torch.equal(a, b)

    naive, _ = resume("naive")
    batches = [b for b, _, _ in naive]
    assert batches == [b for b, _, _ in full]  # the loader's own position is restored either way
    assert [n for _, n, _ in naive][STOP:] != [n for _, n, _ in full][STOP:]  # draws shift by one


def test_a_state_without_generators_is_refused_unless_asked() -> None:
    _, _, loader = setup(0)
    it = iter(loader)
    next(it)
    no_rng = fc.capture(loader=loader, rng=False)
    _, _, fresh = setup(1)
    with pytest.raises(TemplateMismatch, match=r"no 'rng'.*rng=False"):
        iter_resumed(no_rng, fresh)
    assert fresh.state_dict()["_num_yielded"] == 0  # refused before anything was applied
    rest = [b[:, 0].tolist() for b in iter_resumed(no_rng, fresh, rng=False)]
    assert rest == [b[:, 0].tolist() for b in it]
