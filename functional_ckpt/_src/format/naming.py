"""The names of the on-disk format: files, directories and the steps they stand for.

One place spells every name a reader or writer looks for: the files of a checkpoint,
the infixes of its temporary, deleted and quarantined siblings, the ``step_N``
directories of a root, and which file names a manifest may list at all.
"""

from __future__ import annotations

import re
from pathlib import Path

from functional_ckpt.errors import (
    UnsafeCheckpoint,
)

FORMAT_NAME = "functional_ckpt"

FORMAT_VERSION = 1

MANIFEST = "manifest.msgpack"

COMMIT_MARKER = "COMMITTED"

DCP_METADATA = ".metadata"

TMP_INFIX = ".tmp-"

TRASH_INFIX = ".trash-"


def is_temporary_name(name: str) -> bool:
    return TMP_INFIX in name or TRASH_INFIX in name


def safe_member(root: Path, name: object) -> Path:
    """A file name from a manifest as a path in ``root``; anything else is refused.

    Only the name is checked here; links and special files are refused when the
    file is opened (:func:`open_member`).
    """
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
    ):
        raise UnsafeCheckpoint(f"{root}: the manifest names an unsafe file {name!r}")
    return root / name


EXPORTS_DIR = "exports"

#: Infix of a checkpoint moved aside because it could not be read (kept for forensics).
QUARANTINE_INFIX = ".corrupt-"

_INFIXES = (TMP_INFIX, TRASH_INFIX, QUARANTINE_INFIX)

_STEP_RE = re.compile(r"step_(\d{1,30})")


def step_name(step: int) -> str:
    """Directory name of ``step``: zero padded so that lexical order is step order."""
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a canonical checkpoint directory name, else None.

    Only the exact name :func:`step_name` produces counts, so ``step_5`` next to
    ``step_000000005`` cannot make one step appear twice, and temporary or
    quarantined siblings (``step_….tmp-…``) never match.
    """
    m = _STEP_RE.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_name(step) == name else None


def step_in_name(name: str) -> int | None:
    """The step a ``step_<digits>`` name spells, padded or not (for names users chose)."""
    m = _STEP_RE.fullmatch(base_name(name))
    return int(m.group(1)) if m else None


def base_name(name: str) -> str:
    """``step_N`` of ``step_N.tmp-…``, ``step_N.trash-…`` or ``step_N.corrupt-…``."""
    for infix in _INFIXES:
        name = name.split(infix)[0]
    return name


def shard_name(rank: int) -> str:
    return f"__{rank}_0.distcp"
