"""The coordinator's plan cache: a layout saved again is not planned again, and a
plan is reused only for the world and the layout it was made for.

The local plans are the ones DCP's planner makes of benchmarks/scale.py's state on
every simulated rank (the same plans the coordinator of a real save receives).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

import functional_ckpt as fc
from functional_ckpt._src.save import multi_rank

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import scale

MODEL = scale.Model(layers=1, hidden=64, mlp=128, vocab=256)
UNCHANGED = SavePlan([], usable=False)


@pytest.fixture(autouse=True)
def empty_cache() -> Iterator[None]:
    """Each test starts with no plan cached (the caches are DCP's, per process)."""
    saved = dict(SavePlanner._cached_all_plans), dict(SavePlanner._cached_global_plan)
    SavePlanner._cached_all_plans.clear()
    SavePlanner._cached_global_plan.clear()
    yield
    SavePlanner._cached_all_plans.clear()
    SavePlanner._cached_global_plan.clear()
    SavePlanner._cached_all_plans.update(saved[0])
    SavePlanner._cached_global_plan.update(saved[1])


class Counting:
    """DCP's deduplication, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, plans: list[SavePlan]) -> list[SavePlan]:
        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans

        self.calls += 1
        return dedup_save_plans(plans)


def owners(plans: list[SavePlan]) -> list[set[str]]:
    return [{it.index.fqn for it in p.items} for p in plans]


def local_plans(n: int) -> list[Any]:
    return list(scale.simulate(MODEL, n).dcp_plans)


def test_a_layout_saved_again_is_not_planned_again() -> None:
    key, dedup = multi_rank.plan_key(range(4)), Counting()
    first_delta, first = multi_rank.global_plans(key, local_plans(4), dedup)
    assert dedup.calls == 1 and first_delta == first
    delta, again = multi_rank.global_plans(key, [UNCHANGED] * 4, dedup)
    assert dedup.calls == 1  # every rank said "unchanged": nothing planned
    assert again is first and all(not p.usable for p in delta)


def test_a_rank_whose_layout_changed_is_planned_again_with_the_others() -> None:
    key, dedup = multi_rank.plan_key(range(4)), Counting()
    first = local_plans(4)
    multi_rank.global_plans(key, first, dedup)
    other = scale.simulate(scale.Model(layers=2, hidden=64, mlp=128, vocab=256), 4).dcp_plans
    changed = [UNCHANGED, other[1], UNCHANGED, UNCHANGED]  # rank 1 has new keys
    delta, plans = multi_rank.global_plans(key, changed, dedup)
    assert dedup.calls == 2
    merged = [first[0], other[1], first[2], first[3]]  # the cached plans, rank 1's new one
    assert set().union(*owners(plans)) == set().union(*owners(merged))
    assert any("layer1" in fqn for fqn in owners(plans)[1])  # its new keys are planned
    assert delta[1].usable  # the rank whose plan changed is sent its new plan


def test_a_plan_is_never_reused_by_another_world() -> None:
    dedup = Counting()
    multi_rank.global_plans(multi_rank.plan_key(range(4)), local_plans(4), dedup)
    assert multi_rank.plan_key(range(3)) != multi_rank.plan_key(range(4))
    assert multi_rank.plan_key([0, 1, 2, 4]) != multi_rank.plan_key(range(4))
    for key, n in ((multi_rank.plan_key(range(3)), 3), (multi_rank.plan_key(range(4)), 3)):
        with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
            multi_rank.global_plans(key, [UNCHANGED] * n, dedup)
    assert dedup.calls == 1


def test_a_failed_save_forgets_its_plans() -> None:
    """After "does not hold", every rank drops its plans: the next save plans afresh."""
    key, dedup = multi_rank.plan_key(range(4)), Counting()
    with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
        multi_rank.global_plans(key, [UNCHANGED] * 4, dedup)
    multi_rank.global_plans(key, local_plans(4), dedup)
    SavePlanner._cached_save_plan[key] = local_plans(4)[0]  # what a rank keeps
    multi_rank.forget_plans(key)
    assert key not in SavePlanner._cached_all_plans and key not in SavePlanner._cached_save_plan
    with pytest.raises(fc.errors.CheckpointError, match="does not hold"):
        multi_rank.global_plans(key, [UNCHANGED] * 4, dedup)
