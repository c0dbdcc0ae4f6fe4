"""One rank of the multi-rank tests (launched by tests/test_dist.py with RANK etc. set).

Modes:
  train ROOT STEPS [CRASH_RANK CRASH_AT]  FSDP2 training, checkpoint every 3 steps
  shard-save ROOT                         save a sharded + replicated + per-rank state
  shard-restore ROOT                      restore it into differently sharded templates
  plain-restore ROOT                      restore a single-process checkpoint into DTensors
  kill-in-save ROOT                       the last rank dies while writing its shard
  kill-after-commit ROOT                  each rank in a folder of its own (parts); the
                                          coordinator dies right after its commit
  incremental ROOT                        incremental saves, one rank's shard changed
  plan-cache ROOT                         the same layout saved again, then changed layouts
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import functional_ckpt as fc
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import committed
from tests.training import ShuffleLoader


def full_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(10, 6, generator=g),  # uneven shards on 4 ranks
        "e": torch.randn(5, 3, 2, generator=g).to(torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
    }


def chunk_files(path: Path) -> set[str]:
    """The data files a checkpoint's tensor chunks lie in (a split manifest's parts read)."""
    with committed.open_checkpoint(path) as ck:
        groups = committed.parsed(ck).groups()
    return {c.file for group in groups for e in group for c in e.chunks}


def shard_state(mesh: Any, rank: int) -> dict[str, Any]:
    full = full_tensors()
    return {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "e": distribute_tensor(full["e"], mesh, [Shard(1)]),
        "r": distribute_tensor(full["w"] * 2, mesh, [Replicate()]),
        "b": full["b"],
        "step": 11,
        "loader": {"pos": rank * 100, "seed": rank},
    }


def shard_template(mesh: Any) -> dict[str, Any]:
    return {
        "w": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(1)]),
        "e": distribute_tensor(torch.zeros(5, 3, 2, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "r": distribute_tensor(torch.zeros(10, 6), mesh, [Shard(0)]),
        "b": torch.zeros(7, dtype=torch.int64),
        "step": 0,
        "loader": {"pos": 0, "seed": 0},
    }


def positions(saved: list[Any], rank: int, world: int) -> dict[str, Any]:
    """Reshard recipe: the new ranks split the saved ranks' work evenly."""
    total = sum(s["loader", "pos"] for s in saved)
    return {"loader": {"pos": total // world, "seed": rank}}


def check_restored(back: Any, rank: int, world: int) -> None:
    full = full_tensors()
    assert torch.equal(back["w"].full_tensor(), full["w"])
    assert torch.equal(back["e"].full_tensor(), full["e"])
    assert torch.equal(back["r"].full_tensor(), full["w"] * 2)
    assert torch.equal(back["b"], full["b"]) and back["step"] == 11


def build_fsdp(mesh: Any, rank: int) -> tuple[Any, Any, Any, ShuffleLoader]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)  # identical init on every rank before sharding
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 4)
    )
    for layer in (model[0], model[3]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 5))
    g = torch.Generator().manual_seed(99)
    data, targets = torch.randn(128, 16, generator=g), torch.randint(0, 4, (128,), generator=g)
    torch.manual_seed(1000 + rank)  # per-rank dropout stream
    return model, opt, sched, ShuffleLoader(data, targets, 16, seed=rank)


def train(root: Path, steps: int, crash_rank: int, crash_at: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model, opt, sched, loader = build_fsdp(mesh, rank)
    mgr_steps = sorted(
        int(p.name.split("_")[1])
        for p in root.glob("step_*")
        if not naming.is_temporary_name(p.name) and (p / "COMMITTED").exists()
    )
    step = 0
    if mgr_steps:
        template = fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=0)
        state = fc.restore(root / f"step_{mgr_steps[-1]:06d}", template)
        fc.apply(state, model=model, optimizer=opt, scheduler=sched, loader=loader)
        step = state["step"]
    with open(root / f"losses.{rank}.txt", "a") as log:
        while step < steps:
            x, y = loader.next_batch()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            log.write(f"{step} {float(loss.item()).hex()}\n")
            log.flush()
            if step % 3 == 0:
                state = fc.capture(
                    model=model, optimizer=opt, scheduler=sched, loader=loader, step=step
                )
                fc.save(root / f"step_{step:06d}", state)
            if rank == crash_rank and step == crash_at:
                os.kill(os.getpid(), signal.SIGKILL)
    final = fc.capture(model=model, optimizer=opt, scheduler=sched, loader=loader, step=step)
    fc.save(root / "final", final, overwrite=True)


