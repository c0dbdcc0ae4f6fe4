"""Durable save / restore: functional_ckpt against the tools people use instead.

What is compared, in one run, on the same disk, with every save made durable:

save
  ``fc.save``; ``torch.save`` + flush + fsync (file and directory);
  ``safetensors.torch.save_file`` + fsync; stock ``torch.distributed.checkpoint.save``
  (default ``FileSystemWriter``, which fsyncs); and a *raw write+fsync* of the same
  tensor bytes into one file, one ``writev`` per 1,024 tensors -- the floor no
  checkpoint format can beat -- and a raw
  write+fsync of as many bytes, in as many files, as ``fc.save`` writes (the floor of
  any DCP-compatible layout, whose every tensor is framed as a small ``torch.save``
  archive).
restore (warm page cache: each restore reads the files its tool has just written)
  ``fc.restore(path, like)`` (pure: a new state in new tensors, ``like`` untouched),
  ``fc.restore(path, out=template)`` (in place, into preallocated tensors) and
  ``fc.restore(path)`` (no ``like``); ``torch.load`` (``weights_only=True``);
  ``safetensors.torch.load_file``; ``dcp.load`` into preallocated tensors; and a
  *raw read* of the bytes (one ``preadv`` per 1,024 tensors) into the template (the
  floor of an in-place restore) and
  into newly allocated tensors (the floor of a restore that returns new tensors:
  the kernel must hand out and zero the new pages, which on a virtual machine can
  cost more than the read itself), and into new tensors whose memory is advised for
  transparent huge pages (the floor where 2 MiB pages are cheaper; the report says
  whether this kernel offers them and whether fc asks for them by default here);
  ``safetensors.load_file`` is also timed with every page of every tensor touched
  after loading (its plain row maps the file and reads nothing yet). The ratios of
  fc's rows to their floors are printed under the table.

peers (where ``torch_checkpointing`` is installed: the ``bench`` extra)
  ``torch_checkpointing``'s ``CheckpointManager`` with its sync saver, made durable
  through its ``pre_finalize_callback``/``finalize_callback`` hooks, and also as
  shipped (no fsync); its ``load(into=template)`` (in place) and ``load()`` (new
  tensors); see ``benchmarks/_peers.py``. And ``dcp.save``/``dcp.load`` through this
  package's ``functional_ckpt.integrations.dcp.Writer``/``Reader`` (what DCP's storage seam costs).

Two states: *big* (16 x 64 MiB float32, 1 GiB: bandwidth-bound) and *small*
(10,000 x 1 KiB float32 plus 1,000 plain Python values: per-tensor overhead-bound;
safetensors stores only the tensors there). Why these tools: functional_ckpt writes
DCP-compatible files, so it must beat stock DCP clearly, stay near the raw-disk floor
and not lose to the one-file formats; these targets are checked as ratios within the
run, since the machine is shared and absolute times are noisy.

Each tool runs ``--reps`` times, interleaved (repetition k runs every tool, starting
from a rotated position), and the median is reported. Also measured:

* checksum cost: ``functional_ckpt._src.storage.shards`` has no switch to disable checksums, so
  the cost is estimated as the time of functional_ckpt's ``crc32`` over the same tensor bytes in
  the same run, divided by the ``fc.save`` time (an upper bound: fc checksums large
  tensors in a background thread while it writes). For information the run also
  times ``fc.save`` with ``zlib`` stubbed out inside ``functional_ckpt._src.storage.shards``.
* the kernel's share of a restore into new tensors: the tensors allocated and their
  pages faulted in, nothing read (as a fraction of ``dcp.load``, the least any such
  restore can reach on this machine).
* peak RSS of a restore of the 1 GiB state, in a fresh child process: peak
  ``ru_maxrss`` minus the RSS once the template (or ``like``) is allocated and
  touched, as a fraction of the state size, for ``fc.restore(like)`` (its result is
  new memory: about 1.0x is the floor), ``fc.restore(out=)`` and ``dcp.load``.

Usage::

    python benchmarks/save_restore.py [--quick] [--reps N] [--dir DIR] [--json PATH]
                                      [--only save|restore] [--state big|small|both]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import itertools
import json
import os
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _peers
import torch
from _common import (
    REPO_ROOT,
    KiB,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    check_not_tmpfs,
    environment,
    finish,
    fmt_rate,
    fmt_ratio,
    fmt_seconds,
    fsync_dir,
    fsync_file,
    measure_peak_above_baseline,
    median,
    ratio,
    read_views,
    remove_path,
    render_targets,
    run_json_child,
    scratch_dir,
    settle,
    timed,
    write_views,
    write_views_durably,
)
from _peers import TC_LOAD_INTO, TC_LOAD_NEW, TC_SAVE, TC_SAVE_PLAIN

from functional_ckpt._src.format.checksum import BACKEND as CRC_BACKEND
from functional_ckpt._src.format.checksum import crc32 as fc_crc32

# Tool labels, used as row keys in the table, the JSON and the targets.
FC_SAVE = "fc.save"
FC_SAVE_NOCRC = "fc.save (crc32 stubbed)"
TORCH_SAVE = "torch.save+fsync"
ST_SAVE = "safetensors.save_file+fsync"
DCP_SAVE = "dcp.save"
RAW_SAVE = "raw write+fsync"
RAW_SAVE_LATE = "raw write+fsync (writeback left to fsync)"
RAW_SAVE_FC = "raw write+fsync of fc's file sizes"
FC_RESTORE_LIKE = "fc.restore(like)"
FC_RESTORE_OUT = "fc.restore(out=)"
FC_RESTORE = "fc.restore()"
TORCH_LOAD = "torch.load(weights_only)"
ST_LOAD = "safetensors.load_file"
DCP_LOAD = "dcp.load(template)"
RAW_READ = "raw read into template"
RAW_READ_NEW = "raw read into new tensors"
RAW_READ_HUGE = "raw read into new huge-page tensors"
NEW_PAGES = "new tensors' pages alone (nothing read)"
ST_LOAD_TOUCHED = "safetensors.load_file + touch"
CRC = f"crc32 ({CRC_BACKEND}) of tensor bytes"
DCP_FC_SAVE = "dcp.save(storage_writer=integrations.dcp.Writer)"
DCP_FC_LOAD = "dcp.load(storage_reader=integrations.dcp.Reader)"


def import_fc() -> types.ModuleType:
    """Import functional_ckpt, from the repository when it is not installed."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    import functional_ckpt

    return functional_ckpt


