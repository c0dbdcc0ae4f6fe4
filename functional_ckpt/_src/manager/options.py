"""The manager's arguments, checked where they come in.

A bad argument is the caller's error, never damage: it raises at the call that
passed it, naming the argument, before anything is written.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.export.safetensors import Export
from functional_ckpt._src.policy import SavePolicy
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all
from functional_ckpt._src.root.lock import WriterLock
from functional_ckpt.errors import UnsupportedValue

if TYPE_CHECKING:
    from functional_ckpt._src.remote.tier import RemoteTier

__all__ = ["check_policies", "plain_metrics", "remote_tier"]


def check_policies(save: object, keep: object, export: object) -> None:
    """Refuse a save policy, retention policy or export that is not one."""
    if not isinstance(save, SavePolicy):
        raise TypeError(f"CheckpointManager(save={save!r}): not a SavePolicy")
    if not isinstance(keep, RetentionPolicy):
        raise TypeError(f"CheckpointManager(keep={keep!r}): not a RetentionPolicy")
    if export is not None and not isinstance(export, Export):
        raise TypeError(f"CheckpointManager(export={export!r}): not an fc.manager.Export")


def plain_metrics(metrics: Mapping[str, Any] | None, where: str) -> dict[str, float]:
    """Metrics as plain ``str -> float`` (tensors and numpy scalars are converted)."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"{where}: metrics must be a mapping of str to numbers")
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise TypeError(f"{where}: metric names must be str, got {k!r}")
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


def remote_tier(
    root: Path,
    remote: str | None,
    keep: object,
    storage_options: Mapping[str, Any] | None,
    prune_unuploaded: bool,
    read_only: bool,
    *,
    lock: WriterLock | None = None,
) -> RemoteTier | None:
    """The remote tier ``remote=`` asks for (None without one), its endpoint checked now.

    On any failure the manager's ``lock`` is released: the manager was not made.
    """
    try:
        return _remote_tier(root, remote, keep, storage_options, prune_unuploaded, read_only)
    except BaseException:
        if lock is not None:
            lock.release()
        raise


def _remote_tier(
    root: Path,
    remote: str | None,
    keep: object,
    storage_options: Mapping[str, Any] | None,
    prune_unuploaded: bool,
    read_only: bool,
) -> RemoteTier | None:
    if remote is None:
        if keep is not None or storage_options is not None:
            raise TypeError("CheckpointManager: remote_keep= and storage_options= need remote=")
        return None
    if not isinstance(remote, str):
        raise TypeError(f"CheckpointManager(remote={remote!r}): expected an fsspec URL string")
    keep = keep_all() if keep is None else keep
    if not isinstance(keep, RetentionPolicy):
        raise TypeError(f"CheckpointManager(remote_keep={keep!r}): not a RetentionPolicy")
    if storage_options is not None and not isinstance(storage_options, Mapping):
        raise TypeError(
            f"CheckpointManager(storage_options=<{type(storage_options).__name__}>): expected "
            "a mapping of fsspec options (its values are not shown: they may be credentials)"
        )
    from functional_ckpt._src.remote.tier import RemoteTier

    return RemoteTier(
        root,
        remote,
        keep=keep,
        storage_options=storage_options,
        prune_unuploaded=bool(prune_unuploaded),
        writer=not read_only,
    )
