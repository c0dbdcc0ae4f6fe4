"""Compare two checkpoints key by key, exactly: "identical" means bit-identical (0.0 is
not -0.0, NaN equals NaN)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from functional_ckpt._src.codec import Unregistered
from functional_ckpt._src.format.keys import KeyPath
from functional_ckpt._src.restore.api import restore_for_viewing
from functional_ckpt._src.restore.read import element_bytes, tensor_spec
from functional_ckpt._src.state.tree import iter_leaves
from functional_ckpt._src.text import printable, short_repr


@dataclass(frozen=True)
class DiffEntry:
    """One difference (or sameness) between two checkpoints, for one key."""

    kind: str  # added | removed | kind | shape | dtype | value | tensor | same
    key: KeyPath
    detail: str = ""
    nbytes: int = 0

    def __str__(self) -> str:
        sign = {"added": "+", "removed": "-", "same": "="}.get(self.kind, "~")
        return f"{sign} {self.kind:<7} {printable('/'.join(self.key))}  {self.detail}".rstrip()


@dataclass
class DiffResult:
    a: Path
    b: Path
    entries: list[DiffEntry]

    @property
    def changes(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.kind != "same"]

    @property
    def same(self) -> list[DiffEntry]:
        return [e for e in self.entries if e.kind == "same"]


def _leaves(path: Path) -> dict[KeyPath, tuple[str, Any]]:
    state = restore_for_viewing(path)  # comparing needs no registered class
    return {p: (kind, v) for p, kind, v in iter_leaves(state) if kind != "node"}


def same_value(a: Any, b: Any) -> bool:
    """Exact equality of plain values: same types, floats bit for bit (NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return bool(a.hex() == b.hex())
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):  # keys pairwise: a placeholder key compares by identity
        pairs = zip(a.items(), b.items(), strict=False)
        return len(a) == len(b) and all(
            same_value(ka, kb) and same_value(va, vb) for (ka, va), (kb, vb) in pairs
        )
    if isinstance(a, set | frozenset) and a != b:  # placeholder members: by what they show
        return sorted(map(repr, a)) == sorted(map(repr, b))
    if isinstance(a, np.ndarray):
        return bool(a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes())
    if isinstance(a, Unregistered):
        return a.tag == b.tag and same_value(a.fields, b.fields)
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return repr(a) == repr(b)


def tensor_delta(a: torch.Tensor, b: torch.Tensor) -> str | None:
    """None if bit-identical, else how much they differ, in float64 (or complex128), which
    holds every float8/16/32 and integer up to 2**53 exactly; NaN against a number apart."""
    try:
        differ = (element_bytes(a) != element_bytes(b)).any(dim=1)
    except RuntimeError:
        return None if torch.equal(a, b) else "values differ"
    n = int(differ.sum())
    if n == 0:
        return None
    where = f"{n} of {a.numel()} elements differ"
    try:
        wide = torch.complex128 if a.is_complex() else torch.float64
        x = a.detach().reshape(-1).to(wide)[differ]
        y = b.detach().reshape(-1).to(wide)[differ]
    except (RuntimeError, TypeError):
        return f"bytes differ ({where})"
    d = (x - y).abs()
    nan = d.isnan()
    both_nan = x.isnan() & y.isnan()
    mismatched = int((nan & ~both_nan).sum())
    finite = d[~nan]
    text = f"max |Δ| {float(finite.max()):.3g}" if finite.numel() else "max |Δ| -"
    if mismatched:
        text += f", {mismatched} NaN vs number"
    return f"{text} ({where})"


def _show(kind: str, value: Any, width: int) -> str:
    return tensor_spec(value) if kind == "tensor" else short_repr(value, width)


def _diff_one(key: KeyPath, a: tuple[str, Any], b: tuple[str, Any]) -> DiffEntry:
    (ka, va), (kb, vb) = a, b
    if ka != kb:
        return DiffEntry("kind", key, f"{ka} {_show(ka, va, 40)} -> {kb} {_show(kb, vb, 40)}")
    if ka == "value":
        if same_value(va, vb):
            return DiffEntry("same", key)
        return DiffEntry("value", key, f"{short_repr(va, 60)} -> {short_repr(vb, 60)}")
    if tuple(va.shape) != tuple(vb.shape):
        return DiffEntry("shape", key, f"{tensor_spec(va)} -> {tensor_spec(vb)}")
    if va.dtype != vb.dtype:
        return DiffEntry("dtype", key, f"{tensor_spec(va)} -> {tensor_spec(vb)}")
    delta = tensor_delta(va, vb)
    nbytes = va.numel() * va.element_size()
    if delta is None:
        return DiffEntry("same", key, tensor_spec(va), nbytes)
    return DiffEntry("tensor", key, f"{tensor_spec(va)}  {delta}", nbytes)


def diff_checkpoints(
    a: Path, b: Path, progress: Callable[[str, Path | None], None] | None = None
) -> DiffResult:
    """Compare two checkpoints leaf by leaf; ``progress(stage, path)`` hears each stage."""
    say = progress or (lambda stage, path: None)
    say("reading", a)
    left = _leaves(a)
    say("reading", b)
    right = _leaves(b)
    say("comparing", None)
    entries = [DiffEntry("added", k, _show(*v, 60)) for k, v in right.items() if k not in left]
    entries += [
        _diff_one(k, v, right[k]) if k in right else DiffEntry("removed", k, _show(*v, 60))
        for k, v in left.items()
    ]
    order = {"added": 0, "removed": 1, "kind": 2, "shape": 3, "dtype": 4, "value": 5, "tensor": 6}
    entries.sort(key=lambda e: (order.get(e.kind, 7), e.key))
    say("done", None)
    return DiffResult(a, b, entries)
