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
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

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
    unflatten,
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


def restore_dcp(
    root: Path,
    template: TensorDictBase | Mapping[str, Any] | None,
    *,
    partial: bool,
    cast: bool,
    allow_pickle: bool,
    inplace: bool = False,
    device: torch.device | None = None,
) -> TensorDict:
    """Restore the template's keys from a stock DCP checkpoint.

    Into new tensors of each template leaf's dtype and device (``device`` for
    ``meta`` leaves), or into the template's own tensors when ``inplace``.
    """
    if template is None:
        raise CheckpointError(
            f"{root}: a stock DCP checkpoint has no manifest; pass a template to restore it"
        )
    with StockFiles(root) as files:
        return _restore(
            files,
            template,
            partial=partial,
            cast=cast,
            allow_pickle=allow_pickle,
            inplace=inplace,
            device=device,
        )


def _restore(
    files: StockFiles,
    template: TensorDictBase | Mapping[str, Any],
    *,
    partial: bool,
    cast: bool,
    allow_pickle: bool,
    inplace: bool,
    device: torch.device | None,
) -> TensorDict:
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    root = files.root
    md = files.metadata()
    saved: dict[str, Any] = md.state_dict_metadata
    storage: dict[Any, Any] = md.storage_data if isinstance(md.storage_data, dict) else {}
    leaves = list(iter_leaves(as_state(template)))
    problems: list[str] = []
    pickled: list[str] = []
    used: set[str] = set()
    out: list[Leaf] = []
    for leaf in leaves:
        if leaf.kind == "node" or leaf.path[-1] == NODE_KEY:
            out.append(leaf)  # structure (and container records) come from the template
            continue
        fqn = ".".join(leaf.path)
        smd = saved.get(fqn)
        where = f"{format_path(leaf.path)} (DCP key {fqn!r})"
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
                info = storage.get(MetadataIndex(fqn))
                if info is None:
                    raise CorruptCheckpoint(f"{root}: no storage recorded for {where}")
                blob = files.blob(info)
                value = torch.load(io.BytesIO(blob), weights_only=False)  # trusted by the caller
                out.append(Leaf(leaf.path, "value", value))
            continue
        if not isinstance(smd, TensorStorageMetadata):
            problems.append(f"  {where}: saved as a pickled value, template has a tensor")
            continue
        t: torch.Tensor = leaf.value
        saved_dtype = smd.properties.dtype
        if tuple(smd.size) != tuple(t.shape):
            problems.append(f"  {where}: saved shape {list(smd.size)}, template {list(t.shape)}")
            continue
        if saved_dtype != t.dtype and not cast:
            problems.append(
                f"  {where}: saved dtype {dtype_name(saved_dtype)}, template "
                f"{dtype_name(t.dtype)} (pass cast=True to convert)"
            )
            continue
        if inplace and not t.is_meta:
            dest = t
        else:
            dev = (device or torch.device("cpu")) if t.is_meta else t.device
            dest = torch.empty(t.shape, dtype=t.dtype, device=dev)
        with torch.no_grad():
            for chunk in smd.chunks:
                info = storage.get(MetadataIndex(fqn, chunk.offsets))
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
    return unflatten(out, node_record(as_state(template)))


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
