"""The exact codec's public knobs: registering a class whose instances a state holds.

Dataclasses, NamedTuples and Enums are stored as tagged plain data (never a pickle)
once their class is registered; a reader that has not registered one sees it as an
``Unregistered`` placeholder. See docs/format.md for the tags and the rules.
"""

from functional_ckpt._src.codec import Unregistered, register

__all__ = ["Unregistered", "register"]
