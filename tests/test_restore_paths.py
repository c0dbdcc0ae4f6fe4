"""Every way a restored tensor is made gives the same answer, and the template is walked as is.

A restore decides per tensor where its bytes land: a new small host tensor read
straight from its blob (the common case, decided in one step), a large one whose
pages are prepared first, a staging tensor converted into the template's dtype or
device, a tie of another tensor. A template of plain containers is walked without
being built as a TensorDict. These tests mix all of them in one state and check
each against the saved bytes and against the slow, general answers.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import functional_ckpt as fc
from functional_ckpt._src.format.keys import NODE_KEY
from functional_ckpt._src.state.allocation import PREFAULT_BYTES
from functional_ckpt._src.state.tree import as_state, iter_leaves, leaves_of
from functional_ckpt.errors import UnsupportedValue


def _states() -> list[Any]:
    sd: OrderedDict[str, Any] = OrderedDict(w=torch.ones(3), b=torch.zeros(2))
    sd._metadata = {"": {"version": 2}}  # type: ignore[attr-defined]
    nested = TensorDict({"x": torch.ones(4, 2), "y": {"z": torch.zeros(4)}}, batch_size=[4])
    return [
        {"a": torch.ones(2), "v": 3, "s": "text", "n": None},
        {"model": sd, "empty": {}, "deep": {"a": {"b": {"c": torch.ones(1)}}}},
        {"opt": {"state": {0: {"m": torch.ones(2)}, 1: {"m": torch.zeros(2)}}, "groups": [1, 2]}},
        {"seq": [torch.ones(1), 2, (torch.zeros(1), "x")], "tup": (1, 2), "plain": [1, [2]]},
        {"td": nested, "keys": {1: "one", "x": 2}},
    ]


@pytest.mark.parametrize("i", range(len(_states())))
def test_walking_a_template_gives_the_leaves_of_its_tree(i: int) -> None:
    state = _states()[i]
    slow = list(iter_leaves(as_state(state)))
    fast = leaves_of(state)
    assert [(lf.path, lf.kind) for lf in fast] == [(lf.path, lf.kind) for lf in slow]
    for a, b in zip(fast, slow, strict=True):
        if a.kind == "tensor":
            assert a.value is b.value  # the template's own tensor, never a copy
        else:
            assert a.value == b.value


def _bad() -> list[tuple[str, Any]]:
    loop: dict[str, Any] = {"t": torch.ones(1)}
    loop["me"] = [loop, torch.ones(1)]
    deep: dict[str, Any] = {"t": torch.ones(1)}
    for _ in range(300):
        deep = {"d": deep}

    class Mine(dict):  # type: ignore[type-arg]
        pass

    return [
        ("contains itself", loop),
        ("levels deep", deep),
        ("reserved", {NODE_KEY: torch.ones(1)}),
        ("not supported", {"m": Mine(t=torch.ones(1))}),
        ("expected a TensorDict or a dict", [torch.ones(1)]),
    ]


@pytest.mark.parametrize("i", range(len(_bad())))
def test_a_bad_template_is_refused_by_the_walk_as_by_the_tree(i: int) -> None:
    what, state = _bad()[i]
    with pytest.raises(UnsupportedValue, match=what) as slow:
        as_state(state)
    with pytest.raises(UnsupportedValue, match=what) as fast:
        leaves_of(state)
    assert str(fast.value) == str(slow.value)


def _saved() -> dict[str, Any]:
    gen = torch.Generator().manual_seed(3)
    big = torch.randn(PREFAULT_BYTES // 4 + 17, generator=gen)  # pages prepared first
    shared = torch.randn(5, generator=gen)
    return {
        "small": {f"p{i}": torch.randn(8 + i, generator=gen) for i in range(40)},
        "big": big,
        "half": torch.randn(6, generator=gen).to(torch.float16),
        "grad": torch.randn(3, generator=gen).requires_grad_(True),
        "ints": torch.arange(7),
        "empty": torch.zeros(0, 4),
        "tied_a": shared,
        "tied_b": shared,
        "value": {"lr": 0.1},
    }


def _template(saved: dict[str, Any]) -> dict[str, Any]:
    like = {k: v for k, v in saved.items()}
    like["small"] = {k: torch.full_like(v, -1.0) for k, v in saved["small"].items()}
    like["big"] = torch.zeros_like(saved["big"])
    like["half"] = torch.zeros(6, dtype=torch.float32)  # cast on read
    like["grad"] = torch.zeros(3).requires_grad_(True)
    like["ints"] = torch.empty(7, dtype=torch.int64, device="meta")  # lands on CPU
    like["empty"] = torch.ones(0, 4)
    like["tied_a"] = torch.zeros(5)
    like["tied_b"] = like["tied_a"]
    return like


def test_every_landing_path_in_one_restore_returns_the_saved_bytes(tmp_path: Path) -> None:
    saved = _saved()
    fc.save(tmp_path / "c", saved)
    like = _template(saved)
    before = {k: v.clone() for k, v in like["small"].items()}
    got = fc.restore(tmp_path / "c", like, cast=True)
    for k, v in saved["small"].items():
        assert torch.equal(got["small"][k], v)
        assert like["small"][k].equal(before[k])  # the template is never written
    assert torch.equal(got["big"], saved["big"])
    assert got["half"].dtype == torch.float32
    assert torch.equal(got["half"], saved["half"].float())
    assert got["grad"].requires_grad and torch.equal(got["grad"].detach(), saved["grad"].detach())
    assert got["ints"].device.type == "cpu" and torch.equal(got["ints"], saved["ints"])
    assert got["empty"].shape == (0, 4)
    assert torch.equal(got["tied_a"], saved["tied_a"])
    assert got["tied_b"].data_ptr() == got["tied_a"].data_ptr()  # the tie is kept
    assert got["value"]["lr"] == 0.1
    assert not any(t.requires_grad for t in got["small"].values())


def test_new_small_tensors_own_their_memory(tmp_path: Path) -> None:
    saved = _saved()
    fc.save(tmp_path / "c", saved)
    got = fc.restore(tmp_path / "c", _template(saved), cast=True)
    tensors = [got["small"][k] for k in saved["small"]]
    storages = {t.untyped_storage().data_ptr() for t in tensors}
    assert len(storages) == len(tensors)  # no arena shared between tensors
    for t in tensors:
        assert t.untyped_storage().nbytes() == t.nbytes
    first = tensors[0]
    first.resize_(1000)  # resizing one tensor never touches another
    first.fill_(7.0)
    for k, t in zip(list(saved["small"])[1:], tensors[1:], strict=True):
        assert torch.equal(t, saved["small"][k])


def test_a_template_free_restore_takes_requires_grad_from_the_checkpoint(tmp_path: Path) -> None:
    saved = _saved()
    fc.save(tmp_path / "c", saved)
    got = fc.restore(tmp_path / "c")
    assert got["grad"].requires_grad
    assert not got["small"]["p0"].requires_grad
    assert torch.equal(got["half"], saved["half"])
    assert got["tied_b"].data_ptr() == got["tied_a"].data_ptr()


def test_an_in_place_restore_lands_in_the_given_tensors_on_every_path(tmp_path: Path) -> None:
    saved = _saved()
    fc.save(tmp_path / "c", saved)
    out = _template(saved)
    out["ints"] = torch.zeros(7, dtype=torch.int64)
    strided = torch.zeros(2 * 10)[::2]  # not contiguous: read through a staging tensor
    out["small"]["p2"] = strided
    got = fc.restore(tmp_path / "c", out=out, cast=True)
    for k, v in saved["small"].items():
        assert got["small"][k].data_ptr() == out["small"][k].data_ptr()
        assert torch.equal(out["small"][k], v)
    assert torch.equal(strided, saved["small"]["p2"])
    assert torch.equal(out["big"], saved["big"]) and torch.equal(out["ints"], saved["ints"])
    assert torch.equal(out["half"], saved["half"].float())


def test_views_at_one_address_are_told_apart_once_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Leaves that start at the same address are aliases only with the same identity,
    and each leaf's identity is computed at most once (never per pair of leaves)."""
    from functional_ckpt._src.save import plan as plan_mod

    calls = 0
    original = plan_mod._alias_key

    def counted(t: torch.Tensor) -> tuple[Any, ...]:
        nonlocal calls
        calls += 1
        return original(t)

    monkeypatch.setattr(plan_mod, "_alias_key", counted)
    buf = torch.arange(400, dtype=torch.float32)
    state: dict[str, Any] = {f"v{k:03d}": buf[: k + 1] for k in range(300)}
    state["same"] = buf[:7]  # the same view as v006: one tensor
    state["alone"] = torch.ones(3)
    plan = plan_mod.plan_save(state)
    assert calls <= 2 * 301, calls
    aliases = {e.path: e.alias for e in plan.entries if isinstance(e, plan_mod.TensorEntry)}
    assert aliases[("same",)] == ("v006",)
    assert all(aliases[(f"v{k:03d}",)] is None for k in range(300))
    assert len(plan.sources) == 301
    fc.save(tmp_path / "c", state)
    back = fc.restore(tmp_path / "c")
    for k, v in state.items():
        assert torch.equal(back[k], v), k


