"""FSDP2 training on CPU (gloo) with asynchronous, sharded, resumable checkpoints.

Run (two ranks on one machine; no GPU needed)::

    torchrun --nproc_per_node=2 examples/distributed_train.py --root /tmp/run
    torchrun --nproc_per_node=2 examples/distributed_train.py --root /tmp/run  # resumes

Each invocation trains ``--steps`` more steps, continuing from the newest
checkpoint in ``--root``. Every rank calls the same manager methods with its own
state: the model and optimizer are FSDP2-sharded (each rank writes its shards),
the step and scheduler are replicated (written once), and each rank's loader
position and random generators are stored per rank. Rank 0 decides when to save
and holds the root's lock; ``async_save=True`` writes in the background while
training continues.

Restarting with a different ``--nproc_per_node`` also works: sharded tensors
reshard on their own, and :func:`reshard_loader` maps the saved per-rank loader
positions and generators onto the new ranks.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import functional_ckpt as fc

SAMPLES, FEATURES, CLASSES = 1024, 16, 4


class ShardedLoader:
    """Each epoch: one shuffle of the dataset, rank ``r`` takes positions ``r::world``.

    Its state is per rank: ``pos`` counts the samples this rank consumed in the
    current epoch; ``rank``/``world`` record the layout the position refers to.
    """

    def __init__(self, batch: int, rank: int, world: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(SAMPLES, FEATURES, generator=g)
        self.y = (self.x[:, :CLASSES] + 0.3 * torch.randn(SAMPLES, CLASSES, generator=g)).argmax(1)
        self.batch, self.rank, self.world, self.seed = batch, rank, world, seed
        self.epoch, self.pos = 0, 0

    def _mine(self) -> torch.Tensor:
        order = torch.randperm(
            SAMPLES, generator=torch.Generator().manual_seed(self.seed + self.epoch)
        )
        return order[self.rank :: self.world]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        mine = self._mine()
        if self.pos + self.batch > len(mine):
            self.epoch, self.pos = self.epoch + 1, 0
            mine = self._mine()
        idx = mine[self.pos : self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "rank": self.rank, "world": self.world}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if (sd["rank"], sd["world"]) != (self.rank, self.world):
            raise ValueError(
                f"loader state of rank {sd['rank']}/{sd['world']} given to rank "
                f"{self.rank}/{self.world}; restore with reshard=reshard_loader"
            )
        self.epoch, self.pos = sd["epoch"], sd["pos"]


def reshard_loader(saved: list[Any], rank: int, world: int) -> dict[str, Any]:
    """Per-rank state saved by ``len(saved)`` ranks, mapped onto rank ``rank`` of ``world``.

    Loader: every saved rank had gone through the first ``pos`` of its own slice
    of the epoch's shuffle, i.e. through the first ``min(pos) * old_world`` samples
    of the shuffle as a whole (the slowest rank bounds what all have seen). The new
    ranks continue from there, each in its new slice: at most ``world - 1`` samples
    are seen twice, none is skipped. Generators: fresh and distinct per new rank.
    """
    old = [fc.codec.to_python(s)["loader"] for s in saved]
    if len({s["epoch"] for s in old}) != 1:
        raise ValueError(f"ranks were in different epochs: {[s['epoch'] for s in old]}")
    start = min(s["pos"] for s in old) * len(old)
    torch.manual_seed(10_000 * (old[0]["epoch"] + 1) + 100 * start + rank)
    rng = fc.codec.to_python(fc.capture())["rng"]  # this process's generators, now reseeded
    loader = {"epoch": old[0]["epoch"], "pos": start // world, "rank": rank, "world": world}
    return {"loader": loader, "rng": rng}


def build(mesh: Any) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)  # the same initial weights on every rank, then sharded
    model = torch.nn.Sequential(
        torch.nn.Linear(FEATURES, 64),
        torch.nn.ReLU(),
        torch.nn.Dropout(0.1),
        torch.nn.Linear(64, CLASSES),
    )
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched


def resume(mgr: fc.CheckpointManager, template: Any, world: int) -> tuple[TensorDict | None, str]:
    """The newest checkpoint, per-rank state resharded if it was saved by another world size."""
    state = mgr.restore_latest(template, reshard=reshard_loader)
    if state is None:
        return None, ""
    saved_world = fc.inspect(mgr.path(mgr.restored_step or 0)).world_size
    return state, f"resumed step {mgr.restored_step} (saved by {saved_world} ranks, now {world})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--root", type=Path, required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, default=20, help="steps to train in this run")
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, opt, sched = build(mesh)
    loader = ShardedLoader(args.batch, rank, world)
    torch.manual_seed(1000 + rank)  # per-rank dropout streams (stored per rank)

    with fc.CheckpointManager(
        args.root,
        fc.every_steps(args.save_every) | fc.on_final(),
        fc.keep_last(2),
        async_save=True,
    ) as mgr:
        step = 0
        # The template is the live state: restoring writes straight into its shards.
        template = fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=0)
        state, how = resume(mgr, template, world)
        if state is not None:
            fc.apply(state, model=model, optimizer=opt, scheduler=sched, loader=loader)
            step = int(state["step"])
            print(f"[rank {rank}] {how}; loader {loader.state_dict()}", flush=True)

        last = step + args.steps
        while step < last:
            x, y = loader.next_batch()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            mgr.wait_staged()  # a background save may still be copying the parameters
            opt.step()
            sched.step()
            step += 1
            state = fc.capture(
                model=model, optimizer=opt, scheduler=sched, loader=loader, step=step
            )
            saved = mgr.maybe_save(state, step=step, is_final=step == last)
            if rank == 0 and (saved or step == last):
                print(
                    f"step {step}: loss {loss.item():.4f}{' (checkpoint)' if saved else ''}",
                    flush=True,
                )
    # Leaving the block waited for the last save and released the lock.
    if rank == 0:
        print(f"checkpoints in {args.root}: steps {mgr.steps()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
