"""A save reads the state and leaves it as it was; a storage resized or freed under an
unstaged write is refused, never a crash, never zeros committed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests.patience import HANG

#: The child: a 64 MiB ``staging="none"`` save held at a point of its write (``at``:
#: before its first byte, or after its first block) while the state's storage is
#: freed (``untyped_storage().resize_(0)``, as FSDP frees parameters) or grown.
CHILD = """
import os, sys, threading, torch
import functional_ckpt as fc
from functional_ckpt._src.storage import durable

how, at, root = sys.argv[1], sys.argv[2], sys.argv[3]
reached, go = threading.Event(), threading.Event()
write_all = durable.write_all

def held(fd, data):
    if at == "during" and len(data) >= durable.COPY_BLOCK and not reached.is_set():
        write_all(fd, data)
        reached.set()
        go.wait()
        return
    write_all(fd, data)

opened = durable.open_new

def held_open(path, **kw):
    if at == "before":
        reached.set()
        go.wait()
    return opened(path, **kw)

durable.write_all, durable.open_new = held, held_open
t = torch.ones(1 << 24)
pending = fc.save_async(root + "/ck", {"w": t}, staging="none")
reached.wait()
try:
    if how == "free":
        t.untyped_storage().resize_(0)
    else:
        t.resize_(2 * t.numel())
finally:
    go.set()
error = pending.exception()
print(type(error).__name__, os.path.exists(root + "/ck"), flush=True)
"""


@pytest.mark.parametrize("at", ["before", "during"])
@pytest.mark.parametrize("how", ["free", "grow"])
def test_a_storage_resized_during_an_unstaged_write_is_refused(
    tmp_path: Path, how: str, at: str
) -> None:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), how, at, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 0, proc.stderr  # no crash, and the resize itself worked
    assert proc.stdout.split() == ["ModifiedDuringSave", "False"]


def resizable(t: torch.Tensor) -> bool:
    n = t.numel()
    try:
        t.resize_(2 * n)
        t.resize_(n)
        t.untyped_storage().resize_(0)
    except RuntimeError:
        return False
    return True


@pytest.mark.parametrize("how", ["save", "copy", "write", "none", "base"])
def test_a_save_leaves_every_tensor_resizable(tmp_path: Path, how: str) -> None:
    state = {"big": torch.ones(1 << 20), "small": torch.ones(64), "step": 1}
    if how == "save":
        fc.save(tmp_path / "ck", state)
    elif how == "base":
        fc.save(tmp_path / "base", state)
        fc.save(tmp_path / "ck", state, base=tmp_path / "base")
    else:
        fc.save_async(tmp_path / "ck", state, staging=how).result()  # type: ignore[arg-type]
    assert fc.verify(tmp_path / "ck").ok
    assert resizable(state["big"]) and resizable(state["small"])


#: The child: an incremental ``staging="none"`` save of a 64 MiB tensor equal to the
#: base's (written by another process, so its bytes are compared too), held after the
#: first block of its checksum (``at="crc"``) or of its byte comparison with the base's
#: file (``at="compare"``) while the storage is freed or grown.
BASE_CHILD = """
import os, sys, threading, torch
import functional_ckpt as fc
from functional_ckpt._src.save import incremental
from functional_ckpt._src.storage import live, shards

how, at, root = sys.argv[1], sys.argv[2], sys.argv[3]
reached, go = threading.Event(), threading.Event()
crc32, read_into = incremental.crc32, shards.read_into

def hold():
    if not reached.is_set():
        reached.set()
        go.wait()

def held_crc(data, start=0):
    crc = crc32(data, start)
    if at == "crc" and len(data) >= 1 << 20:
        hold()
    return crc

def held_read(fd, offset, dest):
    got = read_into(fd, offset, dest)
    if at == "compare":
        hold()
    return got

incremental.crc32 = live.crc32 = held_crc
shards.read_into = held_read
t = torch.ones(1 << 24)
pending = fc.save_async(root + "/ck", {"w": t}, staging="none", base=root + "/base")
reached.wait()
try:
    if how == "free":
        t.untyped_storage().resize_(0)
    else:
        t.resize_(2 * t.numel())
finally:
    go.set()
error = pending.exception()
print(type(error).__name__, os.path.exists(root + "/ck"), flush=True)
"""


@pytest.mark.parametrize("at", ["crc", "compare"])
@pytest.mark.parametrize("how", ["free", "grow"])
def test_a_storage_resized_while_compared_with_the_base_is_refused(
    tmp_path: Path, how: str, at: str
) -> None:
    fc.save(tmp_path / "base", {"w": torch.ones(1 << 24)})
    script = tmp_path / "child.py"
    script.write_text(BASE_CHILD)
    proc = subprocess.run(
        [sys.executable, str(script), how, at, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    assert proc.returncode == 0, proc.stderr  # no crash, and the resize itself worked
    assert proc.stdout.split() == ["ModifiedDuringSave", "False"]
