"""The save pipeline: flatten once -> stage -> write through a backend -> commit.

``topology`` answers whether a save is distributed; ``backends`` holds where a
planned, staged save is written (local files, the distributed DCP writer);
``save`` runs the stages for ``fc.save`` and ``fc.save_async``. This package
imports nothing at load time, so lower modules may use ``topology``.
"""
