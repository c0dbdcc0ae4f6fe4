"""Record and replay: many small records of one state, for analysis and re-runs.

:class:`~.recorder.Recorder` appends a state every k steps cheaply (unchanged leaves
shared, writes off the loop's thread, periodic commits); :class:`~.replay.Replay` reads
any committed record back as a new state. The append-only format is its own."""
