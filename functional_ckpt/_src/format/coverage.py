"""Chunk coverage: the stored boxes of a tensor cover every element exactly once (a
reader that trusted them could return a hole, or pick one of two overlapping writes)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from functional_ckpt._src.codec import table
from functional_ckpt._src.limits import LIMITS
from functional_ckpt.errors import CorruptCheckpoint, UnsafeCheckpoint


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_coverage(
    shape: Sequence[int], boxes: Sequence[tuple[Sequence[int], Sequence[int]]], what: str
) -> None:
    """Every element of a tensor of ``shape`` lies in exactly one box (offsets, sizes),
    given boxes inside the tensor whose element counts add up to its own.

    The box boundaries cut the tensor into a grid (one cell per box for real layouts);
    a cell filled twice is an overlap (CorruptCheckpoint), and the counts then leave no
    cell empty. More cells than ``LIMITS.coverage_cells``: UnsafeCheckpoint.
    """
    boxes = [(o, s) for o, s in boxes if numel(s)]  # empty boxes cover nothing
    if len(boxes) <= 1:
        return
    cuts = []
    for i, dim in enumerate(shape):
        starts = {o[i] for o, _ in boxes}
        cuts.append(sorted({0, dim, *starts, *(o[i] + s[i] for o, s in boxes)}))
    cells = numel([len(b) - 1 for b in cuts])
    if cells > LIMITS.coverage_cells:
        raise UnsafeCheckpoint(
            f"{what} ({len(boxes)}) cut the tensor into {cells} pieces (at most "
            f"{LIMITS.coverage_cells} can be checked); not a layout any writer produces"
        )
    index = [{v: j for j, v in enumerate(b)} for b in cuts]
    counts = [len(b) - 1 for b in cuts]
    strides = [numel(counts[i + 1 :]) for i in range(len(counts))]
    grid = bytearray(cells)  # one byte per cell, C order: filled or not
    filled = b"\x01"
    for offsets, sizes in boxes:
        spans = [
            range(index[i][o], index[i][o + s])
            for i, (o, s) in enumerate(zip(offsets, sizes, strict=True))
        ]
        lead, last = (spans[:-1], spans[-1]) if spans else ([], range(1))
        for cell in itertools.product(*lead):  # each row of the box along the last dimension
            start = sum(j * k for j, k in zip(cell, strides, strict=False)) + last.start
            end = start + len(last)
            if grid.find(filled, start, end) != -1:
                raise CorruptCheckpoint(
                    f"{what} overlap at offsets {list(offsets)}; the checkpoint is damaged"
                )
            grid[start:end] = filled * (end - start)


def shape_problem(shape: Sequence[int], dtype: str) -> str | None:
    """Why a tensor of this shape and dtype (its name) lies beyond the format's limits, or None."""
    if len(shape) > LIMITS.tensor_ndim:
        return f"{len(shape)} dimensions (the format allows at most {LIMITS.tensor_ndim})"
    extent = LIMITS.tensor_extent
    if any(d >= extent for d in shape):
        return f"a dimension of {max(shape)} (each must be below 2**{extent.bit_length() - 1})"
    if numel(shape) * table.DTYPE_SIZES[dtype] >= extent:
        return (
            f"shape {list(shape)} of {dtype} "
            f"(the element count times the element size must be below "
            f"2**{extent.bit_length() - 1})"
        )
    return None
