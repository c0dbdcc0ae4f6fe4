"""Rewrite a real checkpoint's manifest and re-sign it, as an attacker or a bug could.

The commit marker records the manifest's size and CRC32; re-signing recomputes
them, so the edited manifest is read as authentic and only its content is tested.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit, committed


def resign(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``edit`` to the decoded manifest of ``path``, write it back, re-sign the marker."""
    manifest = committed.read_manifest(path)
    edit(manifest)
    raw = codec.encode(manifest)
    (path / naming.MANIFEST).write_bytes(raw)
    os.unlink(path / naming.COMMIT_MARKER)
    commit.write_commit_marker(path, raw)
