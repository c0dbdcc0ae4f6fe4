"""``out=`` tensors that several saved elements would land on are refused by key, before a
byte is written: an expanded tensor, and two leaves that share memory without being one
tensor (a tied pair, the same tensor twice, is fine)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import functional_ckpt as fc


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "ck"
    fc.save(path, {"model": {"weight": torch.arange(6.0).reshape(2, 3), "bias": torch.ones(3)}})
    return path


def test_an_expanded_out_tensor_is_refused_naming_its_key(saved: Path) -> None:
    row = torch.zeros(1, 3)
    into = {"model": {"weight": row.expand(2, 3), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*overlaps itself"):
        fc.restore(saved, out=into)
    assert not row.any() and not into["model"]["bias"].any()  # nothing was written


@pytest.mark.parametrize(
    "leaf",
    [
        lambda: torch.zeros(2, 3).to_sparse(),
        lambda: torch.nested.nested_tensor([torch.zeros(2, 3)]),
    ],
    ids=["sparse", "nested"],
)
def test_an_out_tensor_with_no_dense_buffer_is_refused_naming_its_key(
    saved: Path, leaf: Callable[[], torch.Tensor]
) -> None:
    """A sparse or nested leaf has no buffer of its shape: torch fails on it naming no key."""
    into = {"model": {"weight": leaf(), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*pass a dense one"):
        fc.restore(saved, out=into)
    assert not into["model"]["bias"].any()


@pytest.mark.parametrize("strides", [(1, 1), (2, 2), (2, 1)])
def test_an_out_tensor_overlapping_itself_without_a_zero_stride_is_refused(
    saved: Path, strides: tuple[int, int]
) -> None:
    backing = torch.zeros(16)
    into = {"model": {"weight": backing.as_strided((2, 3), strides), "bias": torch.zeros(3)}}
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'model', 'weight'.*overlaps itself"):
        fc.restore(saved, out=into)
    assert not backing.any() and not into["model"]["bias"].any()


def test_out_tensors_strided_without_overlap_restore(saved: Path) -> None:
    backing = torch.zeros(3, 2)  # the weight lands transposed, the bias in every other slot
    spaced = torch.zeros(6)
    fc.restore(saved, out={"model": {"weight": backing.t(), "bias": spaced[::2]}})
    assert torch.equal(backing.t(), torch.arange(6.0).reshape(2, 3))
    assert torch.equal(spaced, torch.tensor([1.0, 0, 1, 0, 1, 0]))


def test_out_leaves_sharing_memory_are_refused_naming_both(saved: Path) -> None:
    flat = torch.zeros(8)
    into = {"model": {"weight": flat[:6].view(2, 3), "bias": flat[4:7]}}
    with pytest.raises(
        fc.errors.TemplateMismatch,
        match=r"'model', '(bias|weight)'.* shares memory with .*'model', '(weight|bias)'",
    ):
        fc.restore(saved, out=into)
    assert not flat.any()


def test_out_leaves_side_by_side_in_one_buffer_restore(saved: Path) -> None:
    flat = torch.zeros(9)
    into = {"model": {"weight": flat[:6].view(2, 3), "bias": flat[6:]}}
    fc.restore(saved, out=into)
    assert torch.equal(flat, torch.tensor([0.0, 1, 2, 3, 4, 5, 1, 1, 1]))


def test_a_tied_pair_of_out_leaves_restores(tmp_path: Path) -> None:
    w = torch.arange(3.0)
    fc.save(tmp_path / "tied", {"a": w, "b": w})
    t = torch.zeros(3)
    back = fc.restore(tmp_path / "tied", out={"a": t, "b": t})
    assert back["a"] is t and back["b"] is t and torch.equal(t, w)


def test_a_stock_dcp_checkpoint_refuses_an_expanded_out_tensor(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"weight": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=tmp_path / "stock")
    row = torch.zeros(1, 3)
    with pytest.raises(fc.errors.TemplateMismatch, match=r"'weight'.*overlaps itself"):
        fc.restore(tmp_path / "stock", out={"weight": row.expand(2, 3)})
    assert not row.any()
