"""A save reads the state and leaves it as it was; a storage resized or freed under an
unstaged write is refused, never a crash, never zeros committed."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from tests import prefork
from tests.patience import HANG

#: The child, one process for every case ``HOW-AT`` it is given: a 64 MiB
#: ``staging="none"`` save held at a point of its work while the state's storage is
#: freed (``untyped_storage().resize_(0)``, as FSDP frees parameters) or grown. ``at``:
#: before the write's first byte, after its first block (``during``), or, saving
#: incrementally on ``base`` (written by another process, so its bytes are compared
#: too), after the first block of its checksum (``crc``) or of its byte comparison
#: with the base's file (``compare``).
CHILD = """
import os, sys, threading, torch
import functional_ckpt as fc
from functional_ckpt._src.save import incremental
from functional_ckpt._src.storage import durable, live, shards

write_all, opened = durable.write_all, durable.open_new
crc32, read_into = incremental.crc32, shards.read_into

def hold(here):
    if at == here and not reached.is_set():
        reached.set()
        go.wait()

def held_write(fd, data):
    write_all(fd, data)
    if len(data) >= durable.COPY_BLOCK:
        hold("during")

def held_open(path, **kw):
    hold("before")
    return opened(path, **kw)

def held_crc(data, start=0):
    crc = crc32(data, start)
    if len(data) >= 1 << 20:
        hold("crc")
    return crc

def held_read(fd, offset, dest):
    got = read_into(fd, offset, dest)
    hold("compare")
    return got

durable.write_all, durable.open_new = held_write, held_open
incremental.crc32 = live.crc32 = held_crc
shards.read_into = held_read
root = sys.argv[1]
for case in sys.argv[2:]:
    how, at = case.split("-")
    reached, go = threading.Event(), threading.Event()
    t = torch.ones(1 << 24)
    base = root + "/base" if at in ("crc", "compare") else None
    pending = fc.save_async(root + "/" + case, {"w": t}, staging="none", base=base)
    reached.wait()
    try:
        if how == "free":
            t.untyped_storage().resize_(0)
        else:
            t.resize_(2 * t.numel())
    finally:
        go.set()
    error = pending.exception()
    print(case, type(error).__name__, os.path.exists(root + "/" + case), flush=True)
"""

CASES = [f"{how}-{at}" for how in ("free", "grow") for at in ("before", "during", "crc", "compare")]


@pytest.fixture(scope="module")
def resized(tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, dict[str, list[str]]]:
    """The child's status, its stderr, and what it printed of each case."""
    root = tmp_path_factory.mktemp("resize")
    fc.save(root / "base", {"w": torch.ones(1 << 24)})
    script = root / "child.py"
    script.write_text(CHILD)
    proc = prefork.run(
        [sys.executable, str(script), str(root), *CASES],
        capture_output=True,
        text=True,
        timeout=HANG,
    )
    told = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()}
    return proc.returncode, proc.stderr, told


def assert_refused(resized: tuple[int, str, dict[str, list[str]]], case: str) -> None:
    status, stderr, told = resized
    assert status == 0, stderr  # no crash, and the resize itself worked
    assert told[case] == ["ModifiedDuringSave", "False"]


@pytest.mark.parametrize("at", ["before", "during"])
@pytest.mark.parametrize("how", ["free", "grow"])
def test_a_storage_resized_during_an_unstaged_write_is_refused(
    resized: tuple[int, str, dict[str, list[str]]], how: str, at: str
) -> None:
    assert_refused(resized, f"{how}-{at}")


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


@pytest.mark.parametrize("at", ["crc", "compare"])
@pytest.mark.parametrize("how", ["free", "grow"])
def test_a_storage_resized_while_compared_with_the_base_is_refused(
    resized: tuple[int, str, dict[str, list[str]]], how: str, at: str
) -> None:
    assert_refused(resized, f"{how}-{at}")