@pytest.mark.parametrize("mode", ["like", "out"])
def test_a_template_of_the_saved_tree_names_every_tensor_that_does_not_fit(
    tmp_path: Path, mode: str
) -> None:
    """The keys match, so the template is matched by its keys alone; each tensor's
    shape and dtype is still checked (on every landing path, ties included), all
    named in one error, before anything is read into ``out``."""
    saved = _saved()
    fc.save(tmp_path / "c", saved)
    bad = _template(saved)
    bad["half"] = torch.zeros(6, dtype=torch.float32)  # dtype, without cast
    bad["small"]["p3"] = torch.zeros(2)  # shape, small: read straight
    bad["big"] = torch.zeros(5)  # shape, large: pages prepared first
    bad["tied_b"] = torch.zeros(4)  # shape, a tie
    bad["ints"] = torch.zeros(7, dtype=torch.int64)
    before = {k: v.clone() for k, v in bad["small"].items()}
    kwargs: dict[str, Any] = {"out": bad} if mode == "out" else {"like": bad}
    with pytest.raises(fc.errors.TemplateMismatch) as e:
        fc.restore(tmp_path / "c", **kwargs)
    msg = str(e.value)
    assert "'half': saved float16[6], template float32[6] (dtype differs; pass cast=True" in msg
    assert "('small', 'p3'): saved float32[11], template float32[2] (shape differs)" in msg
    assert "'big'" in msg and "'tied_b'" in msg and "'tied_a'" not in msg
    for k, v in bad["small"].items():
        assert torch.equal(v, before[k]), k  # nothing was read into the template
