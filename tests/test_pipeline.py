"""The save pipeline: one flatten, staging before the backend, one topology answer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.distributed.topology import Topology, topology
from functional_ckpt._src.format.manifest import Chunk, TensorEntry
from functional_ckpt._src.restore.read import vetted_view as view
from functional_ckpt._src.save import api as save
from functional_ckpt._src.save import plan
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.save.job import Hooks, SaveJob
from functional_ckpt._src.save.options import SaveOptions


def test_topology_without_a_process_group() -> None:
    topo = topology()
    assert topo == Topology(0, 1, False)
    assert not topo.distributed and topo.coordinator


@pytest.mark.parametrize("mode", ["save", "copy", "write", "none"])
def test_every_save_flattens_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    calls = []
    original = plan.plan_save

    def counted(*args: Any, **kwargs: Any) -> plan.Plan:
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(plan, "plan_save", counted)
    w = torch.arange(6.0)
    state = {"w": w, "tied": w, "step": 3}
    if mode == "save":
        fc.save(tmp_path / "ck", state)
    else:
        fc.save_async(tmp_path / "ck", state, staging=mode).result()  # type: ignore[arg-type]
    assert len(calls) == 1
    back = fc.restore(tmp_path / "ck")
    assert torch.equal(back["tied"], w) and back["step"] == 3


class Recording:
    """A backend that records what reaches it, then writes locally."""

    def __init__(self) -> None:
        self.seen: list[torch.Tensor] = []
        self.write_job = save.write_job

    def write(
        self,
        job: SaveJob,
        tensors: Sequence[torch.Tensor],
        hooks: Hooks,
    ) -> CheckpointInfo:
        self.seen = list(tensors)
        return self.write_job(job, tensors, hooks)


def test_the_backend_gets_staged_copies_and_the_plan_stays_a_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rec = Recording()
    monkeypatch.setattr(save, "write_job", rec.write)
    w = torch.arange(4.0)
    stager = fc.checkpoint.Stager()
    pending = fc.save_async(tmp_path / "ck", {"w": w}, stager=stager)
    info = pending.result()
    assert info.num_tensors == 1
    (got,) = rec.seen
    assert torch.equal(got, w) and got.data_ptr() != w.data_ptr()  # a staged copy
    assert got.data_ptr() == stager._buffers[0].data_ptr()
    job = save.plan_job(tmp_path / "other", {"w": w}, SaveOptions(), snapshot=False)
    assert job.prepared is not None and not job.distributed and job.error is None
    (target,) = job.plan.targets
    assert isinstance(target, TensorEntry) and target.chunks == ()
    save.write_job(job, [w], Hooks())
    assert job.plan.targets == (target,) and target.chunks == ()  # the plan is never changed
    with pytest.raises(AttributeError):  # an entry is immutable
        target.chunks = ()  # type: ignore[misc]
    (chunk,) = view(tmp_path / "other").tensors[("w",)].chunks  # what the write reported
    assert isinstance(chunk, Chunk) and chunk.file == "__0_0.distcp" and chunk.nbytes == 16


def test_a_single_process_raises_planning_errors_at_once(tmp_path: Path) -> None:
    fc.save(tmp_path / "ck", {"x": 1})
    with pytest.raises(fc.CheckpointError, match="already exists"):
        save.plan_job(tmp_path / "ck", {"x": 1}, SaveOptions(), snapshot=False)


def test_metadata_of_a_repeated_layout_is_reused_only_while_equal(tmp_path: Path) -> None:
    import pickle

    from functional_ckpt._src import codec
    from functional_ckpt._src.format import dcp_metadata, naming
    from functional_ckpt._src.format.view import parse_checkpoint

    fc.save(tmp_path / "a", {"w": torch.zeros(3), "b": torch.ones(2, 2)})
    fc.save(tmp_path / "b", {"w": torch.ones(3), "b": torch.zeros(2, 2)})  # same layout
    fc.save(tmp_path / "c", {"w": torch.zeros(4), "b": torch.ones(2, 2)})  # another one
    derived = []
    for name in "abc":
        raw = (tmp_path / name / naming.DCP_METADATA).read_bytes()
        manifest = codec.decode((tmp_path / name / naming.MANIFEST).read_bytes())
        groups = parse_checkpoint(manifest, tmp_path / name).groups()
        assert raw == dcp_metadata.derive(groups)
        # written as opcodes, not by pickle: the same objects, field for field
        assert pickle.loads(raw) == dcp_metadata.metadata_for(groups)
        derived.append(raw)
    assert derived[0] == derived[1] != derived[2]
    assert pickle.loads(derived[2]).state_dict_metadata["w"].size == torch.Size([4])
