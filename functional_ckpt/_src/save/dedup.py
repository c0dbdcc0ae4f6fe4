"""DCP's deduplication of save plans, on keys alone: DCP's result, without its slow hashing."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan

ItemKey = tuple[str, tuple[int, ...] | None, int]  # DCP name, offset (None: a value), bytes
Drops = tuple[int, ...]  # the positions of a rank's items that another rank writes instead


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
    """Which items each rank drops so that each is written once, where DCP would keep it."""
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
