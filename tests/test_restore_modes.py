"""The manager restores the way fc.restore does: a new state from like=, in place with out=."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc


def model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Linear(16, 16)


def save_steps(root: Path) -> dict[int, torch.Tensor]:
    saved = {}
    with fc.CheckpointManager(root, save=fc.policy.always()) as mgr:
        for step in (1, 2):
            m = model(step)
            saved[step] = m.weight.detach().clone()
            mgr.maybe_save(fc.capture(model=m, rng=False), step=step)
    return saved


def test_restore_latest_falls_back_without_touching_the_live_model(tmp_path: Path) -> None:
    saved = save_steps(tmp_path)
    shard = tmp_path / "step_000000002" / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[-100] ^= 0xFF  # step 2's tensor data is damaged
    shard.write_bytes(bytes(raw))
    live = model(99)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with fc.CheckpointManager(tmp_path) as mgr, pytest.warns(fc.errors.CheckpointWarning):
        restored = mgr.restore_latest(like=fc.capture(model=live, rng=False))
    assert restored is not None and mgr.restored_step == 1
    for k, v in live.state_dict().items():  # neither step 2 (damaged) nor step 1 wrote into it
        assert torch.equal(v, before[k]), k
    assert torch.equal(restored["model", "weight"], saved[1])
    fc.apply(restored, model=live, rng=False)
    assert torch.equal(live.weight, saved[1])


def test_manager_restore_out_and_no_template_spelling(tmp_path: Path) -> None:
    saved = save_steps(tmp_path)
    live = model(99)
    with fc.CheckpointManager(tmp_path) as mgr:
        state = mgr.restore(1, out=fc.capture(model=live, rng=False))
        assert torch.equal(live.weight, saved[1])  # in place, by name
        assert state["model", "weight"].data_ptr() == live.weight.data_ptr()
        with pytest.raises(TypeError, match="template"):  # the old spelling is gone
            mgr.restore_latest(template=fc.capture(model=model(98), rng=False))
        old = mgr.restore_latest(like=fc.capture(model=model(98), rng=False))
        assert old is not None and torch.equal(old["model", "weight"], saved[2])


def test_like_and_out_together_is_the_callers_error_not_damage(tmp_path: Path) -> None:
    save_steps(tmp_path)
    like = fc.capture(model=model(99), rng=False)
    with fc.CheckpointManager(tmp_path) as mgr:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no checkpoint is reported unreadable
            with pytest.raises(fc.CheckpointError, match="not both"):
                mgr.restore_latest(like=like, out=like)
        assert mgr.steps() == [1, 2]  # nothing was moved aside


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        ({"device": "bogus"}, "device='bogus'"),
        ({"device": "cpu:x"}, "device='cpu:x'"),
        ({"partial": "no"}, "partial='no'"),
        ({"cast": "no"}, "cast='no'"),
        ({"reshard": 3}, "reshard=3"),
        *([] if torch.cuda.is_available() else [({"device": "cuda"}, "device='cuda'")]),
    ],
)
def test_a_bad_restore_argument_is_named(
    tmp_path: Path, arguments: dict[str, Any], named: str
) -> None:
    """Not torch's own error naming no argument, nor a string flag taken for True."""
    fc.save(tmp_path / "ck", {"w": torch.ones(3), "b": torch.ones(2)})
    like = {"w": torch.empty(3, dtype=torch.float64, device="meta")}  # lands on device=
    with pytest.raises((TypeError, ValueError), match=re.escape(f"fc.restore({named})")):
        fc.restore(tmp_path / "ck", like, **{"partial": True, "cast": True, **arguments})
