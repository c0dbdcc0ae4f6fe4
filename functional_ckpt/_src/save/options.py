"""One :class:`SaveOptions` value, checked once where the call comes in, read by every stage."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt._src.arguments import flag, items, mapping, require
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.save.staging import PROCESS_TRUST
from functional_ckpt._src.save.trust import TrustMemory
from functional_ckpt._src.storage import zstd

#: Top-level subtrees that differ between ranks and are stored once per rank.
DEFAULT_PER_RANK = ("rng", "loader")
PER_RANK = "a sequence of top-level keys"


@dataclass(frozen=True)
class SaveOptions:
    """One save's options. An unreadable ``base`` is an error when ``base_required``, else a full
    save. ``parts``: a rank not seeing the coordinator's directory keeps its files in its own."""

    metadata: Mapping[str, Any] | None = None
    overwrite: bool = False
    per_rank: tuple[str, ...] = DEFAULT_PER_RANK
    base: Path | None = None
    base_required: bool = True
    trust: TrustMemory = field(default=PROCESS_TRUST, compare=False, repr=False)
    parts: bool = False
    durable: bool = True
    group: str = "save"  # the checkpoint group its collectives run on
    zstd_level: int = 0  # 0: tensors stored raw; else zstd frames of this level


def save_options(
    what: str,
    metadata: Mapping[str, Any] | None,
    overwrite: bool,
    per_rank: Sequence[str],
    base: PathLike | None,
    compression: str | None,
    /,
) -> SaveOptions:
    """The options of a public call (``what`` names it in errors), every argument checked."""
    require(base is None or isinstance(base, str | os.PathLike), base, "base", what, "a path")
    return SaveOptions(
        metadata=mapping(metadata, "metadata", what, "a mapping of plain values"),
        overwrite=flag(overwrite, "overwrite", what),
        per_rank=items(per_rank, "per_rank", what, PER_RANK),
        base=None if base is None else Path(base),
        zstd_level=zstd.level_of(compression, what),
    )
