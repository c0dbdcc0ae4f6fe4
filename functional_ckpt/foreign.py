"""Reading checkpoints written by stock ``torch.distributed.checkpoint``.

Such a checkpoint has no manifest: the tree comes from the caller's template, the
tensor locations from DCP's ``.metadata`` (read by the restricted unpickler), and
each tensor from its ``torch.save`` blob through ``torch.load(weights_only=True)``.
Non-tensor values there are arbitrary pickles; they are refused unless the caller
passes ``allow_pickle=True`` for a checkpoint it trusts.
"""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt import dcpmeta, format
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    TemplateMismatch,
    UnsafeCheckpoint,
)
from functional_ckpt.manifest import dtype_name
from functional_ckpt.summary import CheckpointSummary, Node, TensorSpec, insert
from functional_ckpt.tree import (
    NODE_KEY,
    KeyPath,
    Leaf,
    as_state,
    format_path,
    iter_leaves,
    node_record,
)


class StockFiles:
    """A stock DCP checkpoint directory held open; its files opened safely, once each."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir_fd = format.open_directory(root)
        self.fds: dict[str, tuple[int, int]] = {}  # name -> (fd, size)

    def open(self, name: str) -> tuple[int, int]:
        got = self.fds.get(name)
        if got is None:
            where = format.safe_member(self.root, name)
            try:
                fd = format.open_member(self.dir_fd, name, where, what="DCP file")
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{where}: file is missing") from None
            got = self.fds[name] = (fd, os.fstat(fd).st_size)
        return got

    def metadata(self) -> Any:
        """DCP's ``.metadata``, parsed by the hardened unpickler."""
        where = self.root / format.DCP_METADATA
        fd, size = self.open(format.DCP_METADATA)
        if size > dcpmeta.MAX_BYTES:
            raise CorruptCheckpoint(f"{where}: {size} bytes of DCP metadata is more than allowed")
        return dcpmeta.load_foreign(format.read_exact(fd, size, where), where)

    def blob(self, info: Any) -> bytes:
        name = info.relative_path
        fd, size = self.open(name)
        if info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            raise UnsafeCheckpoint(
                f"{self.root / name}: DCP metadata points beyond the end of the file"
            )
        return os.pread(fd, info.length, info.offset)

    def close(self) -> None:
        for fd, _ in self.fds.values():
            os.close(fd)
        self.fds.clear()
        os.close(self.dir_fd)

    def __enter__(self) -> StockFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_stock_metadata(root: Path) -> Any:
    """The parsed ``.metadata`` of a stock DCP checkpoint (nothing in it runs)."""
    with StockFiles(root) as files:
        return files.metadata()


def _load_tensor(blob: bytes, where: str) -> torch.Tensor:
    try:
        t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpoint(f"{where}: unreadable tensor blob ({e})") from None
    if not isinstance(t, torch.Tensor):
        raise CorruptCheckpoint(f"{where}: blob does not hold a tensor")
    return t


@dataclass
class StockMatch:
    """The template's leaves matched to a stock checkpoint's entries, before any read.

    ``items`` keeps the template's order: a leaf with its DCP key and storage
    metadata is read; one without (structure, container records) is kept as is.
    """

    items: list[tuple[Leaf, str | None, Any]]
    storage: dict[Any, Any]
    root: dict[str, Any] | None