SCALE_MODEL = dict(layers=1, hidden=64, mlp=128, vocab=256)  # dims 0 divide by 8


def scale_state(mesh: Any, rank: int, *, zeros: bool = False) -> dict[str, Any]:
    """benchmarks/scale.py's state made real: DTensors sharded on dim 0 over ``mesh``."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import scale

    def tensor(key: str, shape: tuple[int, ...], sharded: bool) -> torch.Tensor:
        g = torch.Generator().manual_seed(zlib.crc32(key.encode()))
        full = torch.zeros(shape) if zeros else torch.randn(shape, generator=g)
        if not sharded:
            return full
        t = distribute_tensor(full, mesh, [Shard(0)])
        return t.requires_grad_(True) if key.startswith("model/") else t

    rng = torch.Generator().manual_seed(rank).get_state()
    return scale.full_state(scale.Model(**SCALE_MODEL), rank, tensor, rng)


def counting_helpers(counts: dict[str, int]) -> None:
    """Count what this rank's checkpoint collectives send and receive, at the helpers.

    An input tensor counts as sent, every output tensor it fills as received (its
    own slot included): the accounting benchmarks/scale.py predicts.
    """
    from functional_ckpt._src.distributed import groups

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    all_gather, all_reduce, gather, broadcast, scatter = (
        groups._all_gather,
        groups._all_reduce_max,
        groups._gather,
        groups._broadcast,
        groups._scatter,
    )

    def add(sent: int, received: int) -> None:
        counts["sent"] += sent
        counts["received"] += received
        counts["calls"] += 1

    def all_gather_(out: list[torch.Tensor], t: torch.Tensor, group: Any) -> None:
        add(size(t), sum(size(o) for o in out))
        all_gather(out, t, group)

    def all_reduce_(t: torch.Tensor, group: Any) -> None:
        add(size(t), size(t))
        all_reduce(t, group)

    def gather_(t: torch.Tensor, out: list[torch.Tensor] | None, dst: int, group: Any) -> None:
        add(size(t), sum(size(o) for o in out or ()))
        gather(t, out, dst, group)

    def broadcast_(t: torch.Tensor, src: int, group: Any) -> None:
        mine = dist.get_rank(group) == src
        add(size(t) if mine else 0, 0 if mine else size(t))
        broadcast(t, src, group)

    def scatter_(t: torch.Tensor, parts: list[torch.Tensor] | None, src: int, group: Any) -> None:
        add(sum(size(p) for p in parts or ()), size(t))
        scatter(t, parts, src, group)

    groups._all_gather, groups._all_reduce_max = all_gather_, all_reduce_
    groups._gather, groups._broadcast, groups._scatter = gather_, broadcast_, scatter_


def per_rank_of(saved: list[Any], rank: int, world: int) -> Any:
    """A resharded run's per-rank state: the saving rank of the same number, wrapped."""
    return saved[rank % len(saved)]


def traffic_run(root: Path, rank: int, world: int) -> None:
    """Save the scale benchmark's state, counting each rank's bytes, unless a
    checkpoint is there already; then restore it on this world, bit-exact."""
    from functional_ckpt._src.state.tree import as_state, iter_leaves

    mesh = init_device_mesh("cpu", (world,))
    counts = {"sent": 0, "received": 0, "calls": 0}
    counting_helpers(counts)
    dest = root / "ck"
    told: dict[str, Any] = {}
    if not dest.exists():
        info = fc.save(dest, scale_state(mesh, rank))
        told["save"] = dict(counts)
        told["nbytes"] = info.nbytes
    counts.update(sent=0, received=0, calls=0)
    read: set[int] = set()  # the manifest parts this rank reads
    read_part = committed.read_part

    def counting(ck: committed.Checkpoint, part: int) -> Any:
        read.add(part)
        return read_part(ck, part)

    committed.read_part = counting  # type: ignore[assignment]
    back = fc.restore(dest, scale_state(mesh, rank, zeros=True), reshard=per_rank_of)
    committed.read_part = read_part  # type: ignore[assignment]
    told["restore"] = dict(counts)
    told["parts_read"] = sorted(read)
    got = {leaf.path: leaf.value for leaf in iter_leaves(as_state(back))}
    checked = 0
    for leaf in iter_leaves(as_state(scale_state(mesh, rank))):
        if leaf.kind == "tensor" and leaf.path[0] != "rng":
            a, b = got[leaf.path], leaf.value
            a = a.full_tensor() if hasattr(a, "full_tensor") else a
            b = b.full_tensor() if hasattr(b, "full_tensor") else b
            assert a.dtype == b.dtype, leaf.path
            assert a.detach().numpy().tobytes() == b.detach().numpy().tobytes(), leaf.path
            checked += 1
    told["checked"] = checked
    (root / f"traffic.{world}.{rank}.json").write_text(json.dumps(told))


