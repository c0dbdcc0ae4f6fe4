"""How a state looks to stock DCP: its non-tensor values as DCP byte entries.

Stock ``dcp.load`` finds a non-tensor value as ``torch.save`` bytes in a shard file,
named in ``.metadata`` under DCP's flattened key. Every small plain value is written
that way too, with its checksum in the manifest (``dcp_bytes``), so ``.metadata``
stays a function of the manifest and ``fc.verify`` covers those bytes; this package
never reads them. :func:`optimizer_record` lets optimizer keys follow ``get_state_dict``.
"""

from __future__ import annotations

import io
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath
from functional_ckpt._src.format.naming import DCP_METADATA
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint

#: A DCP object path: dict keys are strings, list indices ints (``planner_data``).
DcpPath = tuple[str | int, ...]

#: Record field of an optimizer subtree: the name of each parameter, by position.
PARAM_NAMES = "param_fqns"
#: Largest ``torch.save`` blob of one value written for stock readers.
MAX_VALUE_BYTES = 64 << 10
#: At most this many byte entries per checkpoint (the rest stays manifest-only):
#: room for an optimizer with a thousand parameter groups (about 12 values each),
#: at about 1.3 KB of disk per entry.
MAX_ENTRIES = 16384
_PLAIN = (type(None), bool, int, float, str)


@dataclass(frozen=True, slots=True)
class ByteEntry:
    """One value as stock DCP stores it: where its ``torch.save`` bytes lie and their CRC32."""

    fqn: str
    path: DcpPath
    data: bytes = b""  # only while writing
    file: str = ""
    offset: int = 0
    length: int = 0
    crc32: int = 0

    def located(self, file: str, offset: int) -> ByteEntry:
        """This entry as written at ``offset`` of ``file``, its data dropped."""
        return ByteEntry(self.fqn, self.path, b"", file, offset, len(self.data), crc32(self.data))

    def to_plain(self) -> dict[str, Any]:
        return {
            "fqn": self.fqn,
            "path": list(self.path),
            "file": self.file,
            "offset": self.offset,
            "length": self.length,
            "crc32": self.crc32,
        }


def param_names(model: Any, optimizer: Any) -> list[str] | None:
    """Each optimizer parameter's name in ``model`` by position; None if one is not the model's."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    out = [names.get(id(p)) for g in optimizer.param_groups for p in g["params"]]
    return None if any(n is None for n in out) else [str(n) for n in out]


def optimizer_record(keys: Sequence[str], names: Sequence[str]) -> dict[str, Any]:
    """The container record of an optimizer subtree that carries its parameter names."""
    return {"kind": "dict", "keys": list(keys), PARAM_NAMES: list(names)}


def optimizer_names(path: KeyPath, value: Any) -> tuple[KeyPath, list[str]] | None:
    """The optimizer subtree and names a container record at ``path`` declares, if any."""
    if path[-1] != NODE_KEY or not isinstance(value, dict):
        return None
    names = value.get(PARAM_NAMES)
    if isinstance(names, list) and all(type(n) is str for n in names):
        return path[:-1], names
    return None


def dcp_path(path: KeyPath, optimizers: Mapping[KeyPath, list[str]]) -> KeyPath | None:
    """``path`` with an optimizer's parameter position replaced by its name, if it has one."""
    for root, names in optimizers.items():
        n = len(root)
        if len(path) > n + 1 and path[:n] == root and path[n] == "state":
            pos = path[n + 1]
            if pos.isdigit() and int(pos) < len(names) and str(int(pos)) == pos:
                return (*root, "state", names[int(pos)], *path[n + 2 :])
    return None


#: Values nested deeper than this are left to the manifest.
_MAX_DEPTH = 64


class _TooDeep(Exception):
    pass


def _terminal(value: Any, depth: int = 0) -> bool:
    """What DCP's flattening visits whole (``_traverse.traverse_state_dict``)."""
    if depth > _MAX_DEPTH:
        raise _TooDeep
    if isinstance(value, Mapping):
        return False
    if isinstance(value, list):
        return all(
            not (isinstance(v, Mapping | list) and not _terminal(v, depth + 1)) for v in value
        )
    return True


def flatten(prefix: DcpPath, value: Any, depth: int = 0) -> Iterator[tuple[DcpPath, Any]]:
    """The (object path, value) pairs DCP's flattening makes of ``value`` at ``prefix``."""
    if depth > _MAX_DEPTH:
        raise _TooDeep
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from flatten((*prefix, str(k)), v, depth + 1)
    elif _terminal(value):
        yield prefix, value
    else:
        for i, v in enumerate(value):
            yield from flatten((*prefix, i), v, depth + 1)


def _plain(value: Any, budget: list[int], depth: int = 0) -> bool:
    """A small value every stock reader rebuilds as it was; ``budget`` counts elements down."""
    budget[0] -= 1
    if budget[0] < 0 or depth > _MAX_DEPTH:
        return False
    if type(value) in _PLAIN:
        return type(value) is not int or abs(value) < _LARGE_INT
    if type(value) in (list, tuple):
        return all(_plain(v, budget, depth + 1) for v in value)
    if type(value) in (dict, OrderedDict):
        return all(_plain(k, budget) and _plain(v, budget, depth + 1) for k, v in value.items())
    if type(value) in (bytes, bytearray):
        return len(value) <= MAX_VALUE_BYTES
    if type(value) is set:
        return all(_plain(v, budget, depth + 1) for v in value)
    return f"{type(value).__module__}.{type(value).__qualname__}" == "torch.device"


