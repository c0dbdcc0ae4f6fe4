"""DCP's storage seam attacked from its documentation (docs/integrations.md, "DCP's
storage seam"): values of every kind, hostile files, crashes and racing savers, in
one process without a process group (``no_dist=True``)."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

import functional_ckpt as fc
from functional_ckpt.integrations.dcp import Reader, Writer
from tests import prefork
from tests.patience import HANG, eventually

REPO = Path(__file__).parent.parent


def save(state: dict[str, Any], path: Path, **kw: Any) -> None:
    dcp.save(state, storage_writer=Writer(path, **kw), no_dist=True)


def load(template: dict[str, Any], path: Path) -> dict[str, Any]:
    dcp.load(template, storage_reader=Reader(path), no_dist=True)
    return template


# "Nothing else changes" / "Non-tensor values are stored exactly by the codec"
# (integrations.md, DCP's storage seam): bytes, bytearray, sets and devices saved through
# Writer are in the Metadata Reader derives, so dcp.load finds them.
@pytest.mark.parametrize(
    ("value", "empty"),
    [(b"xx", b""), (bytearray(b"yy"), bytearray()), ({1, 2}, set()), (torch.device("cpu"), None)],
)
def test_every_non_tensor_value_saved_through_the_seam_loads_through_it(
    tmp_path: Path, value: Any, empty: Any
) -> None:
    save({"v": value, "w": torch.ones(2)}, tmp_path / "ck")
    assert fc.codec.to_python(fc.restore(tmp_path / "ck"))["v"] == value  # stored exactly
    assert load({"v": empty, "w": torch.zeros(2)}, tmp_path / "ck")["v"] == value


# Holds: "Non-tensor values are stored exactly by the codec" (integrations.md).
def test_plain_values_dtypes_views_and_aliases_round_trip(tmp_path: Path) -> None:
    base = torch.arange(12.0)
    state: dict[str, Any] = {
        "s": "hi", "d": {"x": 1, "y": [1, 2]}, "n": None, "f": 1.5, "t": (1, 2),
        "zero_dim": torch.tensor(3.5),
        "transposed": torch.arange(12.0).reshape(3, 4).t(),
        "strided": base[::3],
        "a": base, "alias": base, "view": base[2:5],
        "bf16": torch.randn(3).bfloat16(), "c64": torch.randn(3, dtype=torch.complex64),
        "f8": torch.randn(3).to(torch.float8_e4m3fn), "bool": torch.tensor([True, False]),
        "a/b": torch.ones(1), "..": torch.ones(2), "../x": torch.ones(3),
    }  # fmt: skip
    save(state, tmp_path / "ck")
    assert fc.verify(tmp_path / "ck").ok
    template = {
        k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in state.items()
    }
    template.update(s="", d={"x": 0, "y": [0, 0]}, f=0.0, t=(0, 0))
    back = load(template, tmp_path / "ck")
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(
                back[key].reshape(-1).view(torch.uint8),
                value.contiguous().reshape(-1).view(torch.uint8),
            )
        else:
            assert back[key] == value, key
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # nothing named after a key


# Holds: "an existing checkpoint is replaced only with Writer(path, overwrite=True)"
# (integrations.md), also for a plain file or a symlink at the path.
def test_a_file_or_a_link_at_the_path_is_refused_and_left_alone(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("mine")
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    for name in ("file", "link"):
        for overwrite in (False, True):
            with pytest.raises(BaseException, match="not a checkpoint directory"):
                save({"w": torch.ones(1)}, tmp_path / name, overwrite=overwrite)
    assert (tmp_path / "file").read_text() == "mine"
    assert (tmp_path / "link").is_symlink() and not list((tmp_path / "real").iterdir())


# Holds: "Reader never unpickles .metadata" (integrations.md) and "a flipped byte raises
# CorruptCheckpoint naming the key and the file": a planted pickle runs nothing; a
# truncated shard is refused naming the file.
def test_a_planted_pickle_never_runs_and_a_truncated_shard_is_named(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, (f"touch {tmp_path / 'PWNED'}",))

    save({"w": torch.arange(4.0)}, tmp_path / "ck")
    (tmp_path / "ck" / ".metadata").write_bytes(pickle.dumps(Evil()))
    assert torch.equal(load({"w": torch.zeros(4)}, tmp_path / "ck")["w"], torch.arange(4.0))
    assert not (tmp_path / "PWNED").exists()
    shard = next((tmp_path / "ck").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size - 4)
    with pytest.raises(BaseException, match=f"{shard.name}.*truncated"):
        load({"w": torch.zeros(4)}, tmp_path / "ck")


# Holds: "overwrite=False unless asked" for dcp.async_save (integrations.md).
def test_async_save_through_the_seam_keeps_the_first_checkpoint(tmp_path: Path) -> None:
    state: dict[str, Any] = {"w": torch.arange(10.0), "step": 3}
    dcp.async_save(state, storage_writer=Writer(tmp_path / "ck"), no_dist=True).result()
    state["step"] = 4
    with pytest.raises(BaseException, match="already exists"):
        dcp.async_save(state, storage_writer=Writer(tmp_path / "ck"), no_dist=True).result()
    assert fc.codec.to_python(fc.restore(tmp_path / "ck"))["step"] == 3


CHILD = """
import os, sys, threading, time
import torch, torch.distributed.checkpoint as dcp
from functional_ckpt._src.storage import durable
from functional_ckpt.integrations.dcp import Writer

