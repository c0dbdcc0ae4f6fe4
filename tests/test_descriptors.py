"""What a rank holds for checkpointing: the root's lock, and per gloo group a few
descriptors and a socket per peer. A manager's loop (its decisions, synchronous saves and
restores) uses one group; a remote tier's uploads, on their own thread, a second."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_dist import launch, wait_all

JOB = Path(__file__).with_name("descriptors_job.py")
#: A gloo group's own descriptors (a listening socket, an epoll, a pipe's two ends).
GROUP = 4


@pytest.mark.parametrize("remote", [False, True])
def test_a_rank_holds_a_socket_per_peer_per_group_it_needs(tmp_path: Path, remote: bool) -> None:
    world, out = 3, tmp_path / "held"
    url = [(tmp_path / "bucket").as_uri()] if remote else []
    for rc, _, err in wait_all(launch(world, str(tmp_path / "root"), str(out), *url, job=JOB)):
        assert rc == 0, err[-3000:]
    groups = 2 if remote else 1
    for rank in range(world):
        held = json.loads(Path(f"{out}.{rank}.json").read_text())
        files = {k: n for k, n in held.items() if k not in ("socket", "pipe", "anon_inode")}
        assert set(files) <= {".lock"} or remote, (rank, held)  # the coordinator's lock
        assert sum(files.values()) <= groups, (rank, held)  # and the tier's status, written
        assert sum(held.values()) - sum(files.values()) <= groups * (GROUP + world - 1), held
