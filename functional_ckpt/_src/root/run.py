"""The run a root holds: a random id recorded in every checkpoint, so a tier outside the
root (RAM) is resumed only when it holds this run's (no leading dot: ``rm -rf ckpt/*``
starts a new run), and an owner-only secret naming the memory tier's folder."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from functional_ckpt._src.storage import durable, opener
from functional_ckpt.errors import CheckpointError

#: In a root: its run's id and the secret naming its memory tier's folder.
RUN_FILE = "run.json"


@dataclass(frozen=True)
class Run:
    """A root's run: ``id`` recorded in every checkpoint; ``secret`` names its RAM folder."""

    id: str
    secret: str


def read_run(root: Path) -> Run | None:
    """The run recorded in ``root``; None where none is (or none to trust)."""
    doc = opener.read_state(root / RUN_FILE, "run record")
    if not isinstance(doc, dict):
        return None
    rid, secret = doc.get("run"), doc.get("secret")
    if not (isinstance(rid, str) and rid and isinstance(secret, str) and secret):
        return None
    return Run(rid, secret)


def open_run(root: Path, *, new_secret: bool = False) -> tuple[Run, bool]:
    """The run of ``root`` (under the writer's lock), made and recorded if there is none;
    and whether it was made now. ``new_secret`` keeps the id, draws a new secret."""
    run = read_run(root)
    made = run is None
    if run is None or new_secret:
        run = Run(secrets.token_hex(16) if run is None else run.id, secrets.token_hex(16))
        path = root / RUN_FILE  # crash-safely, readable by its owner only
        try:
            data = json.dumps({"run": run.id, "secret": run.secret}).encode()
            durable.replace_durably(path, data)
        except OSError as e:  # a directory or a special file in its place: not ours to fix
            raise CheckpointError(f"{path}: cannot record the run ({e.strerror or e})") from e
        with contextlib.suppress(OSError):
            os.chmod(path, 0o600)
    return run, made
