"""Rolling back on degradation: ``fc.policy.on_degrade`` and ``CheckpointManager(rollback=)``.

A toy loop whose reward collapses on purpose: the rule fires on the right event,
the manager hands back the chosen checkpoint's state bit for bit, the newer
checkpoints are kept aside as a branch that ``fckpt ls`` shows, the run's
metadata records why, and the rule's state continues across a restart.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.manager.rollback_rule import SaveResult, choose_target
from functional_ckpt._src.policy.base import Event, run_policy
from functional_ckpt._src.policy.config import policy_from_config
from functional_ckpt._src.policy.degrade import on_degrade
from functional_ckpt._src.root.listing import StepInfo


def events(values: list[float | None]) -> list[Event]:
    return [Event(i, metrics=None if v is None else {"reward": v}) for i, v in enumerate(values)]


def test_on_degrade_needs_patience_degraded_evaluations_in_a_row() -> None:
    rule = on_degrade("reward", mode="max", drop=0.2, patience=3)
    # Driven by hand, update's flag is whether a checkpoint was saved: here, always.
    state = rule.init()
    votes = []
    for e in events([10.0, 12.0, 9.0, 9.0, 11.0, 9.0, None, 9.0, 9.0, 5.0]):
        votes.append(rule.decide(state, e))
        state = rule.update(state, e, True)
    # best is 12; 9 < 12 - 2.4 is degraded; 11 resets; the missing value changes nothing
    assert votes == [False] * 8 + [True, True]
    assert state == {"best": 12.0, "bad": 4}


def test_best_is_the_best_value_saved_and_nan_is_degraded() -> None:
    rule = on_degrade("loss", drop=0.5, patience=1)  # mode="min": higher is worse
    state = rule.init()
    state = rule.update(state, Event(0, metrics={"loss": 1.0}), True)
    state = rule.update(state, Event(1, metrics={"loss": 0.1}), False)  # not saved: not best
    assert state == {"best": 1.0, "bad": 0}
    assert not rule.decide(state, Event(2, metrics={"loss": 1.5}))
    assert rule.decide(state, Event(2, metrics={"loss": 1.6}))
    assert rule.decide(state, Event(2, metrics={"loss": math.nan}))
    assert rule.decide(rule.init(), Event(0, metrics={"loss": math.nan}))  # diverged at once


def test_spec_repr_and_composition() -> None:
    rule = on_degrade("reward", mode="max", drop=0.25, patience=2, to="last_good")
    assert repr(rule) == "on_degrade('reward', mode='max', drop=0.25, patience=2, to='last_good')"
    assert repr(policy_from_config(rule.spec)) == repr(rule)
    both = rule & ~fc.at_steps([3])  # never at step 3
    state, votes = both.init(), []
    for e in events([10.0, 1.0, 1.0, 1.0]):
        votes.append(both.decide(state, e))
        state = both.update(state, e, True)  # a checkpoint was saved on every event
    assert votes == [False, False, True, False]
    # Voting alone (run_policy), it never saves, so it never has a best to fall from.
    assert run_policy(rule, events([10.0, 1.0, 1.0, 1.0])) == [False] * 4
    with pytest.raises(ValueError, match=r"on_degrade\(mode='up'\)"):
        on_degrade("reward", mode="up")
    with pytest.raises(ValueError, match=r"on_degrade\(drop=-0.1\)"):
        on_degrade("reward", drop=-0.1)
    with pytest.raises(ValueError, match=r"on_degrade\(patience=0\)"):
        on_degrade("reward", patience=0)
    with pytest.raises(ValueError, match=r"on_degrade\(to='oldest'\)"):
        on_degrade("reward", to="oldest")


def test_targets_best_and_last_good() -> None:
    infos = [
        StepInfo(s, Path(f"s{s}"), 0.0, {"reward": r})
        for s, r in [(1, 5.0), (2, 10.0), (3, 9.0), (4, 7.0), (5, 1.0)]
    ]
    best = on_degrade("reward", mode="max", drop=0.2)
    assert choose_target(best, infos) == 2
    last_good = on_degrade("reward", mode="max", drop=0.2, to="last_good")
    assert choose_target(last_good, infos) == 3  # 9 >= 8; 7 is degraded
    assert choose_target(best, [StepInfo(1, Path("s1"), 0.0, {})]) is None


def small(w: torch.Tensor, step: int) -> dict[str, Any]:
    return {"w": w, "rng": torch.get_rng_state(), "step": step}


def collapsing_run(root: Path, *, stop: int = 40, collapse: int = 23) -> dict[str, Any]:
    """Reward rises by 1 per step, then collapses to 0 at ``collapse`` until a rollback."""
    rule = fc.policy.on_degrade("reward", mode="max", drop=0.2, patience=3)
    saved: dict[int, torch.Tensor] = {}
    out: dict[str, Any] = {"fired": [], "results": []}
    torch.manual_seed(0)
    with fc.CheckpointManager(root, save=fc.every_steps(5), rollback=rule) as mgr:
        w, step, lr = torch.zeros(64, dtype=torch.float64), 0, 1.0
        while step < stop:
            step += 1
            w = w + lr * torch.randn(64, dtype=torch.float64)  # the "training step"
            reward = 0.0 if (step >= collapse and lr == 1.0) else float(step)
            if step % 5 == 0:
                saved[step] = w.clone()
            result = mgr.maybe_save(small(w, step), step=step, metrics={"reward": reward})
            out["results"].append(result)
            if result.rollback is not None:
                out["fired"].append(result.rollback)
                w = result.rollback.state["w"]
                step = result.rollback.state["step"]
                torch.set_rng_state(result.rollback.state["rng"])
                lr = 0.5  # the loop decides what to change on its branch
        out["saved"], out["steps"], out["branches"] = saved, mgr.steps(), mgr.branches()
        out["metadata"] = mgr.info(mgr.latest_step()).metadata
    return out


def test_a_collapsing_metric_rolls_back_to_the_best_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    run = collapsing_run(root)
    # Collapse at 23: degraded evaluations 23, 24, 25 -> the rule fires on step 25,
    # whose checkpoint (saved first) goes to the branch with nothing else newer than 20.
    (rb,) = run["fired"]
    assert (rb.step, rb.to_step) == (25, 20)
    assert [bool(r) for r in run["results"][:25]] == [s % 5 == 0 for s in range(1, 26)]
    assert run["results"][24].saved and run["results"][24].rollback is rb
    assert torch.equal(rb.state["w"], run["saved"][20])
    assert rb.state["w"].view(torch.int64).tolist() == run["saved"][20].view(torch.int64).tolist()
    assert rb.state["step"] == 20
    assert run["branches"] == {rb.branch: [25]}
    assert run["steps"] == [5, 10, 15, 20, 25, 30, 35, 40]  # the trunk went on from 20
    (record,) = run["metadata"]["rollbacks"]
    assert record["to_step"] == 20 and record["newer_steps"] == [25]
    assert record["branch"] == rb.branch
    assert record["reason"] == {
        "rule": "on_degrade('reward', mode='max', drop=0.2, patience=3)",
        "at_step": 25,
        "metrics": {"reward": 0.0},
    }
    assert run["metadata"]["manager"]["rollback"]["state"] == {"best": 40.0, "bad": 0}
    # The branch's checkpoint is the collapsed state, intact.
    kept = fc.restore(root / "branches" / rb.branch / "step_000000025")
    assert kept["step"] == 25
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "branches" in out and f"branches/{rb.branch}" in out
    assert cli.main(["ls", str(root), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {"kind": "branch", "name": f"branches/{rb.branch}", "steps": [25]}.items() <= rows[
        -1
    ].items()


def test_the_rules_state_survives_a_restart(tmp_path: Path) -> None:
    rule = fc.policy.on_degrade("reward", mode="max", drop=0.2, patience=3)
    state = {"w": torch.ones(2)}
    with fc.CheckpointManager(tmp_path, rollback=rule) as mgr:
        for step, reward in [(1, 10.0), (2, 10.0), (3, 1.0), (4, 1.0)]:  # two degraded
            assert not mgr.maybe_save(state, step=step, metrics={"reward": reward}).rollback
        assert mgr.info(4).metadata["manager"]["rollback"]["state"] == {"best": 10.0, "bad": 2}
    with fc.CheckpointManager(tmp_path, rollback=rule) as mgr:
        assert mgr.restore_latest() is not None
        result = mgr.maybe_save(state, step=5, metrics={"reward": 1.0})  # the third
        assert result.rollback is not None and result.rollback.to_step == 2  # ties: newer
        assert mgr.branches()[result.rollback.branch] == [3, 4, 5]


def test_nothing_kept_to_go_back_to_warns_and_goes_on(tmp_path: Path) -> None:
    rule = fc.policy.on_degrade("reward", mode="max", patience=1)
    with fc.CheckpointManager(tmp_path, save=fc.policy.never(), rollback=rule) as mgr:
        mgr.maybe_save({"w": torch.ones(1)}, step=1, metrics={"reward": 1.0})
        with pytest.warns(fc.errors.CheckpointWarning, match="nothing to roll back to"):
            result = mgr.maybe_save({"w": torch.ones(1)}, step=2, metrics={"reward": math.nan})
        assert result.rollback is None and not result


def test_save_result_is_the_bool_it_was(tmp_path: Path) -> None:
    with fc.CheckpointManager(tmp_path, save=fc.every_steps(2)) as mgr:
        results = [mgr.maybe_save({"w": torch.ones(1)}, step=s) for s in range(1, 5)]
    assert results == [False, True, False, True] and sum(results) == 2
    assert json.dumps(results) == "[0, 1, 0, 1]" and repr(results[1]) == "True"
    assert isinstance(results[0], SaveResult) and results[0].rollback is None


def test_a_rule_without_on_degrade_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"CheckpointManager\(rollback=every_steps\(3\)\)"):
        fc.CheckpointManager(tmp_path, rollback=fc.every_steps(3))


def test_a_rollback_to_the_newest_checkpoint_moves_nothing_and_is_recorded(tmp_path: Path) -> None:
    rule = fc.policy.on_degrade("reward", mode="max", patience=1)
    with fc.CheckpointManager(tmp_path, save=fc.at_steps([1, 3]), rollback=rule) as mgr:
        assert mgr.maybe_save({"w": torch.ones(1)}, step=1, metrics={"reward": 10.0})
        result = mgr.maybe_save({"w": torch.zeros(1)}, step=2, metrics={"reward": 1.0})
        assert not result and result.rollback is not None
        assert (result.rollback.to_step, result.rollback.branch) == (1, None)
        assert torch.equal(result.rollback.state["w"], torch.ones(1)) and mgr.branches() == {}
        mgr.maybe_save(result.rollback.state, step=3, metrics={"reward": 10.0})
        (record,) = mgr.info(3).metadata["rollbacks"]
        assert record["newer_steps"] == [] and record["reason"]["at_step"] == 2
