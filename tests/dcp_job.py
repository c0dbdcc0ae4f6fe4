"""One rank of the DCP plugin tests (launched by tests/test_dcp_plugin.py, RANK etc. set).

Modes:
  save ROOT     FSDP2 training state written by dcp.save, dcp.async_save (thread and
                process) through the Writer, and by fc.save; the full tensors beside
  load ROOT     each of those read back into a fresh FSDP2 model by stock dcp.load,
                dcp.load through the Reader and fc.restore, compared with the full tensors
  kill ROOT     the last rank dies while writing its shard of a save through the Writer
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt.integrations.dcp import Reader, Writer

#: The checkpoints ``save`` writes, by how.
SAVED = ("sync", "thread", "process", "fc")


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(8, 16)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def state(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optimizer": osd, "step": step}


def full(tree: Any) -> Any:
    """Every DTensor of ``tree`` as its full tensor (a collective), plain values as they are."""
    if isinstance(tree, dict):
        return {k: full(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [full(v) for v in tree]
    if isinstance(tree, DTensor):
        return tree.full_tensor()
    return tree.clone() if isinstance(tree, torch.Tensor) else tree


def same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert sorted(a) == sorted(b), (where, sorted(a), sorted(b))
        for k in a:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}.{i}")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
    else:
        assert a == b, (where, a, b)


def save(root: Path) -> None:
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    model, opt = build(seed=0)
    sd = state(model, opt, step=2)
    dcp.save(sd, storage_writer=Writer(root / "sync"))
    dcp.async_save(sd, storage_writer=Writer(root / "thread")).result()
    pending = dcp.async_save(
        sd,
        storage_writer=Writer(root / "process"),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=DefaultStager(StagingOptions(False, True, True, False)),  # CPU: no pinning
    )
    pending.upload_completion.result()
    fc.save(root / "fc", sd, per_rank=())
    expected = full(sd)
    if dist.get_rank() == 0:
        torch.save(expected, root / "expected.pt")
    print("SAVED", flush=True)


def load(root: Path) -> None:
    expected = torch.load(root / "expected.pt", weights_only=False)
    for name in SAVED:
        src = root / name
        readers: dict[str, Any] = {
            "stock": lambda sd, src=src: dcp.load(sd, checkpoint_id=src),
            "reader": lambda sd, src=src: dcp.load(sd, storage_reader=Reader(src)),
            "restore": lambda sd, src=src: sd.update(fc.codec.to_python(fc.restore(src, sd))),
        }
        for how, read in readers.items():
            if name == "fc" and how == "stock":
                continue  # stock dcp.load of an fc.save checkpoint: tests/test_dcp_interop.py
            model, opt = build(seed=1)
            sd = state(model, opt, step=0)
            read(sd)
            set_state_dict(
                model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"]
            )
            try:
                same(full(state(model, opt, step=sd["step"])), expected)
            except AssertionError as e:
                raise AssertionError(f"{name} read by {how}: {e}") from None
    print("LOADED", flush=True)


def kill(root: Path) -> None:
    from functional_ckpt._src.storage import shards

    original = shards.write_shard
    rank, world = dist.get_rank(), dist.get_world_size()

    def dying(*args: Any, **kwargs: Any) -> Any:
        if rank == world - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    shards.write_shard = dying  # type: ignore[assignment]
    model, opt = build(seed=0)
    try:
        dcp.save(state(model, opt, step=2), storage_writer=Writer(root / "ck"))
    except BaseException as e:  # DCP raises CheckpointException, a BaseException
        print(f"RAISED {type(e).__name__}", flush=True)
        os._exit(3)
    print("no error", flush=True)
    os._exit(0)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    {"save": save, "load": load, "kill": kill}[mode](root)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
