"""Record and replay: many small records of one state, for analysis and re-runs.

:class:`Recorder` appends a state every k steps cheaply (unchanged leaves shared,
writes off the loop's thread, periodic commits); :class:`Replay` reads any committed
record back as a new state. The append-only format is its own, not a checkpoint's."""

from __future__ import annotations

from functional_ckpt._src.recording.layout import is_recording
from functional_ckpt._src.recording.recorder import Recorder
from functional_ckpt._src.recording.replay import Replay

__all__ = ["Recorder", "Replay", "is_recording"]
