"""The pipelines. Save: flatten once -> stage -> write through a backend -> commit.
Restore: open and vet once -> match the template -> read through a backend -> unflatten.

``topology`` answers whether a save or restore is distributed; ``backends`` holds
where a planned, staged save is written (local files, the distributed DCP writer);
``incremental`` shares what did not change since a base checkpoint; ``save`` runs
the stages for ``fc.save`` and ``fc.save_async``; ``read_backends`` holds where a
restore reads from (the manifest, stock DCP, DCP's load planner) and ``restore``
runs its stages for ``fc.restore``. This package imports nothing at load time, so
lower modules may use ``topology``.
"""
