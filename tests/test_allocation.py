"""New host tensors (``state/allocation``): huge pages where cheaper, ordinary tensors always.

The decision reads the kernel's switch and the balloon's features through paths
and an explicit switch value, so every fallback is tested with files of our own,
never by changing the module. Freeing and the pages' flags are checked in a child
process, whose memory map holds nothing else of ours.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.state.allocation import (
    HUGE_PAGES_ENV,
    PREFAULT_BYTES,
    free_pages_reported,
    host_empty,
    huge_pages_default,
    thp_offered,
)
from functional_ckpt.errors import CorruptCheckpoint
from tests import prefork
from tests.patience import HANG

LINUX = sys.platform.startswith("linux")


def _thp(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "enabled"
    p.write_text(text + "\n")
    return p


def _balloon(tmp_path: Path, device: str, features: str) -> Path:
    root = tmp_path / "devices"
    dev = root / "virtio0"
    dev.mkdir(parents=True)
    (dev / "device").write_text(device + "\n")
    (dev / "features").write_text(features + "\n")
    return root


def test_huge_pages_are_offered_only_by_always_or_madvise(tmp_path: Path) -> None:
    for i, (text, offered) in enumerate(
        [
            ("always [madvise] never", True),
            ("[always] madvise never", True),
            ("always madvise [never]", False),
        ]
    ):
        (tmp_path / str(i)).mkdir()
        assert thp_offered(_thp(tmp_path / str(i), text)) is offered
    assert not thp_offered(tmp_path / "missing")


def test_a_reporting_balloon_is_seen_and_nothing_else_counts(tmp_path: Path) -> None:
    assert free_pages_reported(_balloon(tmp_path / "a", "0x0005", "01100101" + "0" * 56))
    assert not free_pages_reported(_balloon(tmp_path / "b", "0x0005", "01100001" + "0" * 56))
    assert not free_pages_reported(_balloon(tmp_path / "c", "0x0002", "01100101" + "0" * 56))
    assert not free_pages_reported(_balloon(tmp_path / "d", "junk", "1"))
    assert not free_pages_reported(tmp_path / "none")


def test_the_default_follows_the_switch_then_the_kernel(tmp_path: Path) -> None:
    offered = _thp(tmp_path, "always [madvise] never")
    never = tmp_path / "never"
    never.write_text("always madvise [never]\n")
    quiet = tmp_path / "no-devices"
    reporting = _balloon(tmp_path / "r", "0x0005", "00000100")
    assert huge_pages_default("0", enabled=offered, devices=quiet) is False
    assert huge_pages_default("off", enabled=offered, devices=quiet) is False
    assert huge_pages_default("1", enabled=never, devices=reporting) is True
    assert huge_pages_default("", enabled=never, devices=quiet) is False
    assert huge_pages_default("auto", enabled=offered, devices=reporting) is False
    assert huge_pages_default("auto", enabled=offered, devices=quiet) is LINUX


@pytest.mark.parametrize("huge", [True, False])
def test_new_tensors_are_ordinary_and_independent(huge: bool) -> None:
    n = 3 * PREFAULT_BYTES // 4
    a = host_empty((n,), torch.float32, huge=huge)
    b = host_empty((n,), torch.float32, huge=huge)
    assert a.shape == (n,) and a.dtype == torch.float32 and a.is_contiguous()
    a.fill_(1.0)
    b.fill_(2.0)
    assert a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())
    a.resize_(2 * n)  # an ordinary, resizable storage
    assert a.shape == (2 * n,) and bool((a[:n] == 1.0).all())
    small = host_empty((3, 4), torch.bfloat16, huge=huge)
    assert small.shape == (3, 4) and small.dtype == torch.bfloat16


_CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    from functional_ckpt._src.state.allocation import host_empty

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def flags(ptr):
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
        inside = False
        for line in lines:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
        return []

    huge = sys.argv[1] == "1"
    before = rss()
    ts = [host_empty((64 << 20,), torch.uint8, huge=huge) for _ in range(3)]
    for t in ts:
        t.fill_(7)
    mid = (ts[0].data_ptr() + (32 << 20)) & ~((2 << 20) - 1)
    held = rss()
    vm = flags(mid)
    del ts, t
    after = rss()
    print(json.dumps({"before": before, "held": held, "after": after, "flags": vm}))
    """
)


def _child(huge: bool) -> dict[str, object]:
    out = prefork.run(
        [sys.executable, "-c", _CHILD, "1" if huge else "0"],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=True,
    )
    result: dict[str, object] = json.loads(out.stdout)
    return result


