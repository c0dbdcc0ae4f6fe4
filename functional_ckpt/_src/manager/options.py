"""The manager's arguments, checked where they come in.

A bad argument is the caller's error, never damage: it raises at the call that
passed it, naming the argument, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from functional_ckpt._src.arguments import flag, items, mapping, require
from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.manager.memory import Memory
from functional_ckpt._src.policy.base import SavePolicy
from functional_ckpt._src.policy.retention import RetentionPolicy
from functional_ckpt._src.remote.options import Remote
from functional_ckpt._src.save.staging import Staging, check_staging
from functional_ckpt._src.storage.zstd import level_of
from functional_ckpt.errors import UnsupportedValue

__all__ = ["TIERS", "AsyncSave", "Disk", "TierOptions", "check_policies", "plain_metrics"]
__all__ += ["tier_options"]


@dataclass(frozen=True)
class AsyncSave:
    """Save off the training thread; ``maybe_save`` returns once the state is copied
    into reusable buffers (``staging="copy"``), written into the files (``"write"``:
    one copy, for files in RAM) or at once (``"none"``: the loop must not change tensors
    in place until the save commits; a violation refuses the checkpoint)."""

    staging: Staging = "copy"

    def __post_init__(self) -> None:
        check_staging(self.staging, "AsyncSave")


@dataclass(frozen=True)
class Disk:
    """How the disk tier (the root) stores each checkpoint: ``incremental`` (each save on
    the previous one, unchanged tensors referenced) and ``compression`` (as for
    ``fc.save``; a remote tier uploads these very files). See docs/tiered.md."""

    incremental: bool = False
    compression: str | None = None

    def __post_init__(self) -> None:
        flag(self.incremental, "incremental", "Disk")
        level_of(self.compression, "Disk")


TierOptions = tuple[Memory | None, Disk, Remote | None]
#: Each tier's option by its key in a configuration, fastest first.
TIERS: dict[str, type[Memory | Disk | Remote]] = {"memory": Memory, "disk": Disk, "remote": Remote}


def tier_options(tiers: Sequence[Memory | Disk | Remote]) -> TierOptions:
    """``tiers=`` as given (any order, each kind at most once): memory, disk, remote."""
    tiers = items(tiers, "tiers", "CheckpointManager", "a tuple of tier options", lambda _: True)
    found: dict[type[Any], Any] = {Disk: Disk()}
    for i, option in enumerate(tiers):
        kind = next((k for k in TIERS.values() if isinstance(option, k)), None)
        if kind is None:
            raise TypeError(
                f"CheckpointManager(tiers[{i}]={option!r}): expected fc.manager.Memory(...), "
                "fc.manager.Disk(...) or fc.manager.Remote(...)"
            )
        if any(isinstance(t, kind) for t in tiers[:i]):
            raise ValueError(f"CheckpointManager(tiers=...): two {kind.__name__} tiers")
        found[kind] = option
    return found.get(Memory), found[Disk], found.get(Remote)


def async_option(value: bool | AsyncSave | None) -> AsyncSave | None:
    """``async_save=`` as given: False/None, True, or an :class:`AsyncSave`."""
    if value is None or value is False:
        return None
    if value is True:
        return AsyncSave()
    expected = "True, False or fc.manager.AsyncSave(staging=...)"
    require(isinstance(value, AsyncSave), value, "async_save", "CheckpointManager", expected)
    return value


def check_policies(save: object, keep: object, export: object) -> None:
    """Refuse a save policy, retention policy or export that is not one."""
    what = "CheckpointManager"
    require(isinstance(save, SavePolicy), save, "save", what, "a SavePolicy")
    require(isinstance(keep, RetentionPolicy), keep, "keep", what, "a RetentionPolicy")
    require(export is None or isinstance(export, Export), export, "export", what, "an Export")


def plain_metrics(metrics: Mapping[str, Any] | None, where: str) -> dict[str, float]:
    """Metrics as plain ``str -> float`` (tensors and numpy scalars are converted)."""
    named = mapping(
        metrics, "metrics", where, "a mapping of str to numbers", lambda k, _: isinstance(k, str)
    )
    out: dict[str, float] = {}
    for k, v in named.items():
        try:
            out[k] = float(v)
        except (TypeError, ValueError):
            raise TypeError(f"{where}: metrics[{k!r}]={v!r} is not a number") from None
        except OverflowError:
            raise UnsupportedValue(
                f"{where}: metrics[{k!r}] (a {type(v).__name__}) is too large for a float; "
                "metrics are compared and stored as float64"
            ) from None
    return out