def plan_cache_run(root: Path, rank: int, world: int) -> None:
    """Save one layout twice (the second reuses the plan: every rank sends an empty
    one, the coordinator deduplicates nothing), then layouts with other shapes and
    other keys: each saves its own plan and restores bit-exact."""
    from functional_ckpt._src.save import dedup, exchange, splice

    sent: list[bool] = []  # per save: did this rank send its full local plan?
    dedups, merges = [0], [0]
    payload, step, first = exchange.rank_payload, exchange.global_step, splice._recipe

    def counted_first(*args: Any) -> Any:  # the coordinator made every chunk
        merges[0] += 1
        return first(*args)

    def counted_payload(plan: Any, keys: Any, error: Any = None) -> bytes:
        sent.append(keys is not None)
        return payload(plan, keys, error)

    def counted_step(cache: Any, told: Any, dedup_: Any = dedup.dedup_keys) -> Any:
        def counting(plans: Any) -> Any:
            dedups[0] += 1
            return dedup_(plans)

        return step(cache, told, counting)

    exchange.rank_payload = counted_payload  # type: ignore[assignment]
    exchange.global_step = counted_step  # type: ignore[assignment]
    splice._recipe = counted_first  # type: ignore[assignment]
    mesh = init_device_mesh("cpu", (world,))
    states = [shard_state(mesh, rank), shard_state(mesh, rank)]
    states[1]["b"] = states[1]["b"] + 1  # new values, same layout
    states[1]["step"] = 12
    wider = full_tensors()["w"].repeat(1, 2)  # other shapes: w is 10 x 12
    states.append({**shard_state(mesh, rank), "w": distribute_tensor(wider, mesh, [Shard(0)])})
    states.append({**states[2], "extra": torch.arange(4.0)})  # another key
    told: dict[str, Any] = {"sent": sent, "dedups": [], "merges": []}
    for i, state in enumerate(states):
        fc.save(root / f"s{i}", state)
        told["dedups"].append(dedups[0])
        told["merges"].append(merges[0])
        back = fc.restore(root / f"s{i}", state)
        for key, want in state.items():
            got = back[key]
            if isinstance(want, torch.Tensor):
                got = got.full_tensor() if hasattr(got, "full_tensor") else got
                want = want.full_tensor() if hasattr(want, "full_tensor") else want
                assert got.shape == want.shape and torch.equal(got, want), (i, key)
            elif key != "loader":
                assert got == want, (i, key)
    (root / f"plan-cache.{rank}.json").write_text(json.dumps(told))


def write_error(root: Path, rank: int, e: BaseException) -> None:
    """What this rank raised, as ``error.<rank>.json`` (its type, text, notes, and
    every failing rank's error where it names them)."""
    told = {
        "type": type(e).__name__,
        "str": str(e),
        "notes": getattr(e, "__notes__", []),
        "failures": {str(r): list(f) for r, f in getattr(e, "failures", {}).items()},
    }
    (root / f"error.{rank}.json").write_text(json.dumps(told))


def failing_save(root: Path, rank: int, world: int, faults: dict[int, BaseException]) -> None:
    """A save in which each rank of ``faults`` fails to write its shard file with its
    error; what each rank raised is written by :func:`write_error`."""
    from functional_ckpt._src.storage import shards

    original = shards.write_shard

    def failing(*args: Any, **kwargs: Any) -> Any:
        if rank in faults:
            raise faults[rank]
        return original(*args, **kwargs)

    shards.write_shard = failing
    mesh = init_device_mesh("cpu", (world,))
    try:
        fc.save(root / "ck", shard_state(mesh, rank))
    except (fc.CheckpointError, OSError) as e:
        write_error(root, rank, e)


