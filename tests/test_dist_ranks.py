"""What the ranks of a save must agree on, with real processes on gloo (tests/ranks_job.py).

The arguments that shape the checkpoint (its name, the base, ``overwrite``, the
staging mode, ``per_rank``) are compared with the coordinator's in a save's first
round: a rank that differs fails every rank, naming the argument and the ranks,
and nothing is committed. A shard file missing at the commit is an error unless
its rank reported writing it into a part of its own. A rank gone before the first
round makes the others raise the project's error, never gloo's.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from tests import prefork
from tests.test_dist import launch as on_ranks
from tests.test_dist import wait_all

JOB = Path(__file__).with_name("ranks_job.py")


def run(root: Path, mode: str, *args: str) -> list[Any]:
    """Both ranks of ``mode``; what each raised (or "ok")."""
    for rc, _, err in wait_all(launch(mode, root, *args)):
        assert rc == 0, err[-3000:]
    return [json.loads((root / f"error.{r}.json").read_text()) for r in range(2)]


def launch(mode: str, root: Path, *args: str) -> list[prefork.Popen]:
    # a rank that is gone fails the other within FCKPT_TIMEOUT
    env = {"FCKPT_TIMEOUT": "60"}
    return on_ranks(2, mode, str(root), *args, env=env, job=JOB)


def assert_refused(told: list[Any], *words: str) -> None:
    """Every rank raised, and every rank's error names the argument and both ranks."""
    for r, t in enumerate(told):
        assert t != "ok", f"rank {r} saved"
        text = t["str"] + " ".join(t["notes"])
        for w in (*words, "rank 0", "rank 1"):
            assert w in text, (r, w, t)


@pytest.mark.parametrize("variant", ["save", "async"])
def test_ranks_saving_to_different_paths_are_refused(tmp_path: Path, variant: str) -> None:
    told = run(tmp_path, "two-paths", variant)
    assert_refused(told, "path", "'b'", "'c'")
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.0.json", "error.1.json"]


def test_a_base_given_on_one_rank_only_is_refused(tmp_path: Path) -> None:
    """Was: rank 1 linked the base's file and wrote no shard of its own; rank 0 took
    the missing file for one written elsewhere and committed a checkpoint that could
    not be restored."""
    told = run(tmp_path, "base-one-rank")
    assert_refused(told, "base")
    assert not (tmp_path / "b").exists()
    assert fc.verify(tmp_path / "a").ok


@pytest.mark.parametrize(
    ("mode", "word"), [("overwrite", "overwrite"), ("staging", "staging"), ("per-rank", "per_rank")]
)
def test_overwrite_staging_and_per_rank_must_agree(tmp_path: Path, mode: str, word: str) -> None:
    assert_refused(run(tmp_path, mode), word)
    if mode == "overwrite":
        assert fc.verify(tmp_path / "a").ok  # the checkpoint there is kept
    else:
        assert not (tmp_path / "a").exists()


def test_a_shard_file_missing_at_commit_is_an_error(tmp_path: Path) -> None:
    """A file no rank reported writing into a part of its own is not "elsewhere"."""
    told = run(tmp_path, "file-gone")
    for r, t in enumerate(told):
        assert t != "ok", f"rank {r} saved"
        assert "__1_0.distcp" in t["str"] + " ".join(t["notes"]), t
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("variant", ["save", "async", "restore"])
def test_a_rank_gone_before_the_first_round_is_the_projects_error(
    tmp_path: Path, variant: str
) -> None:
    """Was: gloo's raw RuntimeError from the first exchange (the temporary
    directory's name), outside the rounds that say another rank did not answer."""
    fc.save(tmp_path / "solo", {"x": torch.arange(3.0)})
    results = wait_all(launch("gone-first", tmp_path, variant))
    assert [rc for rc, _, _ in results] == [0, 0], results[0][2][-3000:]
    told = json.loads((tmp_path / "error.0.json").read_text())
    assert told != "ok" and told["type"] == "CheckpointError", told
    assert "did not answer" in told["str"], told
    assert not (tmp_path / "a").exists()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", "-p", "no:xdist"]))


def test_a_collective_returns_once_gloo_has_let_go_of_its_tensors(tmp_path: Path) -> None:
    """Was: gloo's worker thread dropped its references to a collective's tensors just
    after the collective returned; when that happened during interpreter shutdown
    (a loaded machine delays the thread), freeing the tensor's Python object there
    aborted the job at exit ("terminate called without an active exception").
    Both ranks also leave through ``dist.destroy_process_group()`` and the
    interpreter's own shutdown (``run`` checks the exit status)."""
    for told in run(tmp_path, "released"):
        assert told["rounds"] >= 600, told
        assert told["late"] == [], told