@pytest.mark.skipif(not LINUX, reason="/proc and madvise are Linux's")
@pytest.mark.parametrize("huge", [True, False])
def test_dropping_the_tensors_returns_their_memory(huge: bool) -> None:
    got = _child(huge)
    before, held, after = (int(str(got[k])) for k in ("before", "held", "after"))
    size = 3 * (64 << 20)
    assert held - before >= size * 0.9
    assert held - after >= size * 0.9
    flags = got["flags"]
    assert isinstance(flags, list)
    assert ("hg" in flags) == (huge and thp_offered())  # advised only when asked, and offered


def test_restores_are_bit_identical_with_and_without_huge_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(3)
    state = {
        "big": torch.randn(3 << 20, generator=gen),  # 12 MiB
        "mid": torch.randint(0, 255, (5 << 20,), dtype=torch.uint8, generator=gen),
        "odd": torch.randn(1000, 1037, generator=gen).to(torch.bfloat16),
        "small": torch.arange(10),
    }
    fc.save(tmp_path / "ck", state)
    like = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
    for value in ("1", "0"):
        monkeypatch.setenv(HUGE_PAGES_ENV, value)
        for got in (fc.restore(tmp_path / "ck", like), fc.restore(tmp_path / "ck")):
            for k, v in state.items():
                assert torch.equal(got[k], v), (value, k)
                assert got[k].dtype == v.dtype


_PREFAULT_CHILD = textwrap.dedent(
    """
    import json
    import torch
    from functional_ckpt._src.state.allocation import Prefaulter, host_empty

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    ts = [host_empty((64 << 20,), torch.uint8, fault=False) for _ in range(3)]
    before = rss()  # advised, not faulted in: nothing resident yet
    faults = Prefaulter(ts, block=4 << 20)
    faults.ready(ts[2].data_ptr(), 64 << 20)  # the last byte of the last one
    ready = rss()
    faults.close()
    faults.ready(12345, 1)  # a tensor it was not given: ready at once
    stopped = Prefaulter(ts, block=1 << 12)
    stopped.close()  # stops between blocks: nothing runs on once it returns
    print(json.dumps({"before": before, "ready": ready}))
    """
)


@pytest.mark.skipif(not LINUX, reason="/proc and madvise are Linux's")
def test_a_prefaulter_has_the_pages_in_before_it_says_ready() -> None:
    out = prefork.run(
        [sys.executable, "-c", _PREFAULT_CHILD],
        capture_output=True,
        text=True,
        timeout=HANG,
        check=True,
    )
    got = json.loads(out.stdout)
    assert got["ready"] - got["before"] >= 3 * (64 << 20) * 0.9


def test_restores_into_new_memory_faulted_in_beside_the_reads_are_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large new tensors are read a block at a time while a thread faults them in; with
    madvise missing (an old libc) the thread does nothing and the reads fault as usual."""
    from functional_ckpt._src.state import allocation

    gen = torch.Generator().manual_seed(5)
    state = {f"w{i}": torch.randn((5 << 20) + 3 * i, generator=gen) for i in range(4)}
    state["small"] = torch.arange(7)
    state["half"] = torch.randn(3 << 20, generator=gen).half()
    fc.save(tmp_path / "ck", state)
    like = {k: torch.empty_like(v, device="meta") for k, v in state.items()}
    closed: list[int] = []
    real_close = allocation.Prefaulter.close

    def close(self: allocation.Prefaulter) -> None:
        closed.append(len(self._ranges))
        real_close(self)

    monkeypatch.setattr(allocation.Prefaulter, "close", close)
    for madvise in (allocation._MADVISE, None):
        monkeypatch.setattr(allocation, "_MADVISE", madvise)
        out = {k: torch.full_like(v, 9) for k, v in state.items()}
        for got in (
            fc.restore(tmp_path / "ck", like),
            fc.restore(tmp_path / "ck"),
            fc.restore(tmp_path / "ck", like={k: v.double() for k, v in state.items()}, cast=True),
            fc.restore(tmp_path / "ck", out=out),
        ):
            for k, v in state.items():
                assert torch.equal(got[k].to(v.dtype), v), k
    assert closed and all(n == 5 for n in closed[:2])  # every new large tensor, in read order
    # a damaged large blob: the restore fails, and the thread is stopped all the same
    from functional_ckpt._src.restore.read import vetted_view

    chunk = vetted_view(tmp_path / "ck").tensors[("w2",)].chunks[0]
    with open(tmp_path / "ck" / chunk.file, "r+b") as f:
        f.seek(chunk.data_offset + (3 << 20))
        f.write(b"\xff\xff")
    closed.clear()
    with pytest.raises(CorruptCheckpoint, match="'w2'"):
        fc.restore(tmp_path / "ck", like)
    assert closed == [5]
