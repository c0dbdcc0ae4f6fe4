"""``fc.inspect``: what a checkpoint holds, from its manifest (or stock ``.metadata``) alone."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any

from functional_ckpt._src.format.header import header_of
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.kind import is_stock_dcp
from functional_ckpt._src.format.naming import parse_part, parse_shard
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.restore import summary
from functional_ckpt._src.storage import committed
from functional_ckpt._src.storage.committed import open_checkpoint
from functional_ckpt._src.storage.usage import dir_size, sharing


def inspect_dcp(root: Path) -> summary.CheckpointSummary:
    """Describe a stock DCP checkpoint from its metadata alone (DCP's classes: torch)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from functional_ckpt._src.restore.stock_dcp import StockFiles

    with contextlib.closing(StockFiles(root)) as files:
        md = files.md
    planner: Any = md.planner_data if isinstance(md.planner_data, dict) else {}
    tree: dict[str, Any] = summary.Node()
    num_tensors = num_values = tensor_bytes = 0
    for fqn, smd in md.state_dict_metadata.items():
        kp = planner.get(fqn)
        flat = isinstance(kp, tuple | list) and kp and all(type(k) in (str, int) for k in kp)
        path: KeyPath = tuple(str(k) for k in kp) if flat else (fqn,)
        if isinstance(smd, TensorStorageMetadata):
            nbytes = math.prod(smd.size) * smd.properties.dtype.itemsize
            tensor_bytes += nbytes
            num_tensors += 1
            spec = summary.TensorSpec(smd.properties.dtype, tuple(smd.size), nbytes)
            summary.insert(tree, path, spec)
        else:
            num_values += 1
            summary.insert(tree, path, "<pickled value, not loaded>")
    return summary.CheckpointSummary(
        path=root,
        format_version=None,
        created=None,
        metadata=None,
        tree=tree,
        num_tensors=num_tensors,
        num_values=num_values,
        tensor_bytes=tensor_bytes,
        file_bytes=dir_size(root),
        foreign=True,
    )


def _file_sums(src: Path, raw: dict[str, Any], parts: int) -> tuple[int, int, int]:
    """(bytes, bytes shared, bytes added) of a checkpoint's files, without reading any part."""
    files = dict(raw["files"])  # validated; the index's table alone
    total = sum(f["size"] for f in files.values())
    shared, added = sharing(src, files)
    held = raw.get("part_files")
    if not parts or not isinstance(held, dict):
        return total, shared, added
    size, reused = (
        v if type(v) is int and v >= 0 else 0 for v in map(held.get, ("size", "reused"))
    )
    total, added = total + size, added + size - min(reused, size)
    for name in os.listdir(src):
        shard = parse_shard(name)
        if name not in files and (parse_part(name) is not None or (shard and shard[0] < parts)):
            with contextlib.suppress(OSError):
                st = os.lstat(src / name)
                if not shard:  # a part: listed nowhere, written by this save
                    total, added = total + st.st_size, added + st.st_size
                elif st.st_nlink > 1:
                    shared += st.st_size
    return total, shared, added


def inspect(path: PathLike) -> summary.CheckpointSummary:
    """Describe a checkpoint without reading any tensor data, or the code that wrote it: an
    unregistered class's value is an ``fc.codec.Unregistered`` placeholder."""
    src = Path(path)
    if is_stock_dcp(src):
        return inspect_dcp(src)
    with open_checkpoint(src) as ck:
        once = committed.parsed(ck)
        sums = _file_sums(src, ck.manifest, once.shared.parts)  # before a part adds files
        parsed = once.view(0, parts=())  # specs only: no chunk is read
        unregistered = tuple(sorted(ck.unregistered))
    tree: dict[str, Any] = summary.node_of(parsed.root)
    tensor_bytes = 0
    for p, kind in parsed.order:
        if kind == "node":
            summary.insert(tree, p, summary.node_of(parsed.node_info.get(p)))
        elif kind == "value":
            summary.insert(tree, p, parsed.values[p])
        else:
            e = parsed.tensors[p]
            tensor_bytes += e.nbytes if e.alias is None else 0
            summary.insert(tree, p, summary.TensorSpec(e.dtype_name, e.shape, e.nbytes))
    raw = parsed.raw
    file_bytes, shared, added = sums
    head = header_of(raw)  # re-signed manifests lie: only sane values count
    return summary.CheckpointSummary(
        path=src,
        format_version=head.version,
        created=head.created,
        metadata=raw.get("metadata"),
        tree=tree,
        num_tensors=len(parsed.tensors),
        num_values=len(parsed.values),
        tensor_bytes=tensor_bytes,
        file_bytes=file_bytes,
        world_size=parsed.world_size,
        shared_bytes=shared,
        added_bytes=added,
        unregistered=unregistered,
    )
