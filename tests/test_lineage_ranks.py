"""The lineage rule (docs/tiered.md) on ranks with a root each: a refusal on one rank's
root is every rank's, and the manager goes on saving; so is a rollback's failure on one
rank (its upload, a branch name its root holds); a memory folder never undoes a rollback
made without it. Real gloo ranks (tests/lineage_ranks_job.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

import functional_ckpt as fc
from functional_ckpt._src.remote.store import Store
from tests.test_dist import launch, wait_all

JOB = Path(__file__).with_name("lineage_ranks_job.py")


def test_another_runs_step_on_one_ranks_root_is_refused_by_every_rank(tmp_path: Path) -> None:
    base, url, other = tmp_path / "job", (tmp_path / "bucket").as_uri(), tmp_path / "other"
    with fc.CheckpointManager(other) as mgr:
        mgr.maybe_save({"w": torch.full((8,), 9.0), "step": 3}, step=3)
    # a rank going on alone would see its collective unanswered after this many seconds
    done = wait_all(launch(2, str(base), url, str(other), job=JOB, env={"FCKPT_TIMEOUT": "30"}))
    assert [rc for rc, _, _ in done] == [0, 0], [err[-3000:] for _, _, err in done]
    seen = [json.loads((base / f"out.{r}.json").read_text()) for r in range(2)]
    theirs = str(base / "root1" / "step_000000003")
    # one decision, taken together: rank 1 raises its refusal, rank 0 a RankFailed naming it
    for got in (seen[0]["3"], seen[1]["3"]):
        assert theirs in got and "would replace it" in got, seen
    assert seen[1]["3"].startswith("CheckpointExists: "), seen
    assert (
        seen[0]["3"].startswith("RankFailed: ")
        and "rank 1 failed: CheckpointExists" in seen[0]["3"]
    )
    assert seen[0]["4"] == seen[1]["4"] == "saved", seen
    assert seen[0]["finished"] == seen[1]["finished"] == "[]", seen  # rank 1's rollback too
    for got in (seen[0]["rollback"], seen[1]["rollback"]):
        assert theirs in got and "rollback(3)" in got, seen
    assert seen[1]["rollback"].startswith("CheckpointError: "), seen
    assert "rank 1 failed: CheckpointError" in seen[0]["rollback"], seen
    # rank 1's upload of step 1 fails: its own error, a RankFailed naming it on rank 0;
    # nothing moved, and no upload failure left to report (the rollback raised it)
    assert seen[1]["upload"].startswith("CheckpointError: rollback(1): "), seen
    assert "upload of step 1 failed (OSError: the store refused step 1)" in seen[1]["upload"]
    assert seen[0]["upload"].startswith("RankFailed: "), seen
    assert "rank 1 failed: CheckpointError: rollback(1): " in seen[0]["upload"], seen
    assert seen[0]["upload_left"] == seen[1]["upload_left"] == "2 [2, 4] {}", seen
    # a branch name rank 1's root alone holds: refused there, RankFailed on rank 0
    assert seen[1]["taken"].startswith("CheckpointExists: "), seen
    assert str(base / "root1" / "branches" / "x") in seen[1]["taken"], seen
    assert seen[0]["taken"].startswith("RankFailed: "), seen
    assert "rank 1 failed: CheckpointExists" in seen[0]["taken"], seen
    assert seen[0]["taken_left"] == "2 [1, 2, 4] ([], [])", seen  # step 1 uploaded, no move
    assert seen[1]["taken_left"] == "2 [1, 2, 4] (['x'], [])", seen
    # a rollback every rank reads as a resume does (rank 1's root has a part of step 1)
    assert seen[0]["back"] == seen[1]["back"] == "rolled back to 1", seen
    # each root's newer steps (rank 1's: its parts) went to the branch: the trunk saves 2 again
    moved = ["step_000000002", "step_000000004"]
    (name,) = branch0 = json.loads(seen[0]["branch"])
    assert branch0 == {name: moved} and json.loads(seen[1]["branch"]) == {name: moved, "x": []}
    assert seen[0]["trunk"] == str(["step_000000001"]), seen
    assert seen[1]["trunk"] == str(["step_000000001", "step_000000003"]), seen  # 3: theirs
    assert seen[0]["again"] == seen[1]["again"] == "saved", seen
    # a newer step in rank 1's root alone is a save cut short: deleted, never an unnamed branch
    assert seen[0]["cut"] == seen[1]["cut"] == "rolled back", seen
    assert seen[0]["reopened"] == str(["step_000000001", "step_000000002"]), seen
    assert seen[1]["reopened"] == str(["step_000000001", "step_000000002", "step_000000003"])
    assert "rollback record" in seen[1]["damaged"], seen  # that rank's error, the others told
    assert seen[0]["damaged"].startswith("RankFailed: "), seen
    assert Store(url).listing().keys() == {1, 2}  # 2 and 4 set aside on the remote too, 2 anew
    assert Store(f"{url}/branches/{name}").listing().keys() == {2, 4}
    assert float(fc.restore(theirs)["w"][0]) == 9.0, "the other run's checkpoint was written over"
    # RAM's steps 4 and 5, which a rollback to 2 made without the memory tier left: dropped
    assert seen[0]["ram"] == seen[1]["ram"] == "2 []", seen