def import_dcp() -> types.ModuleType:
    import torch.distributed.checkpoint as dcp

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")

    return dcp


# --------------------------------------------------------------------------- states


@dataclass
class Workload:
    """One state to save: flat-keyed tensors plus plain Python values."""

    name: str  # "big" | "small"
    label: str
    tensors: dict[str, torch.Tensor]
    values: dict[str, Any] = field(default_factory=dict)
    #: The sizes of the files fc.save writes for this state (measured once, untimed).
    fc_files: dict[str, int] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def state(self) -> dict[str, Any]:
        """What fc.save, torch.save and dcp.save receive."""
        return {**self.tensors, **self.values}

    def template(self) -> dict[str, Any]:
        """Preallocated, touched tensors of the right shapes, plus the same values."""
        tensors = {k: torch.zeros_like(t) for k, t in self.tensors.items()}
        return {**tensors, **dict(self.values)}


def _plain_value(i: int) -> Any:
    kind = i % 4
    if kind == 0:
        return i
    if kind == 1:
        return i * 0.5
    if kind == 2:
        return f"value-{i}"
    return [i, i + 1, f"v{i}"]


def big_workload(count: int, numel: int) -> Workload:
    gen = torch.Generator().manual_seed(0)
    tensors = {f"w{i}": torch.randn(numel, generator=gen) for i in range(count)}
    size = count * numel * 4
    return Workload(
        "big", f"{count} x {numel * 4 // MiB} MiB float32 ({size / MiB:.0f} MiB)", tensors
    )


def small_workload(count: int, numel: int, values: int) -> Workload:
    gen = torch.Generator().manual_seed(1)
    tensors = {f"layer{i}.w": torch.randn(numel, generator=gen) for i in range(count)}
    plain = {f"meta{i}": _plain_value(i) for i in range(values)}
    label = f"{count} x {numel * 4 // KiB} KiB float32 + {values} values"
    return Workload("small", label, tensors, plain)


# --------------------------------------------------------------------------- competitors


def byte_view(t: torch.Tensor) -> memoryview:
    """Raw bytes of a contiguous CPU tensor, no copy."""
    array: Any = t.detach().reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def fc_save(dest: Path, w: Workload) -> None:
    import_fc().save(dest, w.state())


def torch_save(dest: Path, w: Workload) -> None:
    with open(dest, "wb") as f:
        torch.save(w.state(), f)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(dest.parent)


def safetensors_save(dest: Path, w: Workload) -> None:
    from safetensors.torch import save_file

    save_file(w.tensors, str(dest))
    fsync_file(dest)
    fsync_dir(dest.parent)


def dcp_save(dest: Path, w: Workload) -> None:
    import_dcp().save(w.state(), checkpoint_id=dest, no_dist=True)


def dcp_fc_save(dest: Path, w: Workload) -> None:
    import_fc()
    from functional_ckpt.integrations.dcp import Writer

    import_dcp().save(w.state(), storage_writer=Writer(dest), no_dist=True)


def tc_save(dest: Path, w: Workload) -> None:
    _peers.tc_save(dest, w.state())


def tc_save_plain(dest: Path, w: Workload) -> None:
    _peers.tc_save(dest, w.state(), durable=False)


def raw_save(dest: Path, w: Workload) -> None:
    write_views_durably(dest, (byte_view(t) for t in w.tensors.values()))


