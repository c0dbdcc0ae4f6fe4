"""Rewrite a real checkpoint's manifest and re-sign it, as an attacker or a bug could.

The commit marker records the manifest's size and CRC32; re-signing recomputes
them, so the edited manifest is read as authentic and only its content is tested.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_ckpt import codec, format


def resign(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the decoded manifest of ``path``, write it back, re-sign the marker."""
    manifest = format.read_manifest(path)
    edit(manifest)
    raw = codec.encode(manifest)
    (path / format.MANIFEST).write_bytes(raw)
    os.unlink(path / format.COMMIT_MARKER)
    format.write_commit_marker(path, raw)
