"""Recordings: :class:`Recorder` appends a small state every k steps to one directory;
:class:`Replay` reads any recorded step back and re-runs from it. See docs/simulation.md."""

from functional_ckpt._src.recording.recorder import Recorder
from functional_ckpt._src.recording.replay import Replay

__all__ = ["Recorder", "Replay"]
