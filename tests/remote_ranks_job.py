"""The root-per-rank resume tests' ranks (tests/test_remote.py): every rank has a local
root of its own (``BASE/root<R>``), all share one remote (``URL``; an S3 endpoint in
``ENDPOINT``).

Run alone (``BASE URL``), each rank resumes (:func:`resume`): on three ranks, the
two-rank checkpoints :func:`damaged` saved there. :func:`damaged` and :func:`two_runs`
are parts of the two-rank job (tests/remote_job.py).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.remote import fetch


def _flip(fs: Any, path: str) -> None:
    data = bytearray(fs.cat_file(path))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def _swap(fs: Any, a: str, b: str) -> None:
    da, db = fs.cat_file(a), fs.cat_file(b)
    fs.pipe_file(a, db)
    fs.pipe_file(b, da)


_PARTS = ("manifest.part-00000.msgpack", "manifest.part-00001.msgpack")
#: Damage of one newest remote checkpoint each (saved on two ranks, a root each).
RANK_DAMAGE: dict[str, Any] = {
    "rank 1's shard flipped": lambda fs, at: _flip(fs, at("__1_0.distcp")),
    "rank 1's shard missing": lambda fs, at: fs.rm(at("__1_0.distcp")),
    "rank 1's part missing": lambda fs, at: fs.rm(at(_PARTS[1])),
    "shards swapped between ranks": lambda fs, at: _swap(
        fs, at("__0_0.distcp"), at("__1_0.distcp")
    ),
    "parts swapped between ranks": lambda fs, at: _swap(fs, at(_PARTS[0]), at(_PARTS[1])),
    "rank 1's shard truncated": lambda fs, at: fs.pipe_file(
        at("__1_0.distcp"), fs.cat_file(at("__1_0.distcp"))[:-8]
    ),
}
#: The steps :func:`damaged` saves: the newest of each damaged, step 1 intact.
STEPS = len(RANK_DAMAGE) + 1


def full(step: int, scale: int = 1) -> torch.Tensor:
    return torch.arange(48, dtype=torch.float32).reshape(12, 4) * step * scale + 0.5


def _manager(base: Path, url: str, options: dict[str, Any], rank: int) -> fc.CheckpointManager:
    tier = fc.manager.Remote(url, storage_options=options)
    return fc.CheckpointManager(base / f"root{rank}", keep=fc.keep_last(1), tiers=(tier,))


def _save(
    base: Path, url: str, options: dict[str, Any], rank: int, mesh: Any, steps: int, scale: int = 1
) -> None:
    """Save steps 1..``steps`` into ``BASE/root<R>`` and ``URL``, wait for the uploads."""
    with _manager(base, url, options, rank) as mgr:
        for step in range(1, steps + 1):
            state = {"w": distribute_tensor(full(step, scale), mesh, [Shard(0)]), "step": step}
            mgr.maybe_save(state, step=step)
        assert mgr.remote is not None
        mgr.remote.wait()
    dist.barrier()


def two_runs(base: Path, url: str, options: dict[str, Any], rank: int, mesh: Any) -> None:
    """Run ``a``, then run ``b`` (roots of their own: ``BASE/<run>/root<R>``), save
    steps 1-2 to the same ``URL``: b's uploads meet a's steps there."""
    for run, scale in (("a", 1), ("b", 2)):
        _save(base / run, url, options, rank, mesh, 2, scale)


def damaged(base: Path, url: str, options: dict[str, Any], rank: int, mesh: Any) -> None:
    """Save steps 1..STEPS into ``BASE/root<R>`` and ``URL`` and wait for the uploads;
    then a copy of them in ``URL-damaged``, each newest step damaged its own way, and
    each rank resumes from it into ``BASE/walk`` (:func:`resume`)."""
    _save(base, url, options, rank, mesh, STEPS)
    copy = f"{url}-damaged"
    if rank == 0:
        import fsspec

        fs = fsspec.filesystem("s3", **options)
        src, dst = url.removeprefix("s3://"), copy.removeprefix("s3://")
        for path in fs.find(src):
            fs.copy(path, dst + path[len(src) :])
        for step, damage in zip(range(STEPS, 1, -1), RANK_DAMAGE.values(), strict=True):
            damage(fs, lambda n, s=step: f"{dst}/step_{s:09d}/{n}")
    dist.barrier()
    resume(base / "walk", copy, options, rank, mesh)
    dist.barrier()


def resume(base: Path, url: str, options: dict[str, Any], rank: int, mesh: Any) -> None:
    """restore_latest; writes ``BASE/resume.<R>.json`` with the step, whether w matches
    that step, the warnings and what this rank fetched."""
    fetched: list[str] = []
    real = fetch._get

    def counted(store: Any, step: int, tmp: Path, names: list[str]) -> None:
        fetched.extend(names)
        real(store, step, tmp, names)

    fetch._get = counted  # type: ignore[assignment]
    told: dict[str, Any] = {"rank": rank}
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with _manager(base, url, options, rank) as mgr:
                like = {"w": distribute_tensor(torch.zeros(12, 4), mesh, [Shard(0)]), "step": 0}
                got = mgr.restore_latest(like=like)
                step = mgr.restored_step
                told["step"] = step
                if got is not None and step is not None:
                    want = distribute_tensor(full(step), mesh, [Shard(0)]).to_local()
                    told["match"] = bool(torch.equal(got["w"].to_local(), want))
                    told["step_value"] = int(got["step"])
        told["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen]
    except Exception as e:
        told["error"] = f"{type(e).__name__}: {e}"
        told["trace"] = traceback.format_exc()[-2000:]
    finally:
        fetch._get = real  # type: ignore[assignment]
    told["fetched"] = sorted(fetched)
    base.mkdir(parents=True, exist_ok=True)
    (base / f"resume.{rank}.json").write_text(json.dumps(told))


def main() -> None:
    base, url = Path(sys.argv[1]), sys.argv[2]
    options = {"client_kwargs": {"endpoint_url": os.environ["ENDPOINT"]}}
    dist.init_process_group("gloo")
    resume(base, url, options, dist.get_rank(), init_device_mesh("cpu", (dist.get_world_size(),)))
    os._exit(0)


if __name__ == "__main__":
    main()
