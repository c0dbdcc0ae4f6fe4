"""One process of test_memory's forked-workers test: a manager with a memory tier
saves steps 1..3 into RAM, forks NWORKERS children (as a DataLoader's workers are
forked), and the process group gets SIGTERM, as a scheduler sends it (the default
action: every process ends). The workers only sleep; each prints ``WORKER`` and its
pid first.

    python forked_worker_job.py BASE NWORKERS
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch

import functional_ckpt as fc

base, n = Path(sys.argv[1]), int(sys.argv[2])
tier = fc.manager.Memory(path=base / "mem", async_save=False)
mgr = fc.CheckpointManager(base / "root", save=fc.every_steps(100), tiers=(tier,))
for step in (1, 2, 3):
    mgr.maybe_save({"w": torch.full((256, 256), float(step)), "step": step}, step=step)
for _ in range(n):
    if os.fork() == 0:
        print("WORKER", os.getpid(), flush=True)
        time.sleep(20)
        print("WORKER-LIVED", os.getpid(), flush=True)
        os._exit(0)
time.sleep(1)
os.killpg(os.getpgid(0), signal.SIGTERM)
time.sleep(20)
print("PARENT-LIVED", flush=True)
