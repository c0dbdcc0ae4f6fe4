"""A small but complete training job used by the crash/resume tests.

Everything that can break bit-identical resumption is in it: dropout (torch RNG),
AdamW (moments and float hyper-parameters), a warm-up LR schedule, a shuffling
loader that resumes mid-epoch, and numpy and python randomness in the step.

Run as a script: ``python tests/training.py ROOT --steps N --save-every K
[--crash-at S]``. It resumes from the newest committed ``ROOT/step_*`` checkpoint,
appends ``step loss.hex()`` lines to ``ROOT/losses.txt`` and writes the final
state to ``ROOT/final``. ``--crash-at S`` SIGKILLs itself right after step S.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

import functional_ckpt as fc


class ShuffleLoader:
    """Reshuffles every epoch from (seed, epoch) and resumes at any position."""

    def __init__(self, data: torch.Tensor, targets: torch.Tensor, batch_size: int, seed: int):
        self.data, self.targets = data, targets
        self.batch_size, self.seed = batch_size, seed
        self.epoch, self.pos = 0, 0

    def _order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return torch.randperm(len(self.data), generator=g)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch_size > len(self.data):
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch_size]
        self.pos += self.batch_size
        return self.data[idx], self.targets[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.pos, self.seed = sd["epoch"], sd["pos"], sd["seed"]


def build(seed: int = 0) -> tuple[torch.nn.Module, Any, Any, ShuffleLoader]:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 4),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    g = torch.Generator().manual_seed(1234)
    data = torch.randn(256, 16, generator=g)
    targets = torch.randint(0, 4, (256,), generator=g)
    return model, opt, sched, ShuffleLoader(data, targets, 32, seed)


def train_step(model: torch.nn.Module, opt: Any, sched: Any, loader: ShuffleLoader) -> float:
    x, y = loader.next_batch()
    x = x + torch.from_numpy(np.random.normal(0, 0.01, size=x.shape).astype(np.float32))
    scale = 1.0 + 0.01 * random.random()
    loss = torch.nn.functional.cross_entropy(model(x), y) * scale
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.item())


def latest(root: Path) -> Path | None:
    done = [p for p in root.glob("step_*") if (p / "COMMITTED").exists() and ".tmp-" not in p.name]
    return max(done, key=lambda p: int(p.name.split("_")[1]), default=None)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root", type=Path)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--crash-at", type=int, default=-1)
    args = ap.parse_args(argv)
    args.root.mkdir(parents=True, exist_ok=True)
    model, opt, sched, loader = build()
    step = 0
    ckpt = latest(args.root)
    if ckpt is not None:
        template = fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=0)
        state = fc.restore(ckpt, template)
        fc.apply(state, model=model, optimizer=opt, scheduler=sched, loader=loader)
        step = state["step"]
    with open(args.root / "losses.txt", "a") as log:
        while step < args.steps:
            loss = train_step(model, opt, sched, loader)
            step += 1
            log.write(f"{step} {loss.hex()}\n")
            log.flush()
            if step % args.save_every == 0:
                state = fc.capture(
                    model=model, optimizer=opt, scheduler=sched, loader=loader, step=step
                )
                fc.save(args.root / f"step_{step:08d}", state)
            if step == args.crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
    final = fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=step)
    fc.save(args.root / "final", final, overwrite=True)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
