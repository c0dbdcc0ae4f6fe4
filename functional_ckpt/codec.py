"""The exact codec's one public knob: registering a class whose instances a state holds.

Dataclasses, NamedTuples and Enums are stored as tagged plain data (never a pickle)
once their class is registered; see docs/format.md for the tags and the rules.
"""

from functional_ckpt._src.codec import register

__all__ = ["register"]
