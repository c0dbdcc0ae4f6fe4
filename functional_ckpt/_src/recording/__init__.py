"""Record and replay: many small records of one state, for analysis and re-runs.

:class:`Recorder` appends a state (a simulation's TensorDict with a batch size,
actions, observations, random generators) every k steps, cheaply: unchanged
leaves are shared with the previous record, writes happen off the loop's thread,
and commits are periodic, so a crash loses at most the records after the last
one. :class:`Replay` reads any committed record back as a new state, or a range
in order. The format (``layout``) is its own, append-only and optimised for many
tiny records; checkpoints are not involved.
"""

from __future__ import annotations

from functional_ckpt._src.recording.layout import is_recording
from functional_ckpt._src.recording.recorder import Recorder
from functional_ckpt._src.recording.replay import Replay

__all__ = ["Recorder", "Replay", "is_recording"]
