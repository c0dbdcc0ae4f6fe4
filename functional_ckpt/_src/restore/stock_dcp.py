"""Reading checkpoints written by stock ``torch.distributed.checkpoint``: tensor locations
from ``.metadata`` (the restricted unpickler), each tensor by ``torch.load``, pickled
values only as plain data (every global refused)."""

from __future__ import annotations

import io
import os
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from functional_ckpt._src.format import dcp_values as dcpbytes
from functional_ckpt._src.format import naming, unpickler
from functional_ckpt._src.format.dcp_values import DcpPath
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.manifest import TensorEntry, dtype_name
from functional_ckpt._src.restore.read import Request, region, require_grad, spec_problem
from functional_ckpt._src.restore.template import Template
from functional_ckpt._src.state.tree import Leaf, from_python, iter_leaves
from functional_ckpt._src.storage import opener
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    TemplateMismatch,
    UnsafeCheckpoint,
)


class StockFiles:
    """A stock DCP checkpoint directory held open, its ``.metadata`` read."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir_fd = opener.open_directory(root)
        self.fds: dict[str, tuple[int, int]] = {}  # name -> (fd, size)
        try:
            self.md = self._metadata()
        except BaseException:
            self.close()
            raise
        self.storage: dict[Any, Any] = self.md.storage_data or {}  # where each entry lies

    def open(self, name: str) -> tuple[int, int]:
        got = self.fds.get(name)
        if got is None:
            where = naming.safe_member(self.root, name)
            try:
                fd = opener.open_member(self.dir_fd, name, where, what="DCP file")
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{where}: file is missing") from None
            got = self.fds[name] = (fd, os.fstat(fd).st_size)
        return got

    def _metadata(self) -> Any:
        """DCP's ``.metadata``, parsed by the hardened unpickler."""
        where = self.root / naming.DCP_METADATA
        fd, size = self.open(naming.DCP_METADATA)
        if size > unpickler.MAX_BYTES:
            raise CorruptCheckpoint(f"{where}: {size} bytes of DCP metadata is more than allowed")
        return unpickler.load_foreign(opener.read_exact(fd, size, where), where)

    def blob(self, fqn: str, where: str, at: Any = None) -> bytes:
        """The stored bytes of entry ``fqn`` (of its chunk at offsets ``at``)."""
        from torch.distributed.checkpoint.metadata import MetadataIndex

        info = self.storage.get(MetadataIndex(fqn, at))
        if info is None:
            raise CorruptCheckpoint(f"{self.root}: no storage recorded for {where}")
        name = info.relative_path
        if info.transform_descriptors:  # e.g. a FileSystemWriter(_extensions=[ZStandard()])
            raise CheckpointError(
                f"{self.root / name}: stored with DCP's transforms {info.transform_descriptors}, "
                "which fc.restore reads in checkpoints of this format only; read this one "
                "with dcp.load"
            )
        fd, size = self.open(name)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise UnsafeCheckpoint(
                f"{self.root / name}: DCP metadata points beyond the end of the file"
            )
        return os.pread(fd, info.length, info.offset)

    def saved(self, item: StockItem) -> torch.Tensor:
        """A matched leaf's saved tensor, as a new CPU tensor."""
        t = torch.empty(item.smd.size, dtype=item.smd.properties.dtype)
        _tensor(self, str(item.fqn), item.smd, t, _where(item.leaf.path))
        return t

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()
        os.close(self.dir_fd)


#: What :func:`load_plain` returns for a byte entry that is not plain data.
_NOT_PLAIN: Any = object()
#: Largest pickle of a byte entry that :func:`load_plain` reads.
MAX_PLAIN_BYTES = 16 << 20


class _PlainUnpickler(unpickler.RestrictedUnpickler):
    """Builds plain data only: no class or function can be named, so none is built."""

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpoint(f"refusing to load {module}.{name}")


def load_plain(blob: bytes) -> Any:
    """A byte entry's value when it is plain data, else ``_NOT_PLAIN`` (every global refused),
    at most four elements per pickle byte: a few hundred bytes could stand for 2**31 of them."""
    try:
        with zipfile.ZipFile(io.BytesIO(blob)) as z:
            infos = z.infolist()
            pkl = [i for i in infos if i.filename.endswith("/data.pkl")]
            if (
                len(pkl) != 1
                or any("/data/" in i.filename for i in infos)  # tensor storages
                or pkl[0].compress_type != zipfile.ZIP_STORED
                or pkl[0].file_size > MAX_PLAIN_BYTES
            ):
                return _NOT_PLAIN
            data = z.read(pkl[0])
        value = _PlainUnpickler(data).load()
    except Exception:  # not a zip, a global named, too deep: not plain data
        return _NOT_PLAIN
    if not unpickler.is_plain(value) or not _tree_within(value, 4 * len(data) + 64):
        return _NOT_PLAIN
    return value


