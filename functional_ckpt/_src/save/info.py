"""What a finished save reports."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class CheckpointInfo:
    """What a finished save produced."""

    path: Path
    nbytes: int  # bytes on disk, all files
    tensor_bytes: int
    num_tensors: int
    num_values: int
    created: float  # seconds since the epoch
    duration: float  # seconds spent in save
    metadata: Any = None
