"""Edges of writing the live tensors (staging="write") and of reading bytes straight
into a target (DTensor shards, ``out=``): odd leaves, bases, one-rank groups, lazy
conjugate and negation views.

The process-group cases run in a subprocess of their own (a one-rank gloo group on
a FileStore), so that no group outlives the test in this process.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import torch

import functional_ckpt as fc
from tests import prefork

REPO = Path(__file__).resolve().parent.parent


def one_rank(tmp_path: Path, body: str) -> dict:
    """Run ``body`` as rank 0 of a one-rank gloo group; it prints one JSON line last."""
    script = (
        textwrap.dedent(
            """
        import json, sys, warnings
        from pathlib import Path
        import torch
        import torch.distributed as dist
        base = Path(sys.argv[1])
        dist.init_process_group(
            "gloo", store=dist.FileStore(str(base / "store"), 1), rank=0, world_size=1
        )
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard, distribute_tensor
        import functional_ckpt as fc
        mesh = init_device_mesh("cpu", (1,))
        """
        )
        + textwrap.dedent(body)
        + "\ndist.destroy_process_group()\n"
    )
    (tmp_path / "job.py").write_text(script)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = prefork.run(
        [sys.executable, str(tmp_path / "job.py"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- one-rank groups


def test_a_one_rank_group_with_dtensors_keeps_its_memory_tier(tmp_path: Path) -> None:
    """A one-process run under a one-rank process group (FSDP2 on one GPU) with a
    memory tier: its state holds DTensors, so its saves take the collective path,
    and they write the live tensors there too; every step is held, nothing warns."""
    got = one_rank(
        tmp_path,
        """
        state = {"w": distribute_tensor(torch.arange(16.0).reshape(4, 4), mesh, [Shard(0)])}
        tier = fc.manager.Memory(path=base / "mem")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            every = fc.every_steps(100)
            with fc.CheckpointManager(base / "root", save=every, tiers=(tier,)) as mgr:
                for step in (1, 2):
                    mgr.maybe_save(state, step=step)
                    mgr.wait_staged()
                mgr.wait()
                steps = mgr.memory.steps()
        print(json.dumps({"steps": steps, "warnings": [str(w.message) for w in seen]}))
        """,
    )
    assert got["warnings"] == [], got["warnings"][0]
    assert got["steps"] == [1, 2]


def test_an_in_place_dtensor_restore_into_a_conjugate_view_holds_the_saved_values(
    tmp_path: Path,
) -> None:
    """out= whose DTensor's local shard is a lazy conjugate view (contiguous, CPU, the
    saved dtype): raw bytes landing under the conj bit would read back conjugated, so
    it goes through a copy and holds the saved values."""
    got = one_rank(
        tmp_path,
        """
        full = (torch.arange(24.0).reshape(8, 3) * (1 + 2j)).to(torch.complex64)
        fc.save(base / "ck", {"c": distribute_tensor(full, mesh, [Shard(0)])})
        local = torch.zeros(8, 3, dtype=torch.complex64).conj()
        out = {"c": DTensor.from_local(local, mesh, [Shard(0)], run_check=False)}
        back = fc.restore(base / "ck", out=out)["c"].full_tensor()
        print(json.dumps({"equal": bool(torch.equal(back, full)),
                          "got": str(back[1, 0].item()), "saved": str(full[1, 0].item())}))
        """,
    )
    assert got["equal"], f"restored {got['got']}, saved {got['saved']}"


def test_an_in_place_restore_into_conjugate_and_negated_views_holds_the_saved_values(
    tmp_path: Path,
) -> None:
    c = (torch.arange(6.0) * (1 + 2j)).to(torch.complex64)
    n = torch.arange(5.0)
    fc.save(tmp_path / "ck", {"c": c, "n": n, "big": c.repeat(1 << 16)})
    out = {
        "c": torch.zeros(6, dtype=torch.complex64).conj(),
        "n": torch._neg_view(torch.zeros(5)),
        "big": torch.zeros(6 << 16, dtype=torch.complex64).conj(),
    }
    back = fc.restore(tmp_path / "ck", out=out)
    assert torch.equal(back["c"], c) and torch.equal(back["n"], n)
    assert torch.equal(back["big"], c.repeat(1 << 16))


# ---------------------------------------------------------------- staging="write"


def test_staging_write_odd_leaves_then_mutated_keep_their_values(tmp_path: Path) -> None:
    """Non-contiguous views, slices sharing storage, tied leaves, lazy conj/neg views,
    bool/bfloat16/complex/empty tensors, a Parameter, and plain values: every one
    mutated in place right after wait_staged (values right after the call); the
    checkpoint holds them as they were at the call."""
    x = torch.randn(300, 400)
    c = torch.randn(5, dtype=torch.complex64)
    state = {
        "big": torch.arange(40 << 20, dtype=torch.uint8),
        "x": x,
        "xt": x.t(),
        "rows": x[1:3],
        "col": x[:, 1],
        "tied": x,
        "conj": c.conj(),
        "neg": torch._neg_view(torch.randn(4, dtype=torch.complex64)),
        "flags": torch.tensor([True, False, True]),
        "half": torch.randn(7, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3),
        "p": torch.nn.Parameter(torch.randn(1000)),
        "cfg": {"lr": [0.1, 0.2], "name": "a"},
    }
    ref = {k: v.detach().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
    pending = fc.save_async(tmp_path / "ck", state, staging="write")
    state["cfg"]["lr"].append(9.0)
    state["cfg"]["name"] = "b"
    pending.wait_staged()
    with torch.no_grad():
        for t in (state["big"], x, c, state["neg"], state["half"], state["p"]):
            t.add_(1)
        state["flags"].logical_not_()
    pending.result()
    back = fc.restore(tmp_path / "ck")
    for k, v in ref.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert fc.codec.to_python(back["cfg"]) == {"lr": [0.1, 0.2], "name": "a"}


def test_staging_write_on_a_base_keeps_an_unchanged_tensor_mutated_after_staging(
    tmp_path: Path,
) -> None:
    state = {"big": torch.arange(40 << 20, dtype=torch.uint8), "y": torch.randn(10)}
    fc.save(tmp_path / "base", state)
    ref = {k: v.clone() for k, v in state.items()}
    pending = fc.save_async(tmp_path / "inc", state, staging="write", base=tmp_path / "base")
    pending.wait_staged()
    state["big"].add_(3)
    state["y"].mul_(2)
    pending.result()
    back = fc.restore(tmp_path / "inc")
    assert all(torch.equal(back[k], v) for k, v in ref.items())
    assert fc.verify(tmp_path / "inc").ok
