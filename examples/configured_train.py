"""A training loop configured from a file: the manager, its policies and retries as data.

Run: fckpt run --config examples/config.yaml -- python examples/configured_train.py \\
         examples/config.yaml [ROOT]

The config (YAML with PyYAML installed, else JSON) builds the manager with no code in
between; ``ROOT`` replaces its ``root``. Three epochs of 40 steps: the loop marks the
last step of each epoch (``epoch_end=True``), where the export policy writes weights,
and resumes where a crash left it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

import functional_ckpt as fc

EPOCHS, STEPS_PER_EPOCH = 3, 40


def load(path: Path) -> Any:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # type: ignore[import-untyped, unused-ignore]

        return yaml.safe_load(text)
    return json.loads(text)


def main() -> None:
    cfg = load(Path(sys.argv[1]))
    overrides = {"root": sys.argv[2]} if len(sys.argv) > 2 else {}
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    # The run's configuration goes into every checkpoint's metadata.
    with fc.CheckpointManager.from_config(cfg, metadata={"config": cfg}, **overrides) as mgr:
        state = fc.capture(model=model, optimizer=opt, step=0)
        restored = mgr.restore_latest(like=state)
        if restored is not None:
            fc.apply(restored, model=model, optimizer=opt)
        step = 0 if restored is None else int(restored["step"])
        total = EPOCHS * STEPS_PER_EPOCH
        while step < total:
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            mgr.maybe_save(
                fc.capture(model=model, optimizer=opt, step=step),
                step=step,
                epoch=(step - 1) // STEPS_PER_EPOCH,  # 0-based; 1-based would do as well
                epoch_end=step % STEPS_PER_EPOCH == 0,
                metrics={"loss": loss.item()},
                is_final=step == total,
            )
    print(f"trained to step {step}")


if __name__ == "__main__":
    main()
