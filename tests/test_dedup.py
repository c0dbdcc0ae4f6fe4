"""The coordinator's deduplication of save plans is DCP's own, item for item."""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans as dcp_dedup
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from functional_ckpt._src.save import dedup


def _tensor(
    fqn: str, offset: tuple[int, ...], size: tuple[int, ...], dtype: torch.dtype
) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(fqn, offset),
        type=WriteItemType.SHARD if any(offset) else WriteItemType.TENSOR,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offset), sizes=torch.Size(size)),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(size),
        ),
    )


def _plans(seed: int, ranks: int) -> list[SavePlan]:
    """Sharded tensors (one chunk a rank), replicated ones (every rank or some, of
    several sizes and dtypes, so that the least loaded rank changes) and bytes."""
    rng = random.Random(seed)
    plans = []
    shared = [
        (
            f"rep{i}",
            (rng.randint(0, 40), 3),
            rng.choice([torch.float32, torch.bfloat16, torch.int8]),
        )
        for i in range(12)
    ]
    for r in range(ranks):
        items = [_tensor(f"w{t}", (r * 4, 0), (4, 8), torch.float32) for t in range(5)]
        for fqn, size, dtype in shared:
            if rng.random() < 0.7:
                items.append(_tensor(fqn, (0, 0), size, dtype))
        items.append(_tensor("step", (), (), torch.float32))
        items.append(WriteItem(index=MetadataIndex("lr"), type=WriteItemType.BYTE_IO))
        if rng.random() < 0.3:
            items.append(WriteItem(index=MetadataIndex(f"own{r}"), type=WriteItemType.BYTE_IO))
        rng.shuffle(items)
        plans.append(SavePlan(items, storage_data=r, planner_data={"r": r}))
    return plans


@pytest.mark.parametrize("lowest", [False, True])
@pytest.mark.parametrize(("seed", "ranks"), [(0, 1), (1, 2), (2, 7), (3, 33), (4, 300)])
def test_the_same_items_stay_with_the_same_ranks_as_in_dcp(
    seed: int, ranks: int, lowest: bool
) -> None:
    plans = _plans(seed, ranks)
    want = dcp_dedup(plans, lowest)
    drops = dedup.dedup_keys([dedup.item_keys(p) for p in plans], lowest)
    got = [dedup.kept(p, d) for p, d in zip(plans, drops, strict=True)]
    assert got == want
    assert [[i.index for i in p.items] for p in got] == [[i.index for i in p.items] for p in want]
    assert sum(len(p.items) for p in got) < sum(len(p.items) for p in plans) or ranks == 1
