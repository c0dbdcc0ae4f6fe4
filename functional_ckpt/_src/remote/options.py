"""``Remote``: a manager's remote tier, as one option value (``CheckpointManager(tiers=...)``).

Its storage options may hold credentials: they are never shown in a message or a repr.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from functional_ckpt._src.arguments import flag, require
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all


@dataclass(frozen=True)
class Remote:
    """Copy every committed checkpoint to ``url`` (any fsspec URL) in the background.

    ``keep`` is the remote tier's own retention; ``storage_options`` go to fsspec; with
    ``prune_unuploaded`` local retention need not wait for an upload (docs/tiered.md).
    """

    url: str
    keep: RetentionPolicy = field(default_factory=keep_all)
    storage_options: Mapping[str, Any] | None = field(default=None, repr=False)
    prune_unuploaded: bool = False

    def __post_init__(self) -> None:
        require(isinstance(self.url, str), self.url, "url", "Remote", "an fsspec URL string")
        keep, options = self.keep, self.storage_options
        require(isinstance(keep, RetentionPolicy), keep, "keep", "Remote", "a RetentionPolicy")
        fine = options is None or isinstance(options, Mapping)
        expected = "a mapping of fsspec options (its values are not shown: they may be credentials)"
        require(fine, options, "storage_options", "Remote", expected, f"<{type(options).__name__}>")
        flag(self.prune_unuploaded, "prune_unuploaded", "Remote")
