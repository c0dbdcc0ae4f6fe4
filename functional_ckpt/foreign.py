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
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt import format
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    TemplateMismatch,
    UnsafeCheckpoint,
)
from functional_ckpt.manifest import dtype_name
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


def _read_blob(root: Path, info: Any, sizes: dict[str, int]) -> bytes:
    name = info.relative_path
    path = format.safe_member(root, name)
    if name not in sizes:
        try:
            sizes[name] = path.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpoint(f"{path}: shard file is missing") from None
    if info.offset < 0 or info.length < 0 or info.offset + info.length > sizes[name]:
        raise UnsafeCheckpoint(f"{path}: DCP metadata points beyond the end of the file")
    with open(path, "rb") as f:
        f.seek(info.offset)
        return f.read(info.length)


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
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    if template is None:
        raise CheckpointError(
            f"{root}: a stock DCP checkpoint has no manifest; pass a template to restore it"
        )
    md = format.read_dcp_metadata(root)
    saved: dict[str, Any] = md.state_dict_metadata
    leaves = list(iter_leaves(as_state(template)))
    problems: list[str] = []
    pickled: list[str] = []
    used: set[str] = set()
    out: list[Leaf] = []
    sizes: dict[str, int] = {}
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
                blob = _read_blob(root, md.storage_data[MetadataIndex(fqn)], sizes)
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
                info = md.storage_data.get(MetadataIndex(fqn, chunk.offsets))
                if info is None:
                    raise CorruptCheckpoint(f"{root}: no storage recorded for {where}")
                piece = _load_tensor(_read_blob(root, info, sizes), f"{root} {where}")
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


def inspect_dcp(root: Path) -> Any:
    """Describe a stock DCP checkpoint from its metadata alone."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from functional_ckpt.io import CheckpointSummary, Node, TensorSpec, _insert

    md = format.read_dcp_metadata(root)
    planner: Any = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[str, Any] = Node()
    num_tensors = num_values = tensor_bytes = 0
    for fqn, smd in md.state_dict_metadata.items():
        kp = planner.get(fqn)
        path: KeyPath = tuple(str(k) for k in kp) if isinstance(kp, tuple | list) and kp else (fqn,)
        if isinstance(smd, TensorStorageMetadata):
            n = 1
            for d in smd.size:
                n *= d
            nbytes = n * torch.empty((), dtype=smd.properties.dtype).element_size()
            tensor_bytes += nbytes
            num_tensors += 1
            _insert(tree, path, TensorSpec(smd.properties.dtype, tuple(smd.size), nbytes))
        else:
            num_values += 1
            _insert(tree, path, "<pickled value, not loaded>")
    file_bytes = sum((root / f).stat().st_size for f in os.listdir(root) if (root / f).is_file())
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
