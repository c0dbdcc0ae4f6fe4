"""A functional training loop: the state is a value, and each step returns a new one.

Parameters and Adam moments are TensorDicts (``TensorDict.from_module``); a step is
a pure function ``state -> state`` built on ``torch.func.functional_call`` and
``torch.func.grad``, so no tensor is ever modified in place. That is what lets
``fc.save_async(..., staging="none")`` write the live tensors without copying them:
the next step makes new tensors instead of overwriting the ones being saved (and
if something did write them, the save would be refused, not torn).

Run: python examples/functional_loop.py RUN_DIR [--steps 200] [--every 20] [--sleep 0]

It resumes from the newest checkpoint in RUN_DIR if there is one
(``state = fc.restore(path, like)``) and writes RUN_DIR/final at the end. Killed at
any moment (even mid-save) and started again, it ends with the same bits as a run
that was never interrupted. ``--sleep`` slows each step down, so that there is time
to kill it mid-run.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from tensordict import TensorDict
from torch.func import functional_call, grad

import functional_ckpt as fc

LR, B1, B2, EPS = 1e-2, 0.9, 0.999, 1e-8


def make_model() -> torch.nn.Module:
    """The architecture; its own parameters only seed the initial state."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def init_state(model: torch.nn.Module) -> TensorDict:
    """Step 0: the model's parameters and zero Adam moments, as one locked TensorDict."""
    params = TensorDict.from_module(model).detach().clone()
    adam = {"m": torch.zeros_like(params), "v": torch.zeros_like(params)}
    return TensorDict(
        {"params": params, "adam": adam, "step": torch.tensor(0)}, batch_size=[]
    ).lock_()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of a step depends on the step alone, so a resumed run sees the same."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(64, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model: torch.nn.Module, state: TensorDict) -> TensorDict:
    """One Adam step, out of place: a new state; ``state`` is left as it was."""

    def loss(params: TensorDict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = functional_call(model, params.flatten_keys(".").to_dict(), (x,))
        return (out - y).pow(2).mean()

    step = int(state["step"]) + 1
    grads = grad(loss)(state["params"], *batch(step))
    m = state["adam", "m"].apply(lambda m, g: m * B1 + g * (1 - B1), grads)
    v = state["adam", "v"].apply(lambda v, g: v * B2 + g * g * (1 - B2), grads)
    c1, c2 = 1 - B1**step, 1 - B2**step
    params = state["params"].apply(
        lambda p, m, v: p - LR * (m / c1) / ((v / c2).sqrt() + EPS), m, v
    )
    return TensorDict(
        {"params": params, "adam": {"m": m, "v": v}, "step": torch.tensor(step)}, batch_size=[]
    ).lock_()


def newest_checkpoint(root: Path) -> Path | None:
    """The newest ``step_N`` directory; saves cut short by a kill are never visible."""
    steps = [p for p in root.glob("step_*") if p.name.removeprefix("step_").isdigit()]
    return max(steps, default=None)


def run(root: Path, steps: int, every: int, sleep: float = 0.0) -> TensorDict:
    torch.set_num_threads(1)  # the same reduction order in every process
    model = make_model()
    like = init_state(model)
    newest = newest_checkpoint(root)
    state = like if newest is None else fc.restore(newest, like)
    print(f"start at step {int(state['step'])} (from {newest})", flush=True)
    pending = None
    while int(state["step"]) < steps:
        state = train_step(model, state)
        step = int(state["step"])
        if step % every == 0:
            if pending is not None:
                print(f"committed {pending.result().path.name}", flush=True)
            # No copy: this state's tensors are never written again.
            pending = fc.save_async(root / f"step_{step:06d}", state, staging="none")
        time.sleep(sleep)
    if pending is not None:
        print(f"committed {pending.result().path.name}", flush=True)
    fc.save(root / "final", state, overwrite=True)
    print(f"done at step {int(state['step'])}", flush=True)
    return state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--sleep", type=float, default=0.0)
    args = parser.parse_args()
    run(args.root, args.steps, args.every, args.sleep)


if __name__ == "__main__":
    main()
