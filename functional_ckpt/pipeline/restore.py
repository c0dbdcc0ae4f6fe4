"""``fc.restore``: one pipeline, a read backend per kind of checkpoint.

    open and vet once (the backend) -> match the template (``like``/``out``,
    ``partial``, ``cast``, ``reshard``) -> read (into new tensors, or ``out``'s)
    -> unflatten

The project's own checkpoints, stock DCP checkpoints and restores into DTensor
templates differ only in their backend (:mod:`read_backends`); which one serves
a restore is decided once, from the directory and the template.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDict, TensorDictBase

from functional_ckpt._src.format import naming
from functional_ckpt.pipeline.read_backends import (
    ManifestBackend,
    PlannerBackend,
    ReadBackend,
    Request,
    StockDcpBackend,
)
from functional_ckpt.pipeline.topology import has_dtensor, topology
from functional_ckpt.reader import Reshard, gc_paused, rebuild
from functional_ckpt.tree import as_state

State = TensorDictBase | Mapping[str, Any]


def is_stock_dcp(path: Path) -> bool:
    """A directory written by stock ``torch.distributed.checkpoint`` (no manifest).

    Decided from directory entries alone (nothing is opened).
    """
    return (
        path.is_dir()
        and not os.path.lexists(path / naming.COMMIT_MARKER)
        and not os.path.lexists(path / naming.MANIFEST)
        and os.path.lexists(path / naming.DCP_METADATA)
        and not naming.is_temporary_name(path.name)
    )


def read_backend(path: Path, template: TensorDictBase | None) -> ReadBackend:
    """The backend that serves a restore of ``path`` into ``template``."""
    if is_stock_dcp(path):
        return StockDcpBackend()
    topo = topology()
    if template is not None and has_dtensor(template):
        return PlannerBackend(topo)
    return ManifestBackend(topo)


def restore(
    path: Path,
    like: State | None = None,
    *,
    out: State | None = None,
    device: torch.device | str | None = None,
    partial: bool = False,
    cast: bool = False,
    allow_pickle: bool = False,
    reshard: Reshard | None = None,
) -> TensorDict:
    """Restore ``path`` as a new locked TensorDict shaped by ``like`` (or into ``out``).

    See :func:`functional_ckpt.restore` for the semantics; ``like`` and ``out``
    are exclusive (checked by the caller).
    """
    chosen = out if out is not None else like
    template = None if chosen is None else as_state(chosen)
    req = Request(
        partial=partial,
        cast=cast,
        allow_pickle=allow_pickle,
        reshard=reshard,
        inplace=out is not None,
        device=torch.device("cpu" if device is None else device),
    )
    src = Path(path)
    opened = read_backend(src, template).open(src)
    try:
        with gc_paused():
            match = opened.match(template, req)
            leaves = opened.read(match, req)
            return rebuild(leaves, match.root, src)
    finally:
        opened.close()
