"""Save a whole training state, restore it into fresh objects, and check it is exact.

Run: python examples/quickstart.py [DIR]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import functional_ckpt as fc


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
    return model, opt, sched


def main() -> None:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp())
    torch.manual_seed(0)
    model, opt, sched = make()
    for _ in range(5):
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()

    state = fc.capture(model=model, optimizer=opt, scheduler=sched, step=5)
    info = fc.save(root / "step_5", state, metadata={"experiment": "quickstart"})
    print(f"saved {info.num_tensors} tensors, {info.nbytes} bytes in {info.duration:.3f} s")
    print(fc.inspect(root / "step_5"))

    model2, opt2, sched2 = make()  # fresh objects, as after a restart
    template = fc.capture(model=model2, optimizer=opt2, scheduler=sched2, step=0)
    restored = fc.restore(root / "step_5", template)
    fc.apply(restored, model=model2, optimizer=opt2, scheduler=sched2)

    same = all(
        torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters(), strict=True)
    )
    print(f"step={restored['step']} parameters identical: {same}")
    print(f"verify: {fc.verify(root / 'step_5').ok}")


if __name__ == "__main__":
    main()
