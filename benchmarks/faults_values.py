"""Attacks on values and manifests: decoder budgets, view bits, limits, chunk coverage.

Each class tries real states and real (re-signed) checkpoints and counts what went
wrong instead of promising anything::

    python benchmarks/faults_values.py           # long form
    python benchmarks/faults_values.py --quick   # the short form

``benchmarks/faults.py`` runs these classes too (``values-*`` scenarios), in its one
table of every attack class.

Classes:

* ``decoder-complexity``: hash floods (int-keyed maps, sets, frozensets,
  OrderedDicts, int-keyed tree nodes) in the manifest of a real checkpoint;
* ``decoder-memory``: manifests of nothing but tiny containers or strings, with the
  peak traced memory as a multiple of the input;
* ``view-bit-aliasing``: conj/neg views next to their base, through sync, copied
  and unstaged saves;
* ``limit-symmetry``: states at and one past every limit of the table: whatever a
  save commits must load back, whatever it refuses must be refused by name with
  nothing written;
* ``chunk-coverage``: real checkpoints whose chunks were rewritten to overlap (2 to
  thousands of chunks, checksums valid) or to leave a hole under an overlap;
* ``unstaged-bypass``: ``staging="none"`` saves while a thread writes through
  ``.data`` or numpy.

Columns: ``trials`` (outcomes checked); ``ok`` (the right outcome); ``wrong`` (a
wrong value restored, a hostile input accepted, a save that cannot be loaded, a torn
state visible);
``raw`` (an error that is not a ``CheckpointError``); ``worst s`` (slowest trial,
or slowest refusal where building the attack dominates);
``worst mem`` (largest peak traced memory / input size, decoder-memory only; the
budget is 32x the input plus a fixed 96 MiB for msgpack's 1024-level parse stack).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import struct
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgpack
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.codec import encoding
from functional_ckpt._src.codec import table as codes
from functional_ckpt._src.format import keys, naming
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CheckpointError, ModifiedDuringSave, UnsupportedValue

P = 2**61 - 1  # hash(k * P) == hash(0)
#: What msgpack's C parser may hold for its 1024 nested levels (about 80 KiB each,
#: whatever the input size): the fixed part of the decoder's memory budget.
PARSE_STACK_BYTES = 96 << 20


@dataclasses.dataclass
class ClassResult:
    name: str
    trials: int = 0
    ok: int = 0
    wrong: int = 0
    raw: int = 0
    worst_s: float = 0.0
    worst_mem: float = 0.0
    problems: list[str] = dataclasses.field(default_factory=list)
    notes: dict[str, int] = dataclasses.field(default_factory=dict)  # how the ok ones went

    def note(self, what: str) -> None:
        self.notes[what] = self.notes.get(what, 0) + 1

    def fail(self, column: str, detail: str) -> None:
        setattr(self, column, getattr(self, column) + 1)
        if len(self.problems) < 20:
            self.problems.append(f"{column}: {detail[:300]}")


@contextmanager
def trial(res: ClassResult, label: str, *, timed: bool = True) -> Iterator[None]:
    """One trial; an exception escaping it is counted as wrong (or raw).

    ``timed=False`` for trials that mostly build an attack (only the library's
    refusals inside them are timed).
    """
    t0 = time.perf_counter()
    try:
        yield
    except CheckpointError as exc:
        res.fail("wrong", f"{label}: unexpected {type(exc).__name__}: {exc}")
    except Exception as exc:
        res.fail("raw", f"{label}: {type(exc).__name__}: {exc}")
    finally:
        if timed:
            res.worst_s = max(res.worst_s, time.perf_counter() - t0)


def refused(
    res: ClassResult, label: str, fn: Callable[[], Any], kind: type[BaseException], text: str
) -> None:
    """``fn`` must raise ``kind`` with ``text`` in its message."""
    t0 = time.perf_counter()
    try:
        fn()
    except kind as exc:
        if text in str(exc):
            res.ok += 1
        else:
            res.fail("wrong", f"{label}: refused for another reason: {exc}")
    except CheckpointError as exc:
        res.fail("wrong", f"{label}: {type(exc).__name__} instead of {kind.__name__}: {exc}")
    except Exception as exc:
        res.fail("raw", f"{label}: {type(exc).__name__}: {exc}")
    else:
        res.fail("wrong", f"{label}: accepted")
    finally:
        res.worst_s = max(res.worst_s, time.perf_counter() - t0)


def rewrite_manifest(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit a checkpoint's manifest and re-sign it, as an attacker with write access can."""
    raw = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(raw, dict)
    edit(raw)
    data = codec.encode(raw)
    write_signed(path, data)