#: Elements of one value at most (its ``torch.save`` bytes must stay small anyway).
_MAX_ELEMENTS = 4096
#: Larger ints are left to the manifest (``repr`` would refuse the largest).
_LARGE_INT = 1 << 4096


@lru_cache(maxsize=4096)
def _saved(encoded: bytes) -> bytes:
    """``torch.save`` bytes of a plain value by its exact encoding (equal values share them)."""
    import torch  # writing: a reader of byte entries never runs torch.save

    buf = io.BytesIO()
    torch.save(codec.decode(encoded), buf)
    return buf.getvalue()


def _is_params(rel: DcpPath) -> bool:
    """``param_groups.<i>.params`` of an optimizer (positions, or names for DCP)."""
    return len(rel) == 3 and rel[0] == "param_groups" and rel[2] == "params"


def plan_bytes(
    values: Sequence[tuple[KeyPath, Any]],
    taken: set[str],
    optimizers: Mapping[KeyPath, list[str]],
) -> list[ByteEntry]:
    """The byte entries of a state's shared values (``taken``: the DCP keys of tensors);
    containers, non-plain or large values and values whose DCP keys collide (``a.b`` and
    ``a`` -> ``b``) are left to the manifest alone."""
    out: list[ByteEntry] = []
    seen = set(taken)
    clashes: set[str] = set()
    for entries in _entries(values, optimizers):
        for fqn, sub, v in entries:
            if fqn in seen:
                clashes.add(fqn)
            elif len(out) < MAX_ENTRIES and (data := _small(v)) is not None:
                seen.add(fqn)
                out.append(ByteEntry(fqn, sub, data))
        if len(out) >= MAX_ENTRIES:
            break
    return [e for e in out if e.fqn not in clashes]


def _entries(
    values: Sequence[tuple[KeyPath, Any]], optimizers: Mapping[KeyPath, list[str]]
) -> Iterator[list[tuple[str, DcpPath, Any]]]:
    """Per value, the (DCP key, object path, value) entries DCP's flattening makes of it."""
    for path, value in values:
        if path[-1] == NODE_KEY:
            continue
        base: DcpPath = dcp_path(path, optimizers) or path
        root = next((r for r in optimizers if path[: len(r)] == r), None)
        try:
            pairs = list(flatten(base, value))
        except _TooDeep:
            continue
        out = []
        for sub, v in pairs:
            if root is not None and _is_params(sub[len(root) :]):
                names = optimizers[root]
                if not (isinstance(v, list) and all(type(i) is int for i in v)):
                    continue
                if not all(0 <= i < len(names) for i in v):
                    continue
                v = [names[i] for i in v]  # as get_state_dict names them
            out.append((".".join(map(str, sub)), sub, v))
        yield out


def _small(value: Any) -> bytes | None:
    """``torch.save`` bytes of ``value`` if it is small plain data (else None)."""
    if not _plain(value, [_MAX_ELEMENTS]):
        return None
    data = _saved(codec.encode(value))
    return data if len(data) <= MAX_VALUE_BYTES else None


def from_manifest(
    values: Sequence[tuple[KeyPath, Any]], taken: set[str]
) -> Callable[[str], bytes | None]:
    """The ``torch.save`` bytes of a checkpoint's value by DCP key (None: none), made from
    the manifest's values when first asked for: stock DCP's planner unpickles them, so
    they never come from the checkpoint's files."""
    optimizers = dict(filter(None, (optimizer_names(p, v) for p, v in values)))
    by_key: dict[str, list[Any]] | None = None

    def value_bytes(fqn: str) -> bytes | None:
        nonlocal by_key
        if by_key is None:
            by_key = {}
            for entries in _entries(values, optimizers):
                for key, _, v in entries:
                    by_key.setdefault(key, []).append(v)
        made = (_small(v) for v in ([] if fqn in taken else by_key.get(fqn, [])))
        return next((data for data in made if data is not None), None)

    return value_bytes


def parse_byte_entries(
    manifest: Mapping[str, Any], file_sizes: Mapping[str, int], root: Path
) -> list[ByteEntry]:
    """The manifest's byte entries, each field checked (an older manifest has none)."""
    src = str(root / "manifest.msgpack")
    raw = manifest.get("dcp_bytes", [])
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise CorruptCheckpoint(f"{src}: invalid DCP byte entry table")
    out: list[ByteEntry] = []
    for i, e in enumerate(raw):
        where = f"{src} DCP byte entry {i}"
        if not isinstance(e, dict):
            raise CorruptCheckpoint(f"{where}: not a mapping")
        fqn, path, file = e.get("fqn"), e.get("path"), e.get("file")
        if (
            not isinstance(fqn, str)
            or not isinstance(path, list)
            or not 0 < len(path) <= LIMITS.key_depth * 2
            or not all(type(k) is str or (type(k) is int and k >= 0) for k in path)
            or ".".join(map(str, path)) != fqn
        ):
            raise CorruptCheckpoint(f"{where}: invalid key {fqn!r} or path {path!r}")
        if not isinstance(file, str) or file not in file_sizes or file == DCP_METADATA:
            raise CorruptCheckpoint(f"{where}: stored in an unknown file {file!r}")
        nums: list[int] = []
        for k in ("offset", "length", "crc32"):
            n = e.get(k)
            if type(n) is not int or n < 0:
                raise CorruptCheckpoint(f"{where}: invalid {k} {n!r}")
            nums.append(n)
        offset, length, crc = nums
        if offset + length > file_sizes[file]:
            raise CorruptCheckpoint(f"{where}: bytes beyond the end of {file}")
        out.append(ByteEntry(fqn, tuple(path), b"", file, offset, length, crc))
    return out
