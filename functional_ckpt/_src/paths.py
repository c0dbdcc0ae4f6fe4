"""Types shared by every module (one spelling of each, so signatures agree)."""

from __future__ import annotations

import os
from typing import TypeAlias

#: Anything the package accepts as a filesystem path.
PathLike: TypeAlias = str | os.PathLike[str]

__all__ = ["PathLike"]
