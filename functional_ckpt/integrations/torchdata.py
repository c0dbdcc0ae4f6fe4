"""torchdata's ``StatefulDataLoader``: resume mid-epoch, random draws included.

Creating a loader's iterator draws from the global torch generator (the
sampler's seed, the workers' base seed). A resumed run that restores the
generators and *then* calls ``iter(loader)`` has taken one draw more than the
uninterrupted run at the same step, and every later ``torch.randn``, dropout
mask or augmentation differs. The order that resumes exactly is: load the
loader's state, create the iterator, restore the generators last. That is what
:func:`iter_resumed` does.
"""

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
    """Apply ``state`` to ``loader`` and ``objects``, and return the loader's resumed iterator.

    ``objects`` are what :func:`functional_ckpt.apply` takes (``model=``,
    ``optimizer=``, ...). The random generators are restored after the iterator
    is created, so the next batch and the next random draw are those the
    uninterrupted run saw after the step the state was captured at. Iterate the
    returned iterator to finish the interrupted epoch, then ``loader`` as usual.
    ``rng=False`` leaves the generators alone (a state captured without them).
    """
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
        try:
            first = [next(iterator)]
        except StopIteration:
            first = []
        apply(state, rng=rng)
        return itertools.chain(first, iterator)
    apply(state, rng=rng)  # the generators only, now that the iterator has drawn its seeds
    return iterator