def write_signed(path: Path, data: bytes) -> None:
    (path / naming.MANIFEST).write_bytes(data)
    marker = codec.decode((path / naming.COMMIT_MARKER).read_bytes())
    assert isinstance(marker, dict)
    marker.update(manifest_size=len(data), manifest_crc32=crc32(data))
    (path / naming.COMMIT_MARKER).write_bytes(codec.encode(marker))


def refused_both(res: ClassResult, label: str, path: Path, text: str) -> None:
    """``fc.restore`` and ``fc.verify`` must both refuse ``path``."""
    refused(res, f"{label} (restore)", lambda: fc.restore(path), CheckpointError, text)
    t0 = time.perf_counter()
    try:
        report = fc.verify(path)
    except Exception as exc:
        res.fail("raw", f"{label} (verify): {type(exc).__name__}: {exc}")
        return
    finally:
        res.worst_s = max(res.worst_s, time.perf_counter() - t0)
    if report.ok:
        res.fail("wrong", f"{label} (verify): said OK")
    else:
        res.ok += 1


# --------------------------------------------------------------------------- classes


def _marked_array(code: int, items: list[bytes]) -> bytes:
    """A msgpack array opened by an empty container-marker ext (set, OrderedDict, ...)."""
    header = b"\xdd" + struct.pack(">I", len(items) + 1)
    return header + b"\xc7\x00" + bytes([code]) + b"".join(items)


def _floods(n: int) -> dict[str, bytes]:
    """Encoded containers of ``n`` keys with one hash value, built without hashing them.

    Building the flooded container in Python would itself take quadratic time, so
    the attack is written as bytes, as a hand-made file would be.
    """
    keys = [bytes(msgpack.packb(k * P, default=encoding._default)) for k in range(1, n + 1)]
    pairs = [b for k in keys for b in (k, b"\x00")]
    return {
        "int-keyed map": b"\xdf" + struct.pack(">I", n) + b"".join(pairs),
        "set": _marked_array(codes.EXT_SET, keys),
        "frozenset": _marked_array(codes.EXT_FROZENSET, keys),
        "OrderedDict": _marked_array(codes.EXT_ORDERED_DICT, pairs),
        "tuple-keyed map": b"\xdf"
        + struct.pack(">I", n)
        + b"".join(_marked_array(codes.EXT_TUPLE, [k]) + b"\x00" for k in keys),
    }