def _tree_within(value: Any, budget: int) -> bool:
    """Whether ``value``, walked as a tree, has at most ``budget`` elements (a cycle has not)."""
    todo = [value]
    while todo:
        budget -= 1
        if budget < 0:
            return False
        v = todo.pop()
        if type(v) in (list, tuple):
            todo += v
        elif isinstance(v, dict):
            todo += v.keys()
            todo += v.values()
    return True


@dataclass
class StockItem:
    """A template leaf and what fills it: its DCP entry (``fqn``), ``parts`` below, or neither."""

    leaf: Leaf
    fqn: str | None = None
    smd: Any = None
    parts: list[tuple[DcpPath, str, Any]] | None = None  # (path below the leaf, fqn, metadata)


@dataclass
class StockMatch:
    """The template's leaves matched to a stock checkpoint's entries, plain byte entries loaded."""

    items: list[StockItem]
    root: dict[str, Any] | None
    values: dict[str, Any] = field(default_factory=dict)


def match_dcp(files: StockFiles, template: Template | None, req: Request) -> StockMatch:
    """Match the template to the stock ``.metadata``; one error lists every mismatch."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    root = files.root
    if template is None:
        raise CheckpointError(
            f"{root}: a stock DCP checkpoint has no manifest; pass a template to restore it"
        )
    md = files.md
    saved: dict[str, Any] = md.state_dict_metadata
    planner: dict[str, Any] = md.planner_data if isinstance(md.planner_data, dict) else {}
    match = StockMatch([], template.root)
    problems: list[str] = []
    pickled: list[str] = []
    used: set[str] = set()

    def value_of(fqn: str, where: str) -> None:
        value = load_plain(files.blob(fqn, where))
        if value is _NOT_PLAIN:
            pickled.append(where)
        else:
            match.values[fqn] = value

    leaves = template.leaves
    parents = {leaf.path[:-1] for leaf in leaves}
    for leaf in leaves:
        where = _where(leaf.path)
        fqn = ".".join(leaf.path)
        smd = saved.get(fqn)
        if leaf.kind == "node" or leaf.path[-1] == NODE_KEY or smd is None:
            empty = leaf.kind == "node" and leaf.path not in parents
            parts = _parts(saved, planner, leaf.path) if empty or leaf.kind == "value" else []
            if parts or leaf.kind == "node" or leaf.path[-1] == NODE_KEY:
                # structure comes from the template; an empty subtree or a value
                # stored element by element comes from the entries under it
                match.items.append(StockItem(leaf, parts=parts or None))
                for _, key, part in parts:
                    used.add(key)
                    if isinstance(part, BytesStorageMetadata):
                        value_of(key, _where((*leaf.path, key[len(fqn) + 1 :])))
                if leaf.kind == "value" and not all(
                    isinstance(part, BytesStorageMetadata) for _, _, part in parts
                ):
                    problems.append(f"  {where}: saved with tensors, template has a value")
            else:
                problems.append(f"  {where}: missing from the checkpoint")
            continue
        used.add(fqn)
        if leaf.kind == "value":
            if not isinstance(smd, BytesStorageMetadata):
                problems.append(f"  {where}: saved as a tensor, template has a value")
                continue
            value_of(fqn, where)
            match.items.append(StockItem(leaf, fqn, smd))
            continue
        if not isinstance(smd, TensorStorageMetadata):
            problems.append(f"  {where}: saved as a pickled value, template has a tensor")
            continue
        spec = TensorEntry(leaf.path, fqn, dtype_name(smd.properties.dtype), smd.size, False)
        problem = spec_problem(spec, leaf.value, req.cast)
        if problem is None:
            match.items.append(StockItem(leaf, fqn, smd))
        else:
            problems.append(problem)
    if not req.partial:
        extra = sorted(set(saved) - used)
        problems += [f"  DCP key {k!r}: in the checkpoint but not in the template" for k in extra]
    if problems:
        raise TemplateMismatch(
            f"{root}: the DCP checkpoint does not fit the template:\n" + "\n".join(problems)
        )
    if pickled:
        raise UnsafeCheckpoint(
            f"{root}: these values are pickles that are not plain data, and fc.restore "
            "never unpickles anything else (it could run code); leave them out of the "
            "template (partial=True), or load the checkpoint once with stock dcp.load in a "
            "process you trust and save it again with fc.save:\n  " + "\n  ".join(pickled)
        )
    return match


def _parts(saved: dict[str, Any], planner: dict[str, Any], path: KeyPath) -> list[Any]:
    """The entries stored under ``path``, each with its object path below it."""
    prefix = ".".join(path) + "."
    out: list[tuple[DcpPath, str, Any]] = []
    for key, smd in saved.items():
        if not key.startswith(prefix):
            continue
        obj = planner.get(key)
        if isinstance(obj, tuple | list) and len(obj) > len(path):
            if tuple(str(k) for k in obj[: len(path)]) != path:
                continue
            rel: DcpPath = tuple(obj[len(path) :])
        else:
            rel = (key[len(prefix) :],)
        out.append((rel, key, smd))
    return out


def _where(path: KeyPath) -> str:
    return f"{format_path(path)} (DCP key {'.'.join(path)!r})"


def _tensor(files: StockFiles, fqn: str, smd: Any, dest: torch.Tensor, where: str) -> None:
    """Read every chunk of a stored tensor into its place in ``dest``."""
    root = files.root
    with torch.no_grad():
        for chunk in smd.chunks:
            blob = files.blob(fqn, where, chunk.offsets)
            try:
                piece = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
            except Exception as e:
                raise CorruptCheckpoint(f"{root} {where}: unreadable tensor blob ({e})") from None
            if not isinstance(piece, torch.Tensor):
                raise CorruptCheckpoint(f"{root} {where}: blob does not hold a tensor")
            if tuple(piece.shape) != tuple(chunk.sizes):
                raise CorruptCheckpoint(f"{root} {where}: chunk shape differs from metadata")
            region(dest, chunk.offsets, chunk.sizes).copy_(piece)


def _set(container: Any, rel: DcpPath, value: Any) -> Any:
    """``value`` placed at ``rel`` in ``container`` (made as needed: int keys make lists)."""
    if not rel:
        return value
    key, rest = rel[0], rel[1:]
    if type(key) is int:
        seq = container if isinstance(container, list) else []
        seq.extend([None] * (key + 1 - len(seq)))
        seq[key] = _set(seq[key], rest, value)
        return seq
    mapping = container if isinstance(container, dict) else {}
    mapping[key] = _set(mapping.get(key), rest, value)
    return mapping


def read_dcp(
    files: StockFiles, match: StockMatch, *, inplace: bool, device: torch.device
) -> list[Leaf]:
    """Read every matched leaf into the template leaves' dtype and device (``inplace``: them)."""
    values: dict[KeyPath, Any] = {}
    for item in match.items:
        leaf = item.leaf
        if item.parts is not None:
            got: Any = None
            for rel, fqn, smd in item.parts:
                if hasattr(smd, "chunks"):
                    part: Any = torch.empty(smd.size, dtype=smd.properties.dtype, device=device)
                    _tensor(files, fqn, smd, part, _where(leaf.path))
                else:
                    part = match.values[fqn]
                got = _set(got, rel, part)
            values[leaf.path] = got
        elif item.fqn is not None and leaf.kind == "value":
            values[leaf.path] = match.values[item.fqn]
    records = {i.leaf.path[:-1]: i.leaf.value for i in match.items if i.leaf.path[-1] == NODE_KEY}
    for path in [p for p in values if p[-1] == "state"]:
        _positional_keys(path[:-1], values, records.get(path[:-1]))
    out: list[Leaf] = []
    for item in match.items:
        leaf = item.leaf
        if leaf.path in values and leaf.kind == "value":
            out.append(Leaf(leaf.path, "value", values[leaf.path]))
        elif leaf.path in values:  # an empty template subtree, filled from the checkpoint
            out.append(leaf)
            filled = values[leaf.path]
            if isinstance(filled, dict | list):
                out += iter_leaves(from_python(filled, leaf.path), leaf.path)
        elif item.fqn is None:
            out.append(leaf)  # structure comes from the template
        else:
            t: torch.Tensor = leaf.value
            if inplace and not t.is_meta:
                dest = t
            else:
                dev = device if t.is_meta else t.device
                dest = torch.empty(t.shape, dtype=t.dtype, device=dev)
            _tensor(files, item.fqn, item.smd, dest, _where(leaf.path))
            require_grad(dest, t, dest is t, False)
            out.append(Leaf(leaf.path, "tensor", dest))
    return out


def _positional_keys(opt: KeyPath, values: dict[KeyPath, Any], record: Any) -> None:
    """An optimizer's ``state`` keyed by parameter position again, as ``load_state_dict`` needs."""
    state, groups = values.get((*opt, "state")), values.get((*opt, "param_groups"))
    if not (isinstance(state, dict) and isinstance(groups, list)):
        return
    if not all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        return
    params = [p for g in groups for p in g["params"]]
    if params and all(type(p) is int for p in params):
        if all(type(k) is str and k.isdigit() and str(int(k)) == k for k in state):
            values[(*opt, "state")] = {int(k): v for k, v in state.items()}
        return
    names = record.get(dcpbytes.PARAM_NAMES) if isinstance(record, dict) else None
    if not isinstance(names, list):
        return
    pos = {n: i for i, n in enumerate(names) if type(n) is str}
    if not (all(p in pos for p in params) and all(k in pos for k in state)):
        return
    values[(*opt, "state")] = {pos[k]: state[k] for k in sorted(state, key=pos.__getitem__)}
    values[(*opt, "param_groups")] = [
        {**g, "params": [pos[p] for p in g["params"]]} for g in groups
    ]
