"""``fc.restore``: one pipeline, a read backend per kind of checkpoint.

    open and vet once (the backend) -> match the template (``like``/``out``,
    ``partial``, ``cast``, ``reshard``) -> read (into new tensors, or ``out``'s)
    -> unflatten

The project's own checkpoints, stock DCP checkpoints and restores into DTensor
templates differ only in their backend (:mod:`.backends`); which one serves
a restore is decided once, from the directory and the template.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch
from tensordict import TensorDict

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.kind import is_stock_dcp
from functional_ckpt._src.format.naming import parse_step
from functional_ckpt._src.log import done, logger, phase
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.restore.backends import (
    ManifestBackend,
    PlannerBackend,
    ReadBackend,
    Request,
    StockDcpBackend,
)
from functional_ckpt._src.restore.read import rebuild
from functional_ckpt._src.restore.template import Reshard, Template
from functional_ckpt._src.state.gc_pause import gc_paused
from functional_ckpt._src.state.tree import State
from functional_ckpt.errors import CheckpointError

_LOG = logger("restore")


def read_backend(path: Path, template: Template | None) -> ReadBackend:
    """The backend that serves a restore of ``path`` into ``template``."""
    if is_stock_dcp(path):
        return StockDcpBackend()
    topo = topology()
    if template is not None and template.has_dtensor:
        return PlannerBackend(topo)
    return ManifestBackend(topo)


def check_like_or_out(like: State | None, out: State | None, what: str) -> None:
    """At most one of ``like`` (a new state is returned) and ``out`` (in place)."""
    if like is not None and out is not None:
        raise CheckpointError(
            f"{what}: pass like= (a new state is returned) or out= (restore in place), not both"
        )


def restore(
    path: PathLike,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    allow_pickle: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict:
    """Read a checkpoint back as a new locked TensorDict.

    A pure function of the files and ``like``: ``like`` only says which keys to read
    and each tensor's dtype and device (``meta`` leaves land on ``device``, default
    CPU; DTensor leaves get fresh shards on their mesh and placements). Nothing
    ``like`` refers to is ever written, also when the restore fails, so a state
    captured from a live model stays the model's until ``fc.apply``. Without
    ``like`` the whole tree is rebuilt from the manifest.

    ``out=state`` is the explicit in-place mode for memory-tight restores: bytes go
    straight into ``out``'s tensors and the result holds them; if it fails, their
    contents are unspecified.
    """
    check_like_or_out(like, out, "fc.restore")
    return _restore(
        path,
        like,
        out=out,
        device=device,
        partial=partial,
        cast=cast,
        allow_pickle=allow_pickle,
        reshard=reshard,
    )


def restore_for_viewing(path: PathLike) -> TensorDict:
    """The whole state, values of unregistered classes kept as ``Unregistered`` placeholders.

    For readers that only show or compare (a diff, the command line): they
    must not need the code that wrote the checkpoint, and nothing they return is
    restored into a training state.
    """
    return _restore(path, None, placeholders=True)


def _restore(
    path: PathLike,
    like: State | None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    allow_pickle: bool = False,
    reshard: Reshard | None = None,
    placeholders: bool = False,
) -> TensorDict:
    with gc_paused():  # the manifest's parse and the template's walk make many objects
        chosen = out if out is not None else like
        template = None if chosen is None else Template.of(chosen)
        req = Request(
            partial=partial,
            cast=cast,
            allow_pickle=allow_pickle,
            reshard=reshard,
            inplace=out is not None,
            device=torch.device("cpu" if device is None else device),
            placeholders=placeholders,
        )
        src, t0 = Path(path), time.perf_counter()
        with phase(_LOG, "open", src):
            opened = read_backend(src, template).open(src)
        try:
            with phase(_LOG, "match", src):
                match = opened.match(template, req)
            with phase(_LOG, "read", src):
                leaves = opened.read(match, req)
            result = rebuild(leaves, match.root, src)
        finally:
            opened.close()
        if _LOG.isEnabledFor(logging.INFO):
            nbytes = sum(v.nbytes for _, kind, v in leaves if kind == "tensor")
            seconds = time.perf_counter() - t0
            done(
                _LOG,
                "restored",
                src,
                seconds=seconds,
                nbytes=nbytes,
                step=parse_step(src.name),
                to="from",
            )
        # Freed while collection is paused, the manifest's and the template's many
        # small objects are never walked by the collection that re-enabling triggers.
        del opened, match, leaves, template
    return result
