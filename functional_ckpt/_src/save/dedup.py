"""DCP's deduplication of the ranks' save plans, without hashing DCP's keys.

The coordinator of a sharded save receives one write item per chunk of every
rank: at a thousand ranks over a hundred thousand. DCP's ``dedup_save_plans``
keys its tables by ``MetadataIndex``, whose hash is a Python method, called
several times per item; this is the same algorithm keyed by the same fields
(its name and offset: what ``MetadataIndex`` compares), so its result is DCP's
own, plan for plan and item for item, in the same order.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from torch.distributed.checkpoint.planner import SavePlan


def dedup_save_plans(
    all_plans: list[SavePlan], save_to_lowest_rank: bool = False
) -> list[SavePlan]:
    """What ``torch.distributed.checkpoint._dedup_save_plans.dedup_save_plans`` returns.

    Each item written by several ranks is kept by one: the lowest rank, or the one
    whose plan holds the fewest bytes so far (items in the order DCP visits them).
    """
    import torch

    where: dict[Any, Any] = {}  # key -> the plan holding it, or the set of them
    item_of: dict[Any, Any] = {}
    for p, plan in enumerate(all_plans):
        for item in plan.items:
            index = item.index
            key = (index.fqn, index.offset)
            got = where.get(key)
            if got is None:
                where[key] = p
            elif type(got) is int:
                # built as DCP builds it (added in plan order), so min() breaks ties alike
                held = set()
                held.add(got)
                held.add(p)
                where[key] = held
            else:
                got.add(p)
            item_of[key] = item
    sizes = [0] * len(all_plans)
    element: dict[Any, int] = {}
    dropped: dict[int, set[Any]] = {}
    for key, held in where.items():
        if type(held) is int:
            chosen = held
        elif save_to_lowest_rank:
            chosen = min(held)
        else:
            chosen = min(held, key=sizes.__getitem__)
        data = item_of[key].tensor_data
        if data is None:
            nbytes = 1
        else:
            dtype = data.properties.dtype
            width = element.get(dtype)
            if width is None:
                width = element[dtype] = torch._utils._element_size(dtype)  # type: ignore[no-untyped-call]
            nbytes = math.prod(data.size) * width or 1
        sizes[chosen] += nbytes
        if type(held) is not int:
            for p in held - {chosen}:
                dropped.setdefault(p, set()).add(key)
    out = []
    for p, plan in enumerate(all_plans):
        gone = dropped.get(p)
        items = (
            list(plan.items)
            if not gone
            else [i for i in plan.items if (i.index.fqn, i.index.offset) not in gone]
        )
        out.append(dataclasses.replace(plan, items=items))
    return out
