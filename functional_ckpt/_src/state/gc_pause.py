"""The cyclic GC paused while a large tree is flattened or rebuilt: with thousands of
tensors each collection walks the whole heap, costing more than small tensors' I/O."""

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
