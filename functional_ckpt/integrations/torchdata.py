"""torchdata's ``StatefulDataLoader``: resume mid-epoch, random draws included.

Creating a loader's iterator draws from the global generator (sampler and worker
seeds), so :func:`iter_resumed` restores the generators after ``iter(loader)``."""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterator
from typing import Any

from tensordict import TensorDictBase

from functional_ckpt._src.state.capture import apply
from functional_ckpt.errors import TemplateMismatch

__all__ = ["iter_resumed"]


def iter_resumed(
    state: TensorDictBase, loader: Any, *, rng: bool = True, **objects: Any
) -> Iterator[Any]:
    """Apply ``state`` to ``loader`` and ``objects`` (as :func:`functional_ckpt.apply`), and
    return the loader's resumed iterator: the next batch and random draw are the
    uninterrupted run's. ``rng=False`` leaves the generators alone."""
    if rng and "rng" not in state.keys():
        raise TemplateMismatch(
            "iter_resumed: the state has no 'rng' entry (captured with rng=False?); pass "
            "rng=False to resume without restoring the random generators"
        )
    apply(state, loader=loader, rng=False, **objects)
    iterator: Iterator[Any] = iter(loader)
    if inspect.isgenerator(iterator):
        # A generator (accelerate's loaders) runs nothing, and draws nothing, until
        # its first batch is asked for: ask now, before the generators are restored.
        iterator = itertools.chain(list(itertools.islice(iterator, 1)), iterator)
    apply(state, rng=rng)  # the generators only, now that the iterator has drawn its seeds
    return iterator
