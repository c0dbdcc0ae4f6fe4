"""DCP's deduplication of the ranks' save plans, on keys, without DCP's slow hash.

DCP keys its tables by ``MetadataIndex`` (a Python ``__hash__``, slow at 100k items)
and needs whole plans; this is its algorithm on each item's name, offset and bytes,
so ranks send keys alone (:mod:`.exchange`), with DCP's result, in DCP's order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan

#: One write item as the coordinator sees it: its DCP name, its offset in the
#: global tensor (None for a value) and the bytes DCP's balancing counts for it.
ItemKey = tuple[str, tuple[int, ...] | None, int]
#: The positions of a rank's write items that another rank writes instead.
Drops = tuple[int, ...]


def item_keys(plan: SavePlan) -> tuple[ItemKey, ...]:
    """The keys of a local plan's items, in its order."""
    import torch

    widths: dict[Any, int] = {}
    out: list[ItemKey] = []
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            nbytes = 1
        else:
            dtype = data.properties.dtype
            width = widths.get(dtype)
            if width is None:
                width = widths[dtype] = torch._utils._element_size(dtype)  # type: ignore[no-untyped-call]
            nbytes = math.prod(data.size) * width or 1  # DCP counts the whole tensor
        offset = item.index.offset
        out.append((item.index.fqn, None if offset is None else tuple(offset), nbytes))
    return tuple(out)


def dedup_keys(plans: Sequence[Sequence[ItemKey]], lowest: bool = False) -> list[Drops]:
    """Which items each rank drops so that every item is written once: kept by the
    lowest rank (``lowest``) or the one holding the fewest bytes so far, as DCP does."""
    where: dict[tuple[str, Any], Any] = {}  # (name, offset) -> the rank holding it, or the set
    nbytes_of: dict[tuple[str, Any], int] = {}
    for p, keys in enumerate(plans):
        for fqn, offset, nbytes in keys:
            key = (fqn, offset)
            got = where.get(key)
            if got is None:
                where[key] = p
            elif type(got) is int:
                where[key] = {got, p}  # in plan order, as DCP's: min() breaks ties alike
            else:
                got.add(p)
            nbytes_of[key] = nbytes
    sizes = [0] * len(plans)
    dropped: dict[int, set[tuple[str, Any]]] = {}
    for key, held in where.items():
        if type(held) is int:
            chosen = held
        elif lowest:
            chosen = min(held)
        else:
            chosen = min(held, key=sizes.__getitem__)
        sizes[chosen] += nbytes_of[key]
        if type(held) is not int:
            for p in held - {chosen}:
                dropped.setdefault(p, set()).add(key)
    out: list[Drops] = []
    for p, keys in enumerate(plans):
        gone = dropped.get(p)
        out.append(() if not gone else tuple(i for i, k in enumerate(keys) if (k[0], k[1]) in gone))
    return out


def kept(plan: SavePlan, drops: Drops) -> SavePlan:
    """``plan`` without the items at ``drops``."""
    if not drops:
        return dataclasses.replace(plan, items=list(plan.items))
    gone = set(drops)
    return dataclasses.replace(plan, items=[it for i, it in enumerate(plan.items) if i not in gone])
