"""Recordings: a small state recorded every k steps, and any record read back.

:class:`Recorder` appends records (unchanged leaves shared, written off the loop's
thread) to one directory; :class:`Replay` reads any recorded step back as a new
state and re-runs from it. See docs/simulation.md.
"""

from functional_ckpt._src.recording.recorder import Recorder
from functional_ckpt._src.recording.replay import Replay

__all__ = ["Recorder", "Replay"]
