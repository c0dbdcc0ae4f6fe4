"""The names of the on-disk format, spelled in one place for every reader and writer."""

from __future__ import annotations

import re
from pathlib import Path

from functional_ckpt.errors import UnsafeCheckpoint

FORMAT_NAME = "functional_ckpt"
#: The highest format version this code reads; a save writes the lowest that describes
#: its checkpoint: one manifest, split into parts, with tensor tables, parts that list
#: their rank's files and check themselves (so the index no longer grows with N).
FORMAT_VERSION = 4
ONE_MANIFEST_VERSION = 1
PARTS_VERSION = 2
TABLES_VERSION = 3
PART_FILES_VERSION = 4
MANIFEST = "manifest.msgpack"
COMMIT_MARKER = "COMMITTED"
DCP_METADATA = ".metadata"

#: ``__<rank>_<n>.distcp``: a rank's shard files. A save writes its own bytes to
#: ``n = 0``; an incremental save links files it reuses from its base as ``n >= 1``.
_SHARD_RE = re.compile(r"__(\d{1,9})_(\d{1,9})\.distcp")


def shard_name(rank: int, n: int = 0) -> str:
    return f"__{rank}_{n}.distcp"


def parse_shard(name: str) -> tuple[int, int] | None:
    m = _SHARD_RE.fullmatch(name)
    return None if m is None else (int(m.group(1)), int(m.group(2)))


#: ``manifest.part-<rank>.msgpack``: rank ``rank``'s part of a split manifest.
_PART_RE = re.compile(r"manifest\.part-(\d{5,9})\.msgpack")


def part_name(rank: int) -> str:
    return f"manifest.part-{rank:05d}.msgpack"


def parse_part(name: str) -> int | None:
    m = _PART_RE.fullmatch(name)
    return None if m is None or part_name(int(m.group(1))) != name else int(m.group(1))


def is_shard_file(name: str) -> bool:
    """A DCP data file (``*.distcp``): ours, or any a stock DCP writer names so."""
    return name.endswith(".distcp") and "/" not in name


def safe_member(root: Path, name: object) -> Path:
    """A file name from a manifest as a path in ``root``; anything else is refused."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise UnsafeCheckpoint(f"{root}: the manifest names an unsafe file {name!r}")
    return root / name


#: A save in progress writes ``<name>.tmp-<id>``; a deletion renames to ``<name>.trash-<id>``.
TMP_INFIX = ".tmp-"
TRASH_INFIX = ".trash-"
#: Infix of a checkpoint moved aside because it could not be read (kept for forensics).
QUARANTINE_INFIX = ".corrupt-"
_INFIXES = (TMP_INFIX, TRASH_INFIX, QUARANTINE_INFIX)


def is_temporary_name(name: str) -> bool:
    """A save or a deletion in progress: never a checkpoint, whatever it holds."""
    return TMP_INFIX in name or TRASH_INFIX in name


_TEMPORARY_RE = re.compile(r"(.+)(?:\.tmp-|\.trash-)[0-9a-f]{12}")


def temporary_base(name: str) -> str | None:
    """``NAME`` of exactly ``NAME.tmp-<id>`` or ``NAME.trash-<id>`` as this project names them."""
    m = _TEMPORARY_RE.fullmatch(name)
    return None if m is None or is_temporary_name(m.group(1)) else m.group(1)


def base_name(name: str) -> str:
    """``step_N`` of ``step_N.tmp-…``, ``step_N.trash-…`` or ``step_N.corrupt-…``."""
    for infix in _INFIXES:
        name = name.split(infix)[0]
    return name


_STEP_RE = re.compile(r"step_(\d{1,30})")
#: Where a manager writes its exports, and where a rollback keeps the newer steps.
EXPORTS_DIR = "exports"
BRANCHES_DIR = "branches"


def step_name(step: int) -> str:
    """Directory name of ``step``: zero padded so that lexical order is step order."""
    return f"step_{step:09d}"


def parse_step(name: str) -> int | None:
    """The step of a canonical checkpoint directory name (only the exact :func:`step_name`)."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and step_name(int(m.group(1))) == name else None


def step_in_name(name: str) -> int | None:
    """The step a ``step_<digits>`` name spells, padded or not (for names users chose)."""
    m = _STEP_RE.fullmatch(base_name(name))
    return int(m.group(1)) if m else None


#: A safetensors export (Hugging Face layout): one file, or shards and their index.
EXPORT_WEIGHTS = "model.safetensors"
EXPORT_INDEX = "model.safetensors.index.json"
_EXPORT_SHARD_RE = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors")
#: The header every recording (``fc.recording.Recorder``) writes first.
RECORDING_HEADER = "recording.msgpack"


def is_export_weights(name: str) -> bool:
    """A weight file of an export: the single file or one of its numbered shards."""
    return _EXPORT_SHARD_RE.fullmatch(name) is not None