opened = durable.open_new

def open_and_hang(path, **kw):
    if ".tmp-" in os.path.basename(os.path.dirname(str(path))):
        print("WRITING", flush=True)
        time.sleep(3600)
    return opened(path, **kw)

durable.open_new = open_and_hang
state = {"w": torch.full((1000,), 2.0), "step": 2}
dcp.save(state, storage_writer=Writer(sys.argv[1], overwrite=True), no_dist=True)
"""


# Holds: "a crash (a SIGKILL of any rank mid-save) leaves nothing that looks committed"
# and an overwrite replaces the old checkpoint only at its commit (integrations.md).
def test_a_sigkilled_overwrite_leaves_the_old_checkpoint(tmp_path: Path) -> None:
    save({"w": torch.full((1000,), 1.0), "step": 1}, tmp_path / "ck")
    (tmp_path / "child.py").write_text(textwrap.dedent(CHILD))
    child = prefork.Popen(
        [sys.executable, str(tmp_path / "child.py"), str(tmp_path / "ck")],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "WRITING"
    child.send_signal(signal.SIGKILL)
    assert child.wait(timeout=HANG) == -signal.SIGKILL
    assert (
        fc.codec.to_python(fc.restore(tmp_path / "ck"))["step"] == 1
        and fc.verify(tmp_path / "ck").ok
    )


RACER = """
import sys, torch, torch.distributed.checkpoint as dcp
from functional_ckpt.integrations.dcp import Writer
open(sys.argv[2] + ".ready", "w").close()
import os, time
while not os.path.exists(sys.argv[3]):
    time.sleep(0.001)
try:
    dcp.save({"w": torch.full((100_000,), float(sys.argv[4])), "tag": int(sys.argv[4])},
             storage_writer=Writer(sys.argv[1]), no_dist=True)
    print("SAVED")
except BaseException as e:
    print("REFUSED" if "already exists" in str(e) else "OTHER " + str(e))
"""


# Holds: "overwrite=False unless asked" when several processes save to one path at once:
# exactly one commits, every other is refused, and the survivor is whole.
def test_racing_savers_to_one_path_commit_exactly_one(tmp_path: Path) -> None:
    (tmp_path / "racer.py").write_text(textwrap.dedent(RACER))
    go = tmp_path / "go"
    racers = [
        prefork.Popen(
            [
                sys.executable,
                str(tmp_path / "racer.py"),
                str(tmp_path / "ck"),
                str(tmp_path / f"r{i}"),
                str(go),
                str(i),
            ],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        for i in range(3)
    ]
    eventually(lambda: all((tmp_path / f"r{i}.ready").exists() for i in range(3)), "racers ready")
    go.touch()
    outs = sorted(r.communicate(timeout=HANG)[0].strip() for r in racers)
    assert outs == ["REFUSED", "REFUSED", "SAVED"], outs
    tag = fc.codec.to_python(fc.restore(tmp_path / "ck"))["tag"]
    assert fc.verify(tmp_path / "ck").ok and torch.equal(
        fc.restore(tmp_path / "ck")["w"], torch.full((100_000,), float(tag))
    )
