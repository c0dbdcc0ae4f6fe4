"""Resuming from the remote tier: the newest checkpoint of either tier, fetched if needed.

A remote checkpoint newer than every readable local one is downloaded into the
root, verified, and read from there; a damaged one is reported as a
:class:`~functional_ckpt.errors.RemoteWarning` and the previous remote one
tried. Under ``torch.distributed`` every rank restores the same step: the newest
every rank holds whole locally, or the coordinator's newest good remote one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from functional_ckpt._src.distributed.topology import topology
from functional_ckpt._src.format.kind import is_committed
from functional_ckpt._src.format.naming import step_name
from functional_ckpt._src.log import warn
from functional_ckpt._src.remote import protocol
from functional_ckpt._src.remote.fetch import download
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.remote.uploader import retried
from functional_ckpt._src.root.delete import quarantine
from functional_ckpt._src.root.listing import StepInfo
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    RemoteError,
    RemoteVanished,
    RemoteWarning,
    UnsafeCheckpoint,
)

T = TypeVar("T")
Found = tuple[StepInfo, T] | None

#: What a remote checkpoint's own bytes can raise: skip it, try the previous one.
_DAMAGE = (CorruptCheckpoint, UnsafeCheckpoint, IncompleteCheckpoint, RemoteVanished)


class RemoteResume:
    """The resume side of one manager's remote tier; remembers the steps found damaged."""

    def __init__(
        self,
        store: Store,
        root: Path,
        url: str,
        *,
        shared: bool,
        listed: Callable[[set[int]], None],
    ) -> None:
        self.store = store
        self.root = root
        self.url = url
        self.shared = shared
        self._listed = listed  # told the committed remote steps each time they are listed
        topo = topology()
        self.world, self.coordinator = topo.world, topo.coordinator
        self.bad: set[int] = set()  # remote steps found damaged by this process
        self.above: int | None = None  # the step a faster tier holds, while resuming

    def latest(
        self,
        local: Callable[[], Found[T]],
        local_steps: Callable[[], list[int]],
        read_step: Callable[[int], tuple[StepInfo, T]],
        above: int | None = None,
    ) -> Found[T]:
        """The newest checkpoint of either tier, downloaded first when only the remote has it.

        ``local`` is the local resume (newest readable, damage moved aside);
        ``read_step`` restores one local step. Only steps newer than ``above`` count
        (a faster tier holds that one).
        """
        self.above = above
        if self.world > 1:
            return self._agreed(local_steps, read_step)
        fetched: set[int] = set()
        found: Found[T] = None
        for _ in range(8):
            good = self._fetch_newer(max(local_steps(), default=None), fetched)
            found = local()  # damaged local copies are moved aside here
            best = max((s for s in good if s not in self.bad), default=None)
            if best is None or (found is not None and found[0].step >= best):
                return found
            if best in fetched:
                self.bad.add(best)  # downloaded, then found unreadable locally: not again
        return found

    def _good(self, newest_local: int | None) -> list[int]:
        """Committed remote steps not found damaged, newest first; warns if unlisted."""
        try:
            listing = retried(self.store.listing)
        except RemoteError as err:
            if newest_local is None and self.above is None:
                raise
            warn(
                f"{err}; resuming from the local or memory tier (step "
                f"{max(s for s in (newest_local, self.above) if s is not None)}), which may "
                "be older than the newest remote checkpoint",
                RemoteWarning,
                stacklevel=5,
            )
            return []
        committed = {s for s, r in listing.items() if r.committed}
        self._listed(committed)
        above = self.above
        newer = (s for s in committed if s not in self.bad and (above is None or s > above))
        return sorted(newer, reverse=True)

    def _fetch_newer(self, newest_local: int | None, fetched: set[int]) -> list[int]:
        """Download the newest good remote step newer than ``newest_local``.

        Returns the good remote steps (empty if the remote could not be listed).
        """
        good = self._good(newest_local)
        for step in good:
            if newest_local is not None and step <= newest_local:
                break
            there = self.root / step_name(step)
            if there.is_dir() and not is_committed(there):
                quarantine(self.root, there)  # never committed (a download a crash cut short)
            if there.exists() and step not in fetched:
                continue  # a local directory there is unreadable: the local resume decides
            try:
                if step not in fetched:
                    download(self.store, step, self.root)
                    fetched.add(step)
                break
            except _DAMAGE as err:
                self.bad.add(step)
                warn(
                    f"{self.store.where(step)}: remote checkpoint of step {step} is unusable "
                    f"({type(err).__name__}: {err}); falling back to the previous one",
                    RemoteWarning,
                    stacklevel=5,
                )
        return good

    def _agreed(
        self, local_steps: Callable[[], list[int]], read_step: Callable[[int], tuple[StepInfo, T]]
    ) -> Found[T]:
        """Every rank restores one step: the newest every rank has locally, or the remote's.

        On the training thread, so on the manager's group (uploads use their own).
        """
        from functional_ckpt._src.distributed.groups import (
            agree,
            agree_values,
            all_gather_values,
            checkpoint_group,
        )

        group = checkpoint_group(purpose="control")
        mine = [s for s in local_steps() if self._whole(s)]
        everyone = [set(s) for s in all_gather_values(mine, group)]
        common = set.intersection(*everyone)
        error: BaseException | None = None
        remote: list[int] = []
        if self.coordinator:
            try:
                remote = self._good(max(common, default=None))
            except BaseException as e:
                error = e
        told = agree_values(
            error, remote if self.coordinator else None, group, f"restore from {self.url}"
        )
        remote = told[0]
        target = max([*common, *remote], default=None)
        if target is None:
            return None
        try:
            if target not in mine and (self.coordinator or not self.shared):
                download(self.store, target, self.root, replace=True)  # over a part
        except BaseException as e:
            error = e
        agree(error, group, f"download {self.store.where(target)}")
        return read_step(target)

    def _whole(self, step: int) -> bool:
        """Whether the local ``step_N`` holds every file its manifest lists (not split)."""
        path = self.root / step_name(step)
        try:
            sizes = protocol.expected_sizes(path)
            return all((path / n).stat().st_size == size for n, size in sizes.items())
        except (CheckpointError, OSError, KeyError, TypeError, ValueError):
            return False