def kill_after_commit(root: Path, rank: int) -> None:
    """Step 1 saved whole; in step 2's save rank 0 dies between its commit and the
    verdict it owes the others, who cannot know whether the step committed."""
    from functional_ckpt._src.save import multi_rank
    from functional_ckpt._src.save.api import run_save
    from functional_ckpt._src.save.options import SaveOptions

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    own = root / f"r{rank}"  # no file system shared with the coordinator
    run_save(own / "step_1", shard_state(mesh, rank), SaveOptions(parts=True))
    print("SAVED 1", flush=True)
    real = multi_rank._Commit.finish

    def finish_and_die(self: Any, *args: Any) -> int:
        nbytes = real(self, *args)
        os.kill(os.getpid(), signal.SIGKILL)  # committed: the verdict never leaves
        return nbytes

    if rank == 0:
        multi_rank._Commit.finish = finish_and_die  # type: ignore[method-assign]
    try:
        run_save(own / "step_2", shard_state(mesh, rank), SaveOptions(parts=True))
    except fc.CheckpointError as e:
        print(f"RAISED {e}", flush=True)
        os._exit(3)
    print("no error", flush=True)
    os._exit(0)


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if mode == "train":
        crash = (int(sys.argv[4]), int(sys.argv[5])) if len(sys.argv) > 5 else (-1, -1)
        train(root, int(sys.argv[3]), *crash)
    elif mode == "shard-save":
        mesh = init_device_mesh("cpu", (world,))
        fc.save(root / f"w{world}", shard_state(mesh, rank))
    elif mode == "damaged-part-restore":
        mesh = init_device_mesh("cpu", (world,))
        try:
            fc.restore(root / f"w{world}", shard_template(mesh), reshard=positions)
        except fc.CheckpointError as e:
            write_error(root, rank, e)
    elif mode == "shard-restore":
        mesh = init_device_mesh("cpu", (world,))
        for saved in sorted(root.glob("w*")):
            like = shard_template(mesh)
            back = fc.restore(saved, like, reshard=positions)
            check_restored(back, rank, world)
            assert not like["w"].to_local().any() and not like["e"].to_local().any()  # untouched
            assert back["w"].placements == like["w"].placements
            assert back["w"].to_local().data_ptr() != like["w"].to_local().data_ptr()
            into = shard_template(mesh)
            check_restored(fc.restore(saved, out=into, reshard=positions), rank, world)
            assert torch.equal(into["w"].full_tensor(), full_tensors()["w"])  # in place
            saved_world = int(saved.name[1:])
            expect = (
                rank * 100
                if saved_world == world
                else sum(range(0, saved_world * 100, 100)) // world
            )
            assert back["loader"]["pos"] == expect, (back["loader"]["pos"], expect)
    elif mode == "same-shard-restore":
        # Onto the placements that saved it: every shard is read straight into its new
        # DTensor (no buffer), and ``like`` is left as it was.
        from functional_ckpt._src.restore import dtensor

        real, straight = dtensor.read_chunk, []

        def recorded(*a: Any, **k: Any) -> Any:
            straight.append(k.get("out") is not None)
            return real(*a, **k)

        dtensor.read_chunk = recorded  # type: ignore[assignment]
        mesh = init_device_mesh("cpu", (world,))
        like = {
            k: distribute_tensor(torch.zeros_like(v.full_tensor()), mesh, v.placements)
            if isinstance(v, DTensor)
            else v
            for k, v in shard_state(mesh, rank).items()
        }
        try:
            back = fc.restore(root / f"w{world}", like)
        except fc.CheckpointError as e:
            write_error(root, rank, e)
            return
        check_restored(back, rank, world)
        assert straight and all(straight), straight
        assert not any(like[k].to_local().any() for k in ("w", "e", "r"))
        for k in ("w", "e", "r"):
            assert back[k].placements == like[k].placements
            assert back[k].to_local().data_ptr() != like[k].to_local().data_ptr()
    elif mode == "plain-restore":
        mesh = init_device_mesh("cpu", (world,))
        back = fc.restore(root / "w1", shard_template(mesh), reshard=positions)
        check_restored(back, rank, world)
    elif mode == "manager":
        # Ranks see different metrics and clocks; the coordinator's view decides.
        mesh = init_device_mesh("cpu", (world,))
        state = shard_state(mesh, rank)
        decisions = []
        with fc.CheckpointManager(
            root / "run",
            fc.on_improve("loss"),
            fc.keep_last(2),
            async_save=True,
            export=fc.manager.Export(fc.at_steps([2]), select="w"),
        ) as mgr:
            for step in range(6):
                loss = 1.0 if rank == 0 else 1.0 - step  # rank 1 "improves" every step
                decisions.append(mgr.maybe_save(state, step=step, metrics={"loss": loss}))
                mgr.wait_staged()
                state["b"].add_(1)  # mutate after staging, as an optimizer step would
        print("decisions", decisions, flush=True)
        assert decisions == [True] + [False] * 5, decisions
        back = fc.restore(root / "run" / "step_000000000", shard_template(mesh))
        check_restored(back, rank, world)
    elif mode == "incremental":
        mesh = init_device_mesh("cpu", (world,))
        state = shard_state(mesh, rank)
        # A tensor whose shards outweigh each file's values, as real models' do: a
        # base file stays shared while most of its bytes are live (MIN_LIVE).
        bulk = torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32)
        state["bulk"] = distribute_tensor(bulk, mesh, [Shard(0)])
        fc.save(root / "a", state)
        if rank == world - 1:
            state["w"].to_local().add_(1.0)  # only the last rank's shard changes
        fc.save(root / "b", state, base=root / "a")
        pending = fc.save_async(root / "c", state, base=root / "b")  # nothing changed
        pending.wait_staged()
        pending.result()
        dist.barrier()
        if rank == 0:
            files = chunk_files(root / "b")
            written = {n for n in files if n.endswith("_0.distcp")}
            assert written == {f"__{world - 1}_0.distcp"}, written  # only its shard changed
            shutil.rmtree(root / "a")
            shutil.rmtree(root / "b")
        dist.barrier()
        like = {
            **shard_template(mesh),
            "bulk": distribute_tensor(torch.zeros(64, 32), mesh, [Shard(0)]),
        }
        back = fc.restore(root / "c", like)
        assert torch.equal(back["bulk"].full_tensor(), bulk)
        expect = full_tensors()["w"]
        expect[-(-10 // world) * (world - 1) :] += 1.0
        assert torch.equal(back["w"].full_tensor(), expect)
        assert torch.equal(back["r"].full_tensor(), full_tensors()["w"] * 2)
        assert back["loader"]["pos"] == rank * 100
    elif mode == "plan-cache":
        plan_cache_run(root, rank, world)
    elif mode == "traffic":
        traffic_run(root, rank, world)
    elif mode == "async-save":
        mesh = init_device_mesh("cpu", (world,))
        state = shard_state(mesh, rank)
        try:  # no version guard across ranks
            fc.save_async(root / "none", state, staging="none")
        except fc.CheckpointError as e:
            assert "staging='none'" in str(e) and "torch.distributed" in str(e), e
        else:
            raise AssertionError("staging='none' was accepted under torch.distributed")
        assert not (root / "none").exists()
        saved = state["w"].to_local().clone()
        for staging in ("copy", "write"):
            pending = fc.save_async(root / staging, state, staging=staging)  # type: ignore[arg-type]
            pending.wait_staged()
            state["w"].to_local().add_(100.0)  # after staging: must not reach the checkpoint
            pending.result()
            state["w"].to_local().copy_(saved)
            back = fc.restore(root / staging, shard_template(mesh))
            check_restored(back, rank, world)
    elif mode == "kill-in-save":
        from functional_ckpt._src.storage import shards

        original = shards.write_shard

        def dying(*args: Any, **kwargs: Any) -> Any:
            if rank == world - 1:
                os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)

        shards.write_shard = dying
        mesh = init_device_mesh("cpu", (world,))
        t0 = time.monotonic()
        try:
            fc.save(root / "ck", shard_state(mesh, rank))
        except fc.CheckpointError as e:
            print(f"raised after {time.monotonic() - t0:.1f}s: {e}", flush=True)
            os._exit(3)
        print("no error", flush=True)
        os._exit(0)
    elif mode == "kill-after-commit":
        kill_after_commit(root, rank)
    elif mode == "unprintable-fail":

        class Unprintable(Exception):
            def __str__(self) -> str:
                raise AttributeError("no message")

        failing_save(root, rank, world, {1: Unprintable()})
    elif mode == "ranks-fail":
        failing_save(
            root,
            rank,
            world,
            {
                1: fc.errors.UnsupportedValue("rank one cannot store this"),
                2: OSError(28, "No space left on device"),
            },
        )
    elif mode == "agree-values":
        from functional_ckpt._src.distributed.groups import agree_values, checkpoint_group

        group = checkpoint_group(purpose="control")
        got = agree_values(None, {"rank": rank}, group, "round one")
        assert got == [{"rank": r} for r in range(world)], got
        error = fc.errors.CorruptCheckpoint(f"rank {rank} found damage") if rank == 1 else None
        try:
            agree_values(error, rank, group, "round two")
        except fc.CheckpointError as e:
            write_error(root, rank, e)
        else:
            raise AssertionError("round two passed with a failing rank")
    dist.barrier()  # nobody tears down connections while a peer still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