def decoder_complexity(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("decoder-complexity")
    sizes = [20_000] if quick else [20_000, 100_000, 1_000_000]
    for n in sizes:
        for kind, flood in _floods(n).items():
            path = base / f"flood-{kind}-{n}"
            with trial(res, f"{kind} x{n}", timed=False):
                fc.save(path, {"t": torch.ones(2), "v": 1})
                placeholder = b"the flood goes here"

                def put(raw: dict[str, Any], value: bytes = placeholder) -> None:
                    raw["entries"][-1]["value"] = value

                rewrite_manifest(path, put)
                data = (path / naming.MANIFEST).read_bytes()
                write_signed(path, data.replace(msgpack.packb(placeholder), flood))
                res.note(f"manifest of {len(data) + len(flood)} bytes")
                refused_both(res, f"{kind} x{n}", path, "hash flood")
        path = base / f"flood-node-{n}"
        with trial(res, f"int-keyed node x{n}", timed=False):
            fc.save(path, {"d": {i: torch.ones(1) for i in range(64)}})

            def node(raw: dict[str, Any], n: int = n) -> None:
                for e in raw["entries"]:  # the 64 tensors lie in a table, without "path"
                    if e.get("path", [None])[-1] == keys.NODE_KEY:
                        e["value"]["keys"] = [k * P for k in range(1, n + 1)]

            rewrite_manifest(path, node)
            restored = fc.restore(path)
            convert = functools.partial(fc.codec.to_python, restored)
            refused(res, f"node x{n}", convert, CheckpointError, "flood")
    return res


def _bombs(n: int) -> dict[str, bytes]:
    head = b"\xdd" + struct.pack(">I", n)
    nested = b"".join(b"\xdd" + struct.pack(">I", n) for _ in range(900))
    return {
        "empty maps": head + b"\x80" * n,
        "empty arrays": head + b"\x90" * n,
        "empty tuples": b"\xdd" + struct.pack(">I", n // 4) + b"\x91\xc7\x00\x01" * (n // 4),
        "2-char strings": b"\xdd" + struct.pack(">I", n // 3) + b"\xa2ab" * (n // 3),
        "nested declared arrays": nested + b"\x00" * (n - len(nested)),
    }


def decoder_memory(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("decoder-memory")
    for n in [1 << 20, 4 << 20] if quick else [1 << 20, 4 << 20, 16 << 20]:
        for kind, data in _bombs(n).items():
            tracemalloc.start()
            t0 = time.perf_counter()
            outcome = "accepted"
            try:
                codec.decode(data, source=kind)
            except CheckpointError as exc:
                outcome = type(exc).__name__
            except Exception as exc:
                res.fail("raw", f"{kind} {n}: {type(exc).__name__}: {exc}")
                outcome = "raw"
            finally:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            res.worst_s = max(res.worst_s, time.perf_counter() - t0)
            ratio = peak / len(data)
            res.worst_mem = max(res.worst_mem, ratio)
            if outcome == "raw":
                continue
            if peak > 32 * len(data) + PARSE_STACK_BYTES:
                res.fail("wrong", f"{kind} {n}: {outcome} after {ratio:.0f}x the input")
            else:
                res.ok += 1
    # the same through a real checkpoint: the manager decodes manifests on every prune
    path = base / "bomb"
    fc.save(path, {"t": torch.ones(1)})
    m = 4 << 20
    raw = codec.decode((path / naming.MANIFEST).read_bytes())
    assert isinstance(raw, dict)
    placeholder = b"bomb goes here"
    raw["metadata"]["bomb"] = placeholder
    body = codec.encode(raw)
    bomb = b"\xdd" + struct.pack(">I", m) + b"\x80" * m
    write_signed(path, body.replace(msgpack.packb(placeholder), bomb))
    refused_both(res, "empty maps in a real manifest", path, "memory bomb")
    return res


def _complex() -> torch.Tensor:
    return torch.complex(torch.randn(64), torch.randn(64))


def view_bit_aliasing(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("view-bit-aliasing")
    z = _complex()
    states: dict[str, dict[str, torch.Tensor]] = {
        "z + conj": {"z": z, "zc": z.conj()},
        "conj alone": {"zc": z.conj()},
        "conj.imag (neg bit)": {"z": z, "ni": z.conj().imag},
        "imag + conj.imag": {"i": z.imag, "ni": z.conj().imag},
        "two conj views": {"a": z.conj(), "b": z.conj(), "z": z},
        "neg view": {"x": z.real, "nx": torch._neg_view(z.real)},
        "conj of a slice": {"s": z[8:16], "sc": z[8:16].conj(), "z": z},
    }
    modes = ["sync", "copy", "none"]
    for label, state in states.items():
        for mode in modes:
            path = base / f"view-{len(list(base.iterdir()))}"
            with trial(res, f"{label} ({mode})"):
                if mode == "sync":
                    fc.save(path, state)
                else:
                    fc.save_async(path, state, staging=mode).result()  # type: ignore[arg-type]
                out = fc.restore(path)
                bad = [
                    k
                    for k, t in state.items()
                    if not torch.equal(out[k], t.resolve_conj().resolve_neg())
                ]
                if bad or not fc.verify(path).ok:
                    res.fail("wrong", f"{label} ({mode}): wrong values for {bad}")
                else:
                    res.ok += 1
    return res


def _deep(depth: int) -> dict[str, Any]:
    state: Any = torch.ones(1)
    for i in range(depth - 1):
        state = {f"k{i}": state}
    return {"top": state}


def limit_symmetry(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("limit-symmetry")
    free = LIMITS.decode_free_containers
    cases: dict[str, Callable[[], dict[str, Any]]] = {
        "key path 256": lambda: _deep(LIMITS.key_depth),
        "key path 257": lambda: _deep(LIMITS.key_depth + 1),
        "64 dims": lambda: {"t": torch.empty([1] * LIMITS.tensor_ndim)},
        "65 dims": lambda: {"t": torch.empty([1] * (LIMITS.tensor_ndim + 1))},
        "empty(0, 2**62 - 1)": lambda: {"t": torch.empty(0, 2**62 - 1, dtype=torch.uint8)},
        "empty(0, 2**62)": lambda: {"t": torch.empty(0, 2**62)},
        "empty(0, 2**60) float64": lambda: {"t": torch.empty(0, 2**60, dtype=torch.float64)},
        "value nested 500": lambda: {"v": _nested_list(LIMITS.encode_depth)},
        "value nested 501": lambda: {"v": _nested_list(LIMITS.encode_depth + 1)},
        "32 equal hashes": lambda: {"v": {k * P for k in range(1, LIMITS.equal_hashes + 1)}},
        "33 equal hashes": lambda: {"v": {k * P for k in range(1, LIMITS.equal_hashes + 2)}},
        "many empty lists": lambda: {"v": [[] for _ in range(free // 8)]},
        "too many empty lists": lambda: {"v": [[] for _ in range(2 * free)]},
        "int-keyed node, 33 equal hashes": lambda: {
            "d": {k * P: torch.ones(1) for k in range(1, LIMITS.equal_hashes + 2)}
        },
    }
    if not quick:
        cases["values of 300 MiB"] = lambda: {"v": b"x" * (300 << 20)}
    for label, make in cases.items():
        parent = base / f"limit-{len(list(base.iterdir()))}"
        path = parent / "s"
        with trial(res, label):
            state = make()
            try:
                fc.save(path, state)
            except UnsupportedValue as exc:
                if "state[" not in str(exc) or (parent.exists() and any(parent.iterdir())):
                    res.fail("wrong", f"{label}: refused without a key, or left files: {exc}")
                else:
                    res.ok += 1
                continue
            try:
                fc.restore(path)
            except CheckpointError as exc:
                res.fail("wrong", f"{label}: saved but cannot be loaded: {exc}")
            else:
                res.ok += 1
    return res


def _nested_list(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


def chunk_coverage(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("chunk-coverage")
    counts = [2, 64, 65, 1000] if quick else [2, 64, 65, 1000, 20_000, 65_536]
    for n in counts:
        path = base / f"overlap-{n}"
        with trial(res, f"{n} overlapping chunks", timed=False):
            fc.save(path, {"w": torch.arange(2.0 * n)})
            rewrite_manifest(path, functools.partial(_overlap, path=path, n=n))
            refused_both(res, f"{n} overlapping chunks", path, "overlap")
    path = base / "hole"
    with trial(res, "overlap hiding a hole", timed=False):
        fc.save(path, {"w": torch.arange(9.0).reshape(3, 3)})
        boxes = [([0, 0], [2, 2]), ([1, 1], [2, 2]), ([0, 2], [1, 1])]
        rewrite_manifest(path, lambda raw: _boxes(raw, boxes))
        refused_both(res, "overlap hiding a hole", path, "overlap")
    return res


def _the_chunk(raw: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    (entry,) = (e for e in raw["entries"] if e["path"] == ["w"])
    (chunk,) = entry["chunks"]
    return entry, chunk


def _overlap(raw: dict[str, Any], path: Path, n: int) -> None:
    entry, chunk = _the_chunk(raw)
    blob = (path / chunk["file"]).read_bytes()[chunk["offset"] : chunk["offset"] + chunk["length"]]
    at = chunk["data_offset"] - chunk["offset"]
    crc = crc32(blob[at : at + 8])
    hcrc = crc32(blob[at + 8 :], crc32(blob[:at]))
    box = {"offsets": [0], "sizes": [2], "nbytes": 8, "crc32": crc, "hcrc32": hcrc}
    entry["chunks"] = [dict(chunk, **box) for _ in range(n)]


def _boxes(raw: dict[str, Any], boxes: list[tuple[list[int], list[int]]]) -> None:
    entry, chunk = _the_chunk(raw)
    entry["chunks"] = [
        dict(chunk, offsets=o, sizes=s, nbytes=4 * s[0] * s[1], data_offset=chunk["data_offset"])
        for o, s in boxes
    ]


def unstaged_bypass(base: Path, quick: bool) -> ClassResult:
    res = ClassResult("unstaged-bypass")
    for i in range(6 if quick else 40):
        how = ("data", "numpy")[i % 2]
        p = torch.nn.Parameter(torch.zeros(4 << 20))
        bypass(res, base / f"unstaged-{i}", p, functools.partial(_add_one, p, how), f"{how} #{i}")
    return res


def _add_one(p: torch.nn.Parameter, how: str) -> None:
    """One to every element, past the version counter."""
    if how == "data":
        p.data.add_(1)
    else:
        p.detach().numpy()[:] += 1


def bypass(
    res: ClassResult, path: Path, p: torch.nn.Parameter, add: Callable[[], None], label: str
) -> None:
    """A ``staging="none"`` save of ``p`` while a thread calls ``add`` over and over.

    An add is no single instant: a thread descheduled in the middle of one (a busy
    machine does that) leaves ``p`` half added for as long as it waits, and a save
    that runs meanwhile rightly commits those bytes. So a committed ``p`` must be a
    state its memory held during the save (:func:`held`), not a tensor of one value.
    """
    adds = [0, 0]  # started, finished
    stop = threading.Event()

    def writer() -> None:
        while not stop.is_set():
            adds[0] += 1
            add()
            adds[1] += 1

    thread = threading.Thread(target=writer)
    with trial(res, label):
        thread.start()  # writing before, during and after the save
        try:
            floor = adds[1]
            error = fc.save_async(path, {"p": p}, staging="none").exception()
            ceiling = adds[0]
        finally:
            stop.set()
            thread.join()
        if isinstance(error, ModifiedDuringSave):
            if path.exists():
                res.fail("wrong", f"{label}: refused but committed")
            else:
                res.ok += 1
                res.note("refused before the commit")
            return
        if error is not None:
            raise error
        # committed: it must never be read back torn
        try:
            out = fc.restore(path)["p"]
        except CheckpointError:
            res.ok += 1
            res.note("committed, refused at load (documented)")
            return
        if not held(out, floor, ceiling):
            seen = torch.unique(out)[:4].tolist()
            detail = f"values {seen} while adds {floor} to {ceiling} ran"
            res.fail("wrong", f"{label}: a torn tensor restored without an error ({detail})")
        else:
            res.ok += 1
            whole = out.min() == out.max()
            res.note("committed whole" if whole else "committed in the middle of one add")


def held(out: torch.Tensor, floor: int, ceiling: int) -> bool:
    """Whether ``out`` is a state of a tensor of zeros, one added to it at a time, after
    ``floor`` adds had finished and before add ``ceiling + 1`` began: ``k`` everywhere,
    or ``k`` and ``k + 1`` while add ``k + 1`` was under way."""
    values = torch.unique(out).tolist()  # sorted
    k = values[0]
    return (
        values in ([k], [k, k + 1])
        and float(k).is_integer()
        and floor <= k
        and values[-1] <= ceiling
    )


CLASSES: dict[str, Callable[[Path, bool], ClassResult]] = {
    "decoder-complexity": decoder_complexity,
    "decoder-memory": decoder_memory,
    "view-bit-aliasing": view_bit_aliasing,
    "limit-symmetry": limit_symmetry,
    "chunk-coverage": chunk_coverage,
    "unstaged-bypass": unstaged_bypass,
}


def run(quick: bool = True, classes: list[str] | None = None) -> dict[str, Any]:
    """Run the attack classes; returns plain data (one dict per class)."""
    results = []
    for name in classes or list(CLASSES):
        with tempfile.TemporaryDirectory(prefix=f"fc-{name}-") as tmp:
            t0 = time.perf_counter()
            res = CLASSES[name](Path(tmp), quick)
            res.trials = res.ok + res.wrong + res.raw
            out = dataclasses.asdict(res)
            out["seconds"] = round(time.perf_counter() - t0, 2)
            results.append(out)
    return {"form": "quick" if quick else "long", "results": results}


def table(report: dict[str, Any]) -> str:
    head = f"{'class':<20} {'trials':>6} {'ok':>5} {'wrong':>5} {'raw':>4} {'worst s':>8} "
    lines = [head + f"{'worst mem':>9}"]
    for r in report["results"]:
        mem = f"{r['worst_mem']:.1f}x" if r["worst_mem"] else "-"
        lines.append(
            f"{r['name']:<20} {r['trials']:>6} {r['ok']:>5} {r['wrong']:>5} {r['raw']:>4} "
            f"{r['worst_s']:>8.2f} {mem:>9}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the short form")
    ap.add_argument("--classes", nargs="*", choices=sorted(CLASSES), default=None)
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print each problem")
    args = ap.parse_args(argv)
    report = run(args.quick, args.classes)
    print(table(report))
    if args.verbose:
        for r in report["results"]:
            for what, n in r["notes"].items():
                print(f"  {r['name']}: {n} {what}", file=sys.stderr)
            for p in r["problems"]:
                print(f"  {r['name']}: {p}", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = sum(r["wrong"] + r["raw"] for r in report["results"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
