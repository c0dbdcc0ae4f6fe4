"""The cyclic GC paused while a large tree is flattened or rebuilt.

A state with thousands of tensors makes each generational collection walk the
whole heap; collections triggered by the bookkeeping of a save or a restore cost
more than the disk I/O of small tensors, so the pipelines pause it around that work.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside the block (it is re-enabled after, if it was on)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
