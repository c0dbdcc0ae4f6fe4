"""What ``fc.inspect`` returns: a checkpoint's tree of specs and values, and how to show it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec import table
from functional_ckpt._src.codec.registration import registration_line
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.format.manifest import dtype_name, torch_dtype
from functional_ckpt._src.text import clip, printable, short_repr

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True, init=False)
class TensorSpec:
    """A tensor as a checkpoint records it; the dtype held by name, so it needs no torch."""

    dtype_name: str
    shape: tuple[int, ...]
    nbytes: int

    def __init__(self, dtype: torch.dtype | str, shape: tuple[int, ...], nbytes: int) -> None:
        if isinstance(dtype, str):
            name = table.DTYPE_ALIASES.get(dtype, dtype)
            if name not in table.DTYPE_SIZES:
                raise ValueError(f"TensorSpec: unknown dtype {dtype!r}")
        else:
            name = dtype_name(dtype)
        for key, value in (("dtype_name", name), ("shape", shape), ("nbytes", nbytes)):
            object.__setattr__(self, key, value)

    @property
    def dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype_name)

    def __str__(self) -> str:
        return f"{self.dtype_name}{list(self.shape)} ({self.nbytes} B)"


class Node(dict[str, Any]):
    """A sub-tree in ``CheckpointSummary.tree`` (plain values that are dicts are not)."""

    batch_size: tuple[int, ...] = ()  # of the TensorDict it was saved from
    names: list[str | None] | None = None


def node_of(record: Mapping[str, Any] | None) -> Node:
    """A summary node carrying the batch size and names a node entry recorded."""
    node = Node()
    if record:
        node.batch_size = tuple(record["batch_size"])
        node.names = record.get("names")
    return node


@dataclass
class CheckpointSummary:
    """What a checkpoint holds, read from its manifest alone."""

    path: Path
    format_version: int | None
    created: float | None
    metadata: Any
    tree: dict[str, Any]  # nested: key -> Node | TensorSpec | plain value
    num_tensors: int
    num_values: int
    tensor_bytes: int
    file_bytes: int
    foreign: bool = False
    world_size: int = 1  # ranks that wrote it; per-rank subtrees shown are rank 0's
    shared_bytes: int = 0  # in data files also linked into another checkpoint
    added_bytes: int | None = None  # what its save wrote (the rest it reused from a base)
    unregistered: tuple[str, ...] = ()  # tags of the values shown as fc.codec.Unregistered

    def __str__(self) -> str:
        lines = [
            f"{self.path}: {self.num_tensors} tensors ({self.tensor_bytes} B), "
            f"{self.num_values} values"
        ]

        def walk(node: dict[str, Any], indent: str) -> None:
            for k, v in node.items():
                if isinstance(v, Node):
                    batch = f" batch_size={list(v.batch_size)}" if v.batch_size else ""
                    lines.append(f"{indent}{k}/{batch}")
                    walk(v, indent + "  ")
                else:
                    text = str(v) if isinstance(v, TensorSpec | str) else short_repr(v)
                    lines.append(f"{indent}{k}: {clip(text, 100)}")

        walk(self.tree, "  ")
        if self.unregistered:
            lines.append(unregistered_note(self.unregistered))
        return "\n".join(lines)


def unregistered_note(tags: tuple[str, ...]) -> str:
    """Which classes this process lacks, and the lines that let ``fc.restore`` rebuild them."""
    lines = [
        "not registered in this process, so shown by tag and fields (fc.restore of "
        "these values needs each class registered where it is defined):"
    ]
    lines += [f"  {printable(registration_line(t))}" for t in tags[:5]]
    if len(tags) > 5:
        lines.append(f"  and {len(tags) - 5} more")
    return "\n".join(lines)


def insert(tree: dict[str, Any], path: KeyPath, value: Any) -> None:
    """Put ``value`` at ``path``, creating the Nodes on the way."""
    node = tree
    for k in path[:-1]:
        node = node.setdefault(k, Node())
    node[path[-1]] = value
