"""Child process for the crash tests: saves forever until it is killed.

Each checkpoint holds tensors whose every element equals its version number, so
a reader can tell exactly which save it sees and whether it is whole.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import functional_ckpt as fc


def state(version: int) -> dict[str, object]:
    big = {f"big{i}": torch.full((1 << 20,), float(version)) for i in range(8)}  # 32 MiB
    small = {f"s{i}": torch.full((64,), float(version)) for i in range(500)}
    return {"big": big, "small": small, "version": version, "meta": {"v": [version] * 10}}


def main() -> None:
    root = Path(sys.argv[1])
    mode = sys.argv[2]
    version = 0
    print("ready", flush=True)
    while True:
        version += 1
        if mode == "overwrite":
            fc.save(root / "ck", state(version), overwrite=True)
        elif mode == "async":
            pending = fc.save_async(root / f"ck{version:06d}", state(version))
            pending.wait_staged()
            pending.result()
        else:
            fc.save(root / f"ck{version:06d}", state(version))
        print(version, flush=True)  # committed


if __name__ == "__main__":
    main()
