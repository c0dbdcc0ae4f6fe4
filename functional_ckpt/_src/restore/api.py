"""``fc.restore``: open and vet once, match the template, read, unflatten; the kinds of
checkpoint and template differ only in how they are opened (:mod:`.backends`)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, overload

import torch

from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.log import done, logger, phase
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.restore.backends import Request, open_for_restore
from functional_ckpt._src.restore.read import rebuild
from functional_ckpt._src.restore.template import Reshard, Template
from functional_ckpt._src.state.gc_pause import gc_paused
from functional_ckpt._src.state.tree import State, is_tensordict
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    from tensordict import TensorDict, TensorDictBase

_LOG = logger("restore")


def check_like_or_out(like: State | None, out: State | None, what: str) -> None:
    """At most one of ``like`` (a new state is returned) and ``out`` (in place)."""
    if like is not None and out is not None:
        raise CheckpointError(
            f"{what}: pass like= (a new state is returned) or out= (restore in place), not both"
        )


@overload
def restore(
    path: PathLike,
    like: TensorDictBase | None = None,
    *,
    out: TensorDictBase | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict: ...
@overload
def restore(
    path: PathLike,
    like: dict[str, Any] | None = None,
    *,
    out: dict[str, Any] | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> dict[str, Any]: ...
@overload
def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict: ...
def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    reshard: Reshard | None = None,
) -> Any:
    """Read a checkpoint back as a new state: a locked TensorDict, or plain containers
    for a template of plain containers (such a restore never loads tensordict).

    A pure function of the files and ``like``: ``like`` only says which keys to read
    and each tensor's dtype and device (``meta`` leaves land on ``device``, default
    CPU; DTensor leaves get fresh shards on their mesh and placements). Nothing
    ``like`` refers to is ever written, also when the restore fails, so a state
    captured from a live model stays the model's until ``fc.apply``. Without
    ``like`` the whole tree is rebuilt from the manifest, as a TensorDict.

    ``out=state`` is the explicit in-place mode for memory-tight restores: bytes go
    straight into ``out``'s tensors and the result holds them; if it fails, their
    contents are unspecified.
    """
    check_like_or_out(like, out, "fc.restore")
    req = Request(
        partial=partial,
        cast=cast,
        reshard=reshard,
        inplace=out is not None,
        device=torch.device("cpu" if device is None else device),
    )
    return _restore(path, like if out is None else out, req)


def restore_for_viewing(path: PathLike) -> Any:
    """The whole state, values of unregistered classes kept as ``Unregistered``
    placeholders: for readers that only show or compare, and need not the writer's code."""
    return _restore(path, None, Request(placeholders=True))


def _restore(path: PathLike, chosen: State | None, req: Request) -> Any:
    with gc_paused():  # the manifest's parse and the template's walk make many objects
        template = None if chosen is None else Template.of(chosen)
        src, t0 = Path(path), time.perf_counter()
        with phase(_LOG, "open", src):
            opened = open_for_restore(src, template)
        try:
            with phase(_LOG, "match", src):
                match = opened.match(template, req)
            with phase(_LOG, "read", src):
                leaves = opened.read(match, req)
            plain = chosen is not None and not is_tensordict(chosen)
            result = rebuild(leaves, match.root, src, plain=plain)
        finally:
            opened.close()
        if _LOG.isEnabledFor(logging.INFO):
            nbytes = sum(v.nbytes for _, kind, v in leaves if kind == "tensor")
            seconds, step = time.perf_counter() - t0, parse_step(src.name)
            done(_LOG, "restored", src, seconds=seconds, nbytes=nbytes, step=step, to="from")
        # Freed while collection is paused, the manifest's and the template's many
        # small objects are never walked by the collection that re-enabling triggers.
        del opened, match, leaves, template
    return result
