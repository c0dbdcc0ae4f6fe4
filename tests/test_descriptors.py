"""What a rank holds for checkpointing: the root's lock, and per gloo group a few
descriptors and a socket per peer (per peer its collectives reach where the user sets
``TORCH_GLOO_LAZY_INIT=1``, as descriptors_job.py does). A manager's loop (its decisions,
synchronous saves and restores) uses one group; a remote tier's uploads, on their own
thread, a second."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.test_dist import REPO, launch, wait_all

JOB = Path(__file__).with_name("descriptors_job.py")
#: A gloo group's own descriptors besides its listening socket (an epoll, a pipe's two ends).
GROUP = 3


@pytest.mark.parametrize("lazy", [True, False], ids=["pairs-on-demand", "whole-mesh"])
def test_a_rank_holds_a_socket_per_peer_its_collectives_reach(tmp_path: Path, lazy: bool) -> None:
    """8 ranks open a manager with a remote tier, save and restore: each holds the sockets
    benchmarks/scale.py predicts from gloo's algorithms (a ring, a tree and a star on the
    coordinator for the group that saves, a ring for the uploads), not one per rank; and
    each rank's soft descriptor limit, lowered below what its groups need, is raised."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import scale

    world, groups, out = 8, 2, tmp_path / "held"
    url = (tmp_path / "bucket").as_uri()
    env = {"TORCH_GLOO_LAZY_INIT": "1" if lazy else "0"}
    for rc, _, err in wait_all(
        launch(world, str(tmp_path / "root"), str(out), url, job=JOB, env=env)
    ):
        assert rc == 0, err[-3000:]
    for rank in range(world):
        held = json.loads(Path(f"{out}.{rank}.json").read_text())
        files = {k: n for k, n in held.items() if k not in ("socket", "pipe", "anon_inode")}
        assert sum(files.values()) <= groups, (rank, held)  # the lock, the tier's status
        assert held["pipe"] + held["anon_inode"] <= groups * GROUP, (rank, held)
        if not lazy:  # gloo's default: a socket per peer of each group, as it is made,
            assert held["socket"] == groups * world, (rank, held)  # and a listening one
            continue
        assert held["socket"] == scale.manager_sockets(rank, world), (rank, held)
        assert rank == 0 or held["socket"] < groups * (world - 1), (rank, held)