def raw_save_late(dest: Path, w: Workload) -> None:
    """The raw floor as earlier runs measured it: one writev, then the fsync writes all."""
    write_views_durably(dest, (byte_view(t) for t in w.tensors.values()), writeback=False)


def raw_save_fc_sizes(dest: Path, w: Workload) -> None:
    """As many bytes, in as many files, as fc.save writes, each fsynced, then the directory.

    The floor of a save in any DCP-compatible layout: each tensor of a DCP file is a
    small ``torch.save`` zip archive (fc's keeps about 0.5 KB of framing around a
    1 KiB tensor), and the manifest and DCP's ``.metadata`` are files of their own.
    """
    dest.mkdir()
    views = [byte_view(t) for t in w.tensors.values()]
    for name, size in w.fc_files.items():
        parts = []
        left = size
        for v in itertools.cycle(views):
            if left <= 0:
                break
            parts.append(v[:left])
            left -= len(parts[-1])
        fd = os.open(dest / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            write_views(fd, parts, writeback=True)
            os.fsync(fd)
        finally:
            os.close(fd)
    fsync_dir(dest)
    fsync_dir(dest.parent)


def fc_file_sizes(w: Workload, workdir: Path) -> dict[str, int]:
    """The files fc.save writes for ``w`` and their sizes (one untimed save)."""
    dest = workdir / f"{w.name}-fc-sizes"
    remove_path(dest)
    fc_save(dest, w)
    sizes = {p.name: p.stat().st_size for p in sorted(dest.iterdir()) if p.is_file()}
    remove_path(dest)
    return sizes


def fc_restore_like(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return import_fc().restore(src, template)


def fc_restore_out(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return import_fc().restore(src, out=template)


def fc_restore(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return import_fc().restore(src)


def torch_load(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return torch.load(src, weights_only=True)


def safetensors_load(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    from safetensors.torch import load_file

    return load_file(str(src))


def touch_pages(t: torch.Tensor) -> int:
    """Read one byte of every 4 KiB page of ``t`` (what using a lazily loaded tensor costs)."""
    flat = t.detach().reshape(-1).view(torch.uint8)
    return int(flat[::4096].sum()) if flat.numel() else 0


def safetensors_load_touched(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    """``load_file`` and then every page of every tensor touched: the cost of using it."""
    from safetensors.torch import load_file

    out = load_file(str(src))
    for t in out.values():
        touch_pages(t)
    return out


def dcp_load(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    import_dcp().load(template, checkpoint_id=src, no_dist=True)
    return template


def dcp_fc_load(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    from functional_ckpt.integrations.dcp import Reader

    import_dcp().load(template, storage_reader=Reader(src), no_dist=True)
    return template


def tc_load_into(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return _peers.tc_load_into(src, template)


def tc_load_new(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    return _peers.tc_load_new(src)


def raw_read(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    read_views(src, (byte_view(template[k]) for k in w.tensors))
    return template


def raw_read_new(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    """The floor of any restore that returns new tensors: allocate them, read the bytes."""
    fresh = {k: torch.empty_like(t) for k, t in w.tensors.items()}
    read_views(src, (byte_view(t) for t in fresh.values()))
    return fresh


def raw_read_huge(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    """The floor of a restore into new tensors where the kernel gives huge pages.

    Tensors from ``PREFAULT_BYTES`` on are advised for huge pages, whatever the
    machine's default (see :func:`memory_facts` for what this machine offers).
    """
    from functional_ckpt._src.state.allocation import host_empty

    fresh = {k: host_empty(tuple(t.shape), t.dtype, huge=True) for k, t in w.tensors.items()}
    read_views(src, (byte_view(t) for t in fresh.values()))
    return fresh


def new_pages(src: Path, w: Workload, template: dict[str, Any]) -> Any:
    """What the kernel alone costs a restore into new tensors: allocate them and fault
    their pages in (as fc does, one call per large tensor), reading nothing."""
    from functional_ckpt._src.state.allocation import host_empty

    return {k: host_empty(tuple(t.shape), t.dtype) for k, t in w.tensors.items()}


def memory_facts() -> dict[str, Any]:
    """What the huge-page floor measured here, and what fc does by default."""
    import_fc()
    from functional_ckpt._src.state import allocation

    enabled = (
        allocation.THP_ENABLED.read_text().strip() if allocation.THP_ENABLED.exists() else None
    )
    return {
        "thp_enabled": enabled,
        "thp_offered": allocation.thp_offered(),
        "free_page_reporting": allocation.free_pages_reported(),
        "fc_huge_pages_default": allocation.huge_pages_default(),
        "switch": f"{allocation.HUGE_PAGES_ENV}={os.environ.get(allocation.HUGE_PAGES_ENV, '')}",
    }


def describe_memory(facts: dict[str, Any]) -> str:
    if not facts["thp_offered"]:
        floor = (
            f"the kernel offers no transparent huge pages (enabled: {facts['thp_enabled']}), "
            f"so '{RAW_READ_HUGE}' measured 4 KiB pages, the same floor as '{RAW_READ_NEW}'"
        )
    else:
        floor = f"'{RAW_READ_HUGE}' measured 2 MiB pages (enabled: {facts['thp_enabled']})"
    if facts["free_page_reporting"]:
        floor += (
            "; a virtio balloon reports free 2 MiB blocks to the host, so huge pages come "
            "from memory the host discarded"
        )
    mode = "asks for huge pages" if facts["fc_huge_pages_default"] else "uses 4 KiB pages"
    return f"memory: {floor}; fc by default {mode} ({facts['switch'] or 'switch unset'})"


#: (state, numerator, floor) ratios printed beside the table.
FLOORS = [
    ("save", FC_SAVE, RAW_SAVE),
    ("save", FC_SAVE, RAW_SAVE_FC),
    ("save", FC_SAVE, RAW_SAVE_LATE),
    ("restore", FC_RESTORE_LIKE, RAW_READ_NEW),
    ("restore", FC_RESTORE_LIKE, RAW_READ_HUGE),
    ("restore", FC_RESTORE, RAW_READ_NEW),
    ("restore", FC_RESTORE_OUT, RAW_READ),
    ("restore", ST_LOAD_TOUCHED, RAW_READ_NEW),
    ("restore", NEW_PAGES, DCP_LOAD),  # the least a restore into new tensors pays
]


def floor_lines_from_rows(rows: list[dict[str, Any]]) -> list[str]:
    """Each fc row (and safetensors with its pages touched) over the floor it is judged by."""
    med = {(r["state"], r["op"], r["tool"]): r["median_s"] for r in rows}
    out = []
    for state in dict.fromkeys(r["state"] for r in rows):
        for op, num, den in FLOORS:
            value = ratio(med.get((state, op, num)), med.get((state, op, den)))
            if value is not None:
                out.append(f"{state}: {num} / {den} = {value:.2f}x")
    return out


Restorer = Callable[[Path, Workload, dict[str, Any]], Any]


def _no_note(w: Workload) -> str:
    return ""


def _st_note(w: Workload) -> str:
    return "tensors only (no values)" if w.values else ""


def _st_load_note(w: Workload) -> str:
    lazy = "mmap-backed: data pages are read on first touch, after the timing"
    return f"{_st_note(w)}; {lazy}" if w.values else lazy


@dataclass
class Restore:
    label: str
    fn: Restorer
    note: Callable[[Workload], str] = _no_note
    checked: bool = True  # its result holds the saved tensors (spot-checked, untimed)


@dataclass
class Tool:
    """A save function and the restores that read what it wrote."""

    save_label: str
    save: Callable[[Path, Workload], None]
    filename: str
    restores: list[Restore]
    note: Callable[[Workload], str] = _no_note


def tools() -> list[Tool]:
    fc_restores = [
        Restore(FC_RESTORE_LIKE, fc_restore_like),
        Restore(FC_RESTORE_OUT, fc_restore_out),
        Restore(FC_RESTORE, fc_restore),
    ]
    return [
        Tool(FC_SAVE, fc_save, "fc", fc_restores),
        Tool(TORCH_SAVE, torch_save, "model.pt", [Restore(TORCH_LOAD, torch_load)]),
        Tool(
            ST_SAVE,
            safetensors_save,
            "model.safetensors",
            [
                Restore(ST_LOAD, safetensors_load, _st_load_note),
                Restore(ST_LOAD_TOUCHED, safetensors_load_touched, _st_note),
            ],
            _st_note,
        ),
        Tool(DCP_SAVE, dcp_save, "dcp", [Restore(DCP_LOAD, dcp_load)]),
        Tool(DCP_FC_SAVE, dcp_fc_save, "dcp-fc", [Restore(DCP_FC_LOAD, dcp_fc_load)]),
        *peer_tools(),
        Tool(RAW_SAVE_FC, raw_save_fc_sizes, "raw-fc-sizes", []),
        Tool(RAW_SAVE_LATE, raw_save_late, "raw-late.bin", []),
        Tool(
            RAW_SAVE,
            raw_save,
            "raw.bin",
            [
                Restore(RAW_READ, raw_read),
                Restore(RAW_READ_NEW, raw_read_new),
                Restore(RAW_READ_HUGE, raw_read_huge),
                Restore(NEW_PAGES, new_pages, checked=False),
            ],
        ),
    ]


def peer_tools() -> list[Tool]:
    """torch_checkpointing's rows, where it is installed (the ``bench`` extra)."""
    if not _peers.available():
        return []
    loads = [Restore(TC_LOAD_INTO, tc_load_into), Restore(TC_LOAD_NEW, tc_load_new)]
    return [Tool(TC_SAVE, tc_save, "tc", loads), Tool(TC_SAVE_PLAIN, tc_save_plain, "tc-plain", [])]


# --------------------------------------------------------------------------- checks


def _get(result: Any, key: str) -> torch.Tensor:
    value = result.get(key) if hasattr(result, "get") else result[key]
    assert isinstance(value, torch.Tensor), f"{key}: got {type(value).__name__}"
    return value


def check_restored(result: Any, w: Workload, label: str) -> None:
    """Spot-check the first and last tensors (outside the timed region)."""
    for key in (next(iter(w.tensors)), next(reversed(w.tensors))):
        if not torch.equal(_get(result, key), w.tensors[key]):
            raise AssertionError(f"{label}: restored {key!r} differs from what was saved")


def clear_template(template: dict[str, Any]) -> None:
    for v in template.values():
        if isinstance(v, torch.Tensor):
            v.zero_()


@contextlib.contextmanager
def crc_stubbed() -> Iterator[bool]:
    """Replace the crc32 used by ``functional_ckpt._src.storage.shards`` by a no-op (info only)."""
    shards = sys.modules.get("functional_ckpt._src.storage.shards")
    original = getattr(shards, "crc32", None)
    if shards is None or original is None:
        yield False
        return
    shards.crc32 = lambda data, start=0: start  # type: ignore[attr-defined]
    try:
        yield True
    finally:
        shards.crc32 = original  # type: ignore[attr-defined]


# --------------------------------------------------------------------------- running


@dataclass
class Results:
    """Every timing of one run, keyed by (state, op, label)."""

    times: dict[tuple[str, str, str], list[float]] = field(default_factory=dict)
    notes: dict[tuple[str, str, str], str] = field(default_factory=dict)

    def add(self, key: tuple[str, str, str], seconds: float, note: str = "") -> None:
        self.times.setdefault(key, []).append(seconds)
        if note:
            self.notes[key] = note

    def median(self, state: str, op: str, label: str) -> float | None:
        xs = self.times.get((state, op, label))
        return median(xs) if xs else None


@dataclass
class Options:
    reps: int
    workdir: Path
    do_save: bool
    do_restore: bool
    crc_stub: bool


def run_tool(
    tool: Tool, w: Workload, template: dict[str, Any], opts: Options, res: Results
) -> None:
    """Save once (timed when saves are measured), then time each restore (warm cache)."""
    dest = opts.workdir / f"{w.name}-{tool.filename}"
    remove_path(dest)
    settle()
    gc.collect()
    seconds, _ = timed(lambda: tool.save(dest, w))
    if opts.do_save:
        res.add((w.name, "save", tool.save_label), seconds, tool.note(w))
    if opts.do_restore:
        for r in tool.restores:
            clear_template(template)
            gc.collect()
            seconds, out = timed(lambda fn=r.fn: fn(dest, w, template))  # type: ignore[misc]
            if r.checked:
                check_restored(out, w, r.label)
            res.add((w.name, "restore", r.label), seconds, r.note(w))
            del out
    remove_path(dest)
    settle()


def run_checksum(w: Workload, opts: Options, res: Results) -> None:
    """Time crc32 over the tensor bytes, and (info) fc.save with checksums stubbed."""
    views = [byte_view(t) for t in w.tensors.values()]

    def crc_all() -> int:
        return sum(fc_crc32(v) for v in views)

    seconds, _ = timed(crc_all)
    res.add((w.name, "checksum", CRC), seconds)
    if not opts.crc_stub:
        return
    dest = opts.workdir / f"{w.name}-fc-nocrc"
    remove_path(dest)
    settle()
    gc.collect()
    with crc_stubbed() as active:
        if active:
            seconds, _ = timed(lambda: fc_save(dest, w))
            res.add((w.name, "save", FC_SAVE_NOCRC), seconds, "info only")
    remove_path(dest)
    settle()


def rotated(items: Sequence[Tool], k: int) -> list[Tool]:
    k %= len(items)
    return [*items[k:], *items[:k]]


def warm_up(opts: Options) -> None:
    """One untimed pass of every tool over a tiny state: lazy imports, caches, pools."""
    tiny = small_workload(4, 256, 4)
    tiny.fc_files = fc_file_sizes(tiny, opts.workdir)
    for tool in tools():
        run_tool(tool, tiny, tiny.template(), opts, Results())


def run_workload(w: Workload, opts: Options, res: Results, log: Callable[[str], None]) -> None:
    template = w.template()
    w.fc_files = fc_file_sizes(w, opts.workdir)
    all_tools = tools()
    for rep in range(opts.reps):
        log(f"  {w.name}: repetition {rep + 1}/{opts.reps}")
        for tool in rotated(all_tools, rep):
            run_tool(tool, w, template, opts, res)
        if opts.do_save:
            run_checksum(w, opts, res)


# --------------------------------------------------------------------------- peak RSS


def rss_child(tool: str, path: Path, spec: dict[str, int]) -> dict[str, Any]:
    """In a fresh process: allocate the template, then restore (like it or into it)."""
    fc = import_fc()
    dcp = import_dcp()
    importlib.import_module("torch.distributed.checkpoint.filesystem")  # before the baseline
    if tool.startswith("tc-"):
        _peers.manager(asynchronous=False, durable=True)  # imported before the baseline too
    template = {k: torch.zeros(n, dtype=torch.float32) for k, n in spec.items()}

    kept: list[Any] = []

    def restore() -> None:
        if tool == "fc-like":
            kept.append(fc.restore(path, template))  # the result counts: it is the state
        elif tool == "fc-out":
            kept.append(fc.restore(path, out=template))
        elif tool == "tc-into":
            kept.append(_peers.tc_load_into(path, template))
        elif tool == "tc-new":
            kept.append(_peers.tc_load_new(path))
        else:
            dcp.load(template, checkpoint_id=path, no_dist=True)

    return {"tool": tool, **measure_peak_above_baseline(restore)}


def measure_peak_rss(w: Workload, opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    """Peak RSS above the template for fc.restore and dcp.load, each in a new process."""
    spec = {k: t.numel() for k, t in w.tensors.items()}
    out: dict[str, Any] = {}
    runs = (
        ("fc-like", fc_save, FC_RESTORE_LIKE),
        ("fc-out", fc_save, FC_RESTORE_OUT),
        ("dcp", dcp_save, DCP_LOAD),
        *(
            (("tc-into", tc_save, TC_LOAD_INTO), ("tc-new", tc_save, TC_LOAD_NEW))
            if _peers.available()
            else ()
        ),
    )
    for tool, save, label in runs:
        dest = opts.workdir / f"rss-{tool}"
        remove_path(dest)
        save(dest, w)
        log(f"  peak RSS: {label}")
        argv = [
            __file__,
            "--rss-child",
            tool,
            "--rss-path",
            str(dest),
            "--rss-spec",
            json.dumps(spec),
        ]
        child = run_json_child(argv)
        child["fraction"] = child["extra"] / w.nbytes
        out[label] = child
        remove_path(dest)
    return out


# --------------------------------------------------------------------------- targets


@dataclass(frozen=True)
class Target:
    name: str
    state: str
    num: tuple[str, str]  # (op, label)
    den: tuple[str, str] | None  # None: ``num`` is already a fraction
    limit: float


TARGETS = [
    Target("save: fc.save / raw write+fsync", "big", ("save", FC_SAVE), ("save", RAW_SAVE), 1.1),
    Target("save: fc.save / dcp.save", "big", ("save", FC_SAVE), ("save", DCP_SAVE), 1.0),
    Target(
        "restore: fc.restore(like) / dcp.load",
        "big",
        ("restore", FC_RESTORE_LIKE),
        ("restore", DCP_LOAD),
        0.3,
    ),
    Target(
        "restore: peak RSS above like / state size (fc, like: the new state)",
        "big",
        ("rss", FC_RESTORE_LIKE),
        None,
        1.1,
    ),
    Target(
        "restore: fc.restore(out=) / dcp.load",
        "big",
        ("restore", FC_RESTORE_OUT),
        ("restore", DCP_LOAD),
        0.3,
    ),
    Target(
        "restore: peak RSS above template / state size (fc, out=)",
        "big",
        ("rss", FC_RESTORE_OUT),
        None,
        0.05,
    ),
    Target(
        "restore: fc.restore(like) / fc.restore(out=)",
        "big",
        ("restore", FC_RESTORE_LIKE),
        ("restore", FC_RESTORE_OUT),
        1.3,
    ),
    Target("checksum: crc32 time / fc.save time", "big", ("checksum", CRC), ("save", FC_SAVE), 0.1),
    Target("save: fc.save / raw write+fsync", "small", ("save", FC_SAVE), ("save", RAW_SAVE), 1.5),
    Target(
        "restore: fc.restore(like) / raw read into new tensors",
        "small",
        ("restore", FC_RESTORE_LIKE),
        ("restore", RAW_READ_NEW),
        2.0,
    ),
    Target(
        "restore: fc.restore(like) / safetensors.load_file + touch",
        "small",
        ("restore", FC_RESTORE_LIKE),
        ("restore", ST_LOAD_TOUCHED),
        1.0,
    ),
    Target(
        "restore: like / no template, fc.restore(like) / fc.restore() (wall clock)",
        "small",
        ("restore", FC_RESTORE_LIKE),
        ("restore", FC_RESTORE),
        1.0,
    ),
    Target("save: fc.save / dcp.save", "small", ("save", FC_SAVE), ("save", DCP_SAVE), 0.3),
    Target("save: fc.save / torch.save", "small", ("save", FC_SAVE), ("save", TORCH_SAVE), 1.0),
    Target(
        "restore: fc.restore(like) / dcp.load",
        "small",
        ("restore", FC_RESTORE_LIKE),
        ("restore", DCP_LOAD),
        0.3,
    ),
    Target(
        "restore: fc.restore(out=) / dcp.load",
        "small",
        ("restore", FC_RESTORE_OUT),
        ("restore", DCP_LOAD),
        0.3,
    ),
    Target(
        "checksum: crc32 time / fc.save time", "small", ("checksum", CRC), ("save", FC_SAVE), 0.1
    ),
    *(
        Target(f"{op}: {fc_label} / {peer}", state, (op, fc_label), (op, peer), 1.0)
        for state in ("big", "small")
        for op, fc_label, peer in (
            ("save", FC_SAVE, TC_SAVE),
            ("restore", FC_RESTORE_LIKE, TC_LOAD_NEW),
            ("restore", FC_RESTORE_OUT, TC_LOAD_INTO),
        )
    ),
]


def template_ab(w: Workload, opts: Options, reps: int = 9) -> dict[str, Any]:
    """The template row as it is judged: ``fc.restore(like)`` and ``fc.restore()`` of one
    checkpoint, alternating in one process, in CPU time (which the machine's other
    work does not stretch, as it does the wall clock of a loaded machine), medians."""
    fc, like, dest = import_fc(), w.template(), opts.workdir / f"{w.name}-ab"
    fc_save(dest, w)
    times: dict[str, list[float]] = {"like": [], "none": []}
    try:
        for _ in range(reps):
            for name, like_or_none in (("like", like), ("none", None)):
                t0 = time.process_time()
                fc.restore(dest, like_or_none)
                times[name].append(time.process_time() - t0)
    finally:
        remove_path(dest)
    like_s, none_s = median(times["like"]), median(times["none"])
    return {
        "state": w.name,
        "reps": reps,
        "like_s": like_s,
        "none_s": none_s,
        "ratio": like_s / none_s,
    }


def target_value(t: Target, res: Results, rss: dict[str, Any]) -> float | None:
    if t.num[0] == "rss":
        entry = rss.get(t.num[1])
        return None if entry is None else float(entry["fraction"])
    num = res.median(t.state, *t.num)
    return num if t.den is None else ratio(num, res.median(t.state, *t.den))


def evaluate(res: Results, rss: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for t in TARGETS:
        value = target_value(t, res, rss)
        verdict = "SKIP" if value is None else ("PASS" if value <= t.limit else "FAIL")
        rows.append(
            {
                "state": t.state,
                "target": t.name,
                "value": value,
                "limit": t.limit,
                "result": verdict,
            }
        )
    return rows


# --------------------------------------------------------------------------- report


def baseline_label(op: str) -> str:
    return {"save": FC_SAVE, "restore": FC_RESTORE_LIKE, "checksum": FC_SAVE}[op]


def result_rows(res: Results, workloads: dict[str, Workload]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for (state, op, label), xs in res.times.items():
        med = median(xs)
        base_op = "save" if op == "checksum" else op
        base = res.median(state, base_op, baseline_label(op))
        rows.append(
            {
                "state": state,
                "op": op,
                "tool": label,
                "median_s": med,
                "times_s": xs,
                "bytes": workloads[state].nbytes,
                "gb_per_s": workloads[state].nbytes / med / 1e9,
                "vs_fc": ratio(base, med),
                "note": res.notes.get((state, op, label), ""),
            }
        )
    order: dict[Any, int] = {"save": 0, "checksum": 1, "restore": 2}
    rows.sort(key=lambda r: (r["state"] != "big", order[r["op"]]))
    return rows


def render_results(rows: list[dict[str, Any]], workloads: dict[str, Workload]) -> str:
    table = Table(["state", "op", "tool", "median", "tensor GB/s", "fc / tool", "note"])
    for r in rows:
        table.add(
            r["state"],
            r["op"],
            r["tool"],
            fmt_seconds(r["median_s"]),
            fmt_rate(workloads[r["state"]].nbytes, r["median_s"]),
            "-" if r["op"] == "checksum" else fmt_ratio(r["vs_fc"]),
            r["note"],
        )
    return table.render()


def render_rss(rss: dict[str, Any], size: int) -> str:
    headers = ["restore (fresh process)", "RSS with template", "peak RSS", "extra", "extra / state"]
    table = Table([*headers, "peak from"])
    for label, e in rss.items():
        table.add(
            label,
            f"{e['baseline'] / MiB:.0f} MiB",
            f"{e['peak'] / MiB:.0f} MiB",
            f"{e['extra'] / MiB:.0f} MiB",
            f"{e['extra'] / size:.3f}",
            e["method"],
        )
    return table.render()


# --------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="small states and 2 repetitions")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 2)")
    p.add_argument("--only", choices=["save", "restore"], default=None)
    p.add_argument("--state", choices=["big", "small", "both"], default="both")
    p.add_argument(
        "--no-crc-stub",
        action="store_true",
        help="skip the informational fc.save run with crc32 stubbed out",
    )
    add_run_args(p, "save_restore")
    p.add_argument(
        "--rss-child",
        choices=["fc-like", "fc-out", "dcp", "tc-into", "tc-new"],
        help=argparse.SUPPRESS,
    )
    p.add_argument("--rss-path", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--rss-spec", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def build_workloads(args: argparse.Namespace) -> dict[str, Workload]:
    out: dict[str, Workload] = {}
    if args.state in ("big", "both"):
        out["big"] = big_workload(8, MiB) if args.quick else big_workload(16, 16 * MiB)
    if args.state in ("small", "both"):
        small = (500, 256, 50) if args.quick else (10_000, 256, 1_000)
        out["small"] = small_workload(*small)
    return out


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def checksum_info(rows: list[dict[str, Any]]) -> list[str]:
    """Informational: how much faster fc.save ran with crc32 stubbed out."""
    med = {(r["state"], r["tool"]): r["median_s"] for r in rows if r["op"] == "save"}
    out = []
    for state in ("big", "small"):
        full, stub = med.get((state, FC_SAVE)), med.get((state, FC_SAVE_NOCRC))
        if full and stub:
            out.append(f"{state}: fc.save with crc32 stubbed takes {stub / full:.2f}x the time")
    return out


def print_report(
    args: argparse.Namespace,
    opts: Options,
    fstype: str,
    workloads: dict[str, Workload],
    rows: list[dict[str, Any]],
    rss: dict[str, Any],
    targets: list[dict[str, Any]],
) -> None:
    print(
        f"\nfunctional_ckpt save/restore benchmark: {opts.reps} repetitions, medians; "
        f"scratch {args.dir} ({fstype}); every save fsynced; restores read a WARM page cache "
        "(right after the same tool's save)."
    )
    for w in workloads.values():
        print(f"  {w.name}: {w.label} ({w.nbytes / MiB:.1f} MiB of tensor data)")
    print("\n" + render_results(rows, workloads))
    print("\nagainst the floors (medians of this run):")
    for line in floor_lines_from_rows(rows):
        print("  " + line)
    print("  " + describe_memory(memory_facts()))
    if rss:
        print("\n" + render_rss(rss, workloads["big"].nbytes))
    print(
        "\nchecksum cost: fc.save has no switch to disable checksums, so it is "
        "estimated as fc's crc32 over the same tensor bytes (same run) / fc.save time; "
        f"'{FC_SAVE_NOCRC}' is fc.save with shards.crc32 stubbed (info only)."
    )
    for line in checksum_info(rows):
        print("  " + line)
    print("\n" + render_targets(targets, ("state", "target")))
    if args.quick:
        print("(--quick: the states are too small for the targets to mean anything)")


def make_payload(
    args: argparse.Namespace,
    opts: Options,
    fstype: str,
    workloads: dict[str, Workload],
    rows: list[dict[str, Any]],
    rss: dict[str, Any],
    targets: list[dict[str, Any]],
) -> dict[str, Any]:
    states = {
        k: {"label": w.label, "bytes": w.nbytes, "tensors": len(w.tensors), "values": len(w.values)}
        for k, w in workloads.items()
    }
    config = {
        "reps": opts.reps,
        "quick": args.quick,
        "dir": str(args.dir),
        "filesystem": fstype,
        "only": args.only,
        "state": args.state,
        "page_cache": "warm",
        "checksum_method": f"crc32 ({CRC_BACKEND}) over the tensor bytes, divided by fc.save time",
    }
    return {
        "benchmark": "save_restore",
        "config": config,
        "states": states,
        "environment": environment(),
        "rows": rows,
        "peak_rss": rss,
        "targets": targets,
        "memory": memory_facts(),
        "floors": floor_lines_from_rows(rows),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.rss_path, json.loads(args.rss_spec))))
        return 0
    import_fc()  # fail early, before any timing, if the package does not import
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    opts = Options(
        reps=args.reps or (2 if args.quick else 5),
        workdir=workdir,
        do_save=args.only in (None, "save"),
        do_restore=args.only in (None, "restore"),
        crc_stub=not args.no_crc_stub,
    )
    workloads = build_workloads(args)
    res = Results()
    rss: dict[str, Any] = {}
    ab: dict[str, Any] = {}
    try:
        warm_up(opts)
        for w in workloads.values():
            log(f"{w.name}: {w.label}")
            run_workload(w, opts, res, log)
        if opts.do_restore and "big" in workloads:
            rss = measure_peak_rss(workloads["big"], opts, log)
        if opts.do_restore and "small" in workloads:
            ab = template_ab(workloads["small"], opts)
    finally:
        _peers.close()
        remove_path(workdir)
    rows = result_rows(res, workloads)
    targets = evaluate(res, rss)
    print_report(args, opts, fstype, workloads, rows, rss, targets)
    if ab:
        print(f"\nlike / no template, in-process A/B in CPU time: {ab['ratio']:.3f} (target 1.0)")
    payload = {**make_payload(args, opts, fstype, workloads, rows, rss, targets), "template_ab": ab}
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
