"""One restore pipeline: the manifest is parsed once per restore, whatever the backend."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import functional_ckpt as fc
from functional_ckpt._src.distributed.topology import Topology
from functional_ckpt._src.format import entries, manifest, view
from functional_ckpt._src.restore import api as restore_pipeline


def saved_state() -> dict[str, Any]:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)},
        "rng": {"state": torch.arange(4, dtype=torch.uint8)},  # per-rank
        "loader": {"pos": 7},  # per-rank
        "step": 3,
    }


@pytest.fixture
def validations(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """How often each tensor entry, and the file table, were validated."""
    seen: Counter[str] = Counter()
    tensor_entry, files = entries.tensor_entry, view._files

    def count_entry(path: Any, e: Any, out: Any, where: str) -> Any:
        seen[".".join(path)] += 1
        return tensor_entry(path, e, out, where)

    def count_files(*args: Any) -> Any:
        seen["<file table>"] += 1
        return files(*args)

    monkeypatch.setattr(entries, "tensor_entry", count_entry)
    monkeypatch.setattr(view, "_files", count_files)
    yield seen


def test_a_local_restore_parses_the_manifest_once(
    tmp_path: Path, validations: Counter[str]
) -> None:
    fc.save(tmp_path / "ck", saved_state())
    validations.clear()
    back = fc.restore(tmp_path / "ck")
    assert torch.equal(back["model", "w"], torch.arange(6.0).reshape(2, 3))
    assert back["loader", "pos"] == 7
    assert validations == {"<file table>": 1, "model.w": 1, "model.b": 1, "rng.state": 1}


def test_a_resharding_restore_parses_the_manifest_once(
    tmp_path: Path, validations: Counter[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fc.save(tmp_path / "ck", saved_state())  # saved by one rank
    validations.clear()
    # Restored as rank 1 of 2: the per-rank state is mapped by ``reshard``.
    monkeypatch.setattr(restore_pipeline, "topology", lambda: Topology(1, 2, False))
    calls: list[tuple[int, int, int]] = []

    def reshard(saved: list[TensorDict], rank: int, world: int) -> dict[str, Any]:
        calls.append((len(saved), rank, world))
        return {"rng": {"state": saved[0]["rng", "state"] + 1}, "loader": {"pos": 100 + rank}}

    back = fc.restore(tmp_path / "ck", reshard=reshard)
    assert calls == [(1, 1, 2)]
    assert back["loader", "pos"] == 101 and back["step"] == 3
    assert torch.equal(back["rng", "state"], torch.arange(1, 5, dtype=torch.uint8))
    assert torch.equal(back["model", "b"], torch.ones(3))
    assert validations == {"<file table>": 1, "model.w": 1, "model.b": 1, "rng.state": 1}


def test_verify_parses_the_manifest_once(tmp_path: Path, validations: Counter[str]) -> None:
    fc.save(tmp_path / "ck", saved_state())
    validations.clear()
    assert fc.verify(tmp_path / "ck").ok
    assert validations == {"<file table>": 1, "model.w": 1, "model.b": 1, "rng.state": 1}


def test_planned_entries_travel_through_the_one_parser() -> None:
    from functional_ckpt._src.save.plan import plan_save
    from functional_ckpt.errors import CorruptCheckpoint

    state = TensorDict(
        {"rng": {"a": torch.ones(2, 3), "env": TensorDict({"x": torch.zeros(4)}, [4])}},
        batch_size=[],
    )
    state["rng", "tied"] = state["rng", "a"]
    local = plan_save(state, rank=1).local
    back = view.parse_planned([e.to_plain() for e in local], "rank 1's entries")
    assert [e.to_plain() for e in back] == [e.to_plain() for e in local]
    tied = {e.path: e for e in back}[("rng", "tied")]
    assert isinstance(tied, manifest.TensorEntry) and tied.alias == ("rng", "a")
    a = {e.path: e for e in back}[("rng", "a")]
    assert isinstance(a, manifest.TensorEntry) and tied.chunks is a.chunks  # filled once
    plain = [e.to_plain() for e in local]
    plain[1]["chunks"] = [{"offsets": [0, 0], "sizes": [2, 3]}]
    with pytest.raises(CorruptCheckpoint, match="rank 1's entries entry 1: a planned tensor"):
        view.parse_planned(plain, "rank 1's entries")
