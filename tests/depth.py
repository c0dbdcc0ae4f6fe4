"""How deep the suite explores: a thinner sample by default, all of it on request.

The crash-state explorer and the slowest property tests draw a sample that still
reaches every operation and every kind of state; ``FCKPT_TEST_FULL=1`` explores the
full enumeration and every example (docs/reliability.md), as before a release.
"""

from __future__ import annotations

import os

FULL = os.environ.get("FCKPT_TEST_FULL", "0") not in ("", "0")


def examples(n: int) -> int:
    """A property test's examples: ``n`` with ``FCKPT_TEST_FULL=1``, a quarter otherwise."""
    return n if FULL else max(25, n // 4)
