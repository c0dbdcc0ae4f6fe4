"""A resume's side of the remote tier: its newest good step newer than a faster tier's,
fetched into the local root and read there (``RemoteTier.newest``).

A damaged remote checkpoint is reported (``RemoteWarning``), its local copy moved
aside, and the previous one tried. Under ``torch.distributed`` every rank reads the same
step, the newest all hold locally or the coordinator's newest good remote one, each
rank fetching what it reads; damage any rank finds sends every rank to the previous step.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from functional_ckpt._src.distributed.groups import all_gather_values, checkpoint_group
from functional_ckpt._src.format.kind import is_committed
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.log import warn
from functional_ckpt._src.remote.fetch import commit_shares, download, fetch_share
from functional_ckpt._src.root.delete import quarantine
from functional_ckpt._src.root.leftovers import DOWNLOAD_PREFIX
from functional_ckpt._src.root.listing import StepInfo, committed_steps, quarantined, read_info
from functional_ckpt._src.storage.ram import holds_every_file
from functional_ckpt.errors import (
    CheckpointError,
    RankFailed,
    RemoteError,
    RemoteVanished,
    RemoteWarning,
    is_damage,
)

#: The tier, a ``remote/tier.RemoteTier`` (not imported: that module imports this one).
_Remote = Any

__all__ = ["Found", "newest", "one"]

T = TypeVar("T")
Found = tuple[StepInfo, T] | None


def newest(tier: _Remote, read: Callable[[Path], T], above: int | None) -> Found[T]:
    """The newest good remote step newer than ``above`` (what a faster tier holds), read;
    None if there is none, but for a root whose only checkpoints were found damaged."""
    if tier.world > 1:
        return _agreed(tier, read, above)
    root = tier.root
    for step in _good(tier, above):
        there = root / step_name(step)
        if there.is_dir() and not is_committed(there):
            quarantine(root, there)  # never committed (a download a crash cut short)
        if there.exists():
            continue  # unreadable locally (the disk tier said so): the previous one
        try:
            path = download(tier.store, step, root)
            return read_info(path, step), read(path)
        except Exception as err:
            if _verdict(err) != "damage":
                raise  # the template or an argument is wrong, not the checkpoint
            _set_aside(tier, step, True, err, depth=6)
    if above is None and quarantined(root):  # only damage anywhere: never start fresh
        raise CheckpointError(
            f"{root}: the checkpoints here were found damaged and moved aside "
            f"({', '.join(quarantined(root)[:5])}) and {tier.url} holds none readable; "
            "refusing to start fresh. Move or delete them to start over"
        )
    return None


def one(tier: _Remote, read: Callable[[Path], T], step: int) -> tuple[StepInfo, T]:
    """Step ``step`` read, fetched where a rank's root lacks a file it reads."""
    there = tier.root / step_name(step)
    whole = is_committed(there) and holds_every_file(there)
    if tier.world == 1:
        path = there if whole else download(tier.store, step, tier.root)
        return read_info(path, step), read(path)
    group, work = checkpoint_group(purpose="control"), f"{DOWNLOAD_PREFIX}{uuid.uuid4().hex[:12]}"
    work = tier.together(tier.url, lambda: work, tier.coordinator, group)  # the coordinator's
    return _read_one(tier, group, step, not whole, f"{work}-{step}", read)


def _good(tier: _Remote, above: int | None) -> list[int]:
    """This lineage's good committed remote steps newer than ``above``, newest first;
    none (with a warning) if the remote cannot be listed while a faster tier holds one."""
    try:
        committed = tier.steps()
    except RemoteError as err:
        if above is None:
            raise
        warn(
            f"{err}; resuming from a faster tier (step {above}), which may be older than "
            "the newest remote checkpoint",
            RemoteWarning,
            stacklevel=6,
        )
        return []
    newer = [s for s in committed if s not in tier.bad and (above is None or s > above)]
    return sorted(tier.lineage_of(newer, learn=committed), reverse=True)


def _agreed(tier: _Remote, read: Callable[[Path], T], above: int | None) -> Found[T]:
    """Every rank reads one step, walking down past damage any rank finds. On the
    training thread, so on the manager's group (uploads use their own)."""
    group = checkpoint_group(purpose="control")
    mine = [
        s
        for s, p in committed_steps(tier.root).items()
        if holds_every_file(p) and not tier.theirs(s, p)
    ]
    common = set.intersection(*(set(s) for s in all_gather_values(mine, group)))
    work = f"{DOWNLOAD_PREFIX}{uuid.uuid4().hex[:12]}"  # the coordinator's, for one root
    told = tier.together(tier.url, lambda: [_good(tier, above), work], tier.coordinator, group)
    (remote, work), newer = told, {s for s in common if above is None or s > above}
    for target in sorted(newer | set(remote), reverse=True):
        try:
            return _read_one(tier, group, target, target not in mine, f"{work}-{target}", read)
        except Exception as err:
            verdicts = all_gather_values(_verdict(err), group)  # one decision, every rank
            if "other" in verdicts or "damage" not in verdicts:
                raise
            _set_aside(tier, target, target not in mine, err, depth=7)
    return None


def _verdict(err: BaseException) -> str:
    """A failed read's verdict: damage, another rank's failure, or the caller's error."""
    if isinstance(err, RankFailed):
        return "follow"
    return "damage" if is_damage(err) or isinstance(err, RemoteVanished) else "other"


def _set_aside(tier: _Remote, step: int, fetched: bool, err: BaseException, depth: int) -> None:
    """A step some rank found damaged: reported, its local copy (if fetched) moved aside."""
    if fetched:
        tier.bad.add(step)  # the remote copy: not tried again by this process
    there = tier.root / step_name(step)
    with contextlib.suppress(OSError):
        if fetched and (tier.coordinator or not tier.shared) and there.exists():
            quarantine(tier.root, there)
    warn(
        f"{tier.store.where(step)}: remote checkpoint of step {step} is unusable "
        f"({type(err).__name__}: {err}); falling back to the previous one",
        RemoteWarning,
        stacklevel=depth,
    )


def _read_one(
    tier: _Remote, group: Any, target: int, fetch: bool, work: str, read: Callable[[Path], T]
) -> tuple[StepInfo, T]:
    """Step ``target`` on every rank: fetched (if ``fetch``) as each rank reads it, read."""
    shares, where, store = fetch and tier.shared, tier.store.where(target), tier.store

    def fetched() -> bytes:
        if fetch and not tier.shared:  # its own root: what it reads
            download(store, target, tier.root, check=False, replace=True, rank=tier.rank,
                     world=tier.world)  # fmt: skip
        elif shares:  # one root: each rank what it reads, in parallel
            return fetch_share(store, target, tier.root, work, rank=tier.rank, world=tier.world)
        return b""

    marker = tier.together(f"download {where}", fetched, group=group)  # every share durable
    if shares:  # then the coordinator commits it, marker last
        commit = partial(commit_shares, store, target, tier.root, work, marker)
        tier.together(f"commit {where}", commit, tier.coordinator, group)
    path = tier.root / step_name(target)
    return read_info(path, target), read(path)