def match_dcp(
    files: StockFiles,
    md: Any,
    template: TensorDictBase | Mapping[str, Any] | None,
    *,
    partial: bool,
    cast: bool,
    allow_pickle: bool,
) -> StockMatch:
    """Match the template to the stock ``.metadata`` ``md``; one error lists every mismatch."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata

    root = files.root
    if template is None:
        raise CheckpointError(
            f"{root}: a stock DCP checkpoint has no manifest; pass a template to restore it"
        )
    saved: dict[str, Any] = md.state_dict_metadata
    storage: dict[Any, Any] = md.storage_data if isinstance(md.storage_data, dict) else {}
    problems: list[str] = []
    pickled: list[str] = []
    used: set[str] = set()
    items: list[tuple[Leaf, str | None, Any]] = []
    for leaf in iter_leaves(as_state(template)):
        if leaf.kind == "node" or leaf.path[-1] == NODE_KEY:
            items.append((leaf, None, None))  # structure comes from the template
            continue
        fqn = ".".join(leaf.path)
        smd = saved.get(fqn)
        where = _where(leaf.path)
        if smd is None:
            problems.append(f"  {where}: missing from the checkpoint")
            continue
        used.add(fqn)
        if leaf.kind == "value":
            if not isinstance(smd, BytesStorageMetadata):
                problems.append(f"  {where}: saved as a tensor, template has a value")
            elif not allow_pickle:
                pickled.append(where)
            else:
                items.append((leaf, fqn, smd))
            continue
        if not isinstance(smd, TensorStorageMetadata):
            problems.append(f"  {where}: saved as a pickled value, template has a tensor")
            continue
        t: torch.Tensor = leaf.value
        saved_dtype = smd.properties.dtype
        if tuple(smd.size) != tuple(t.shape):
            problems.append(f"  {where}: saved shape {list(smd.size)}, template {list(t.shape)}")
        elif saved_dtype != t.dtype and not cast:
            problems.append(
                f"  {where}: saved dtype {dtype_name(saved_dtype)}, template "
                f"{dtype_name(t.dtype)} (pass cast=True to convert)"
            )
        else:
            items.append((leaf, fqn, smd))
    if not partial:
        extra = sorted(set(saved) - used)
        problems += [f"  DCP key {k!r}: in the checkpoint but not in the template" for k in extra]
    if problems:
        raise TemplateMismatch(
            f"{root}: the DCP checkpoint does not fit the template:\n" + "\n".join(problems)
        )
    if pickled:
        raise UnsafeCheckpoint(
            f"{root}: these values are stored as pickles, which can run code; pass "
            "allow_pickle=True only for a checkpoint you trust:\n  " + "\n  ".join(pickled)
        )
    return StockMatch(items, storage, node_record(as_state(template)))


def _where(path: KeyPath) -> str:
    return f"{format_path(path)} (DCP key {'.'.join(path)!r})"


def read_dcp(
    files: StockFiles, match: StockMatch, *, inplace: bool, device: torch.device
) -> list[Leaf]:
    """Read every matched leaf: tensors into new tensors (or the template's, ``inplace``).

    A tensor lands in a new tensor of its template leaf's dtype and device
    (``device`` for ``meta`` leaves); pickled values reach here only when the
    caller allowed them.
    """
    from torch.distributed.checkpoint.metadata import MetadataIndex

    root = files.root
    out: list[Leaf] = []
    for leaf, fqn, smd in match.items:
        if fqn is None:
            out.append(leaf)
            continue
        where = _where(leaf.path)
        if leaf.kind == "value":
            info = match.storage.get(MetadataIndex(fqn))
            if info is None:
                raise CorruptCheckpoint(f"{root}: no storage recorded for {where}")
            blob = files.blob(info)
            value = torch.load(io.BytesIO(blob), weights_only=False)  # trusted by the caller
            out.append(Leaf(leaf.path, "value", value))
            continue
        t: torch.Tensor = leaf.value
        if inplace and not t.is_meta:
            dest = t
        else:
            dev = device if t.is_meta else t.device
            dest = torch.empty(t.shape, dtype=t.dtype, device=dev)
        with torch.no_grad():
            for chunk in smd.chunks:
                info = match.storage.get(MetadataIndex(fqn, chunk.offsets))
                if info is None:
                    raise CorruptCheckpoint(f"{root}: no storage recorded for {where}")
                piece = _load_tensor(files.blob(info), f"{root} {where}")
                if tuple(piece.shape) != tuple(chunk.sizes):
                    raise CorruptCheckpoint(f"{root} {where}: chunk shape differs from metadata")
                region = dest
                for dim, (off, size) in enumerate(zip(chunk.offsets, chunk.sizes, strict=True)):
                    region = region.narrow(dim, off, size)
                region.copy_(piece)
        if dest is not t and t.requires_grad and (dest.is_floating_point() or dest.is_complex()):
            dest.requires_grad_(True)
        out.append(Leaf(leaf.path, "tensor", dest))
    return out


def inspect_dcp(root: Path) -> CheckpointSummary:
    """Describe a stock DCP checkpoint from its metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_stock_metadata(root)
    planner: Any = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[str, Any] = Node()
    num_tensors = num_values = tensor_bytes = 0
    for fqn, smd in md.state_dict_metadata.items():
        kp = planner.get(fqn)
        flat = isinstance(kp, tuple | list) and kp and all(type(k) in (str, int) for k in kp)
        path: KeyPath = tuple(str(k) for k in kp) if flat else (fqn,)
        if isinstance(smd, TensorStorageMetadata):
            n = 1
            for d in smd.size:
                n *= d
            nbytes = n * torch.empty((), dtype=smd.properties.dtype).element_size()
            tensor_bytes += nbytes
            num_tensors += 1
            insert(tree, path, TensorSpec(smd.properties.dtype, tuple(smd.size), nbytes))
        else:
            num_values += 1
            insert(tree, path, "<pickled value, not loaded>")
    file_bytes = 0
    for f in os.listdir(root):
        st = os.lstat(root / f)
        file_bytes += st.st_size if stat.S_ISREG(st.st_mode) else 0
    return CheckpointSummary(
        path=root,
        format_version=None,
        created=None,
        metadata=None,
        tree=tree,
        num_tensors=num_tensors,
        num_values=num_values,
        tensor_bytes=tensor_bytes,
        file_bytes=file_bytes,
        foreign=True,
    )
