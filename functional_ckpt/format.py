"""The checkpoint directory: its files, its commit protocol, and safe reads of it.

A checkpoint is a directory that becomes visible only once complete. It is written
as ``<name>.tmp-<id>/``; every file is fsynced, the commit marker is written last
(it records the manifest's size and checksum, so a torn or altered manifest is
caught), the directory is fsynced, renamed into place and its parent fsynced.
Readers accept only directories that carry a valid marker.

DCP's ``.metadata`` is a pickle. Our code reads it only through
:class:`SafeMetadataUnpickler`, which admits DCP's own metadata classes and
nothing that could run code.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import io
import os
import pickle
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from functional_ckpt import codec
from functional_ckpt.checksum import crc32
from functional_ckpt.errors import (
    CheckpointExists,
    CheckpointNotFound,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    UnsafeCheckpoint,
)
from functional_ckpt.limits import LIMITS

FORMAT_NAME = "functional_ckpt"
FORMAT_VERSION = 1
MANIFEST = "manifest.msgpack"
COMMIT_MARKER = "COMMITTED"
DCP_METADATA = ".metadata"
TMP_INFIX = ".tmp-"
TRASH_INFIX = ".trash-"
#: Upper bound on the manifest size a reader accepts (hostile files).
MAX_MANIFEST_BYTES = LIMITS.manifest_bytes
MAX_DCP_METADATA_BYTES = 1 << 31


def tmp_sibling(path: Path, infix: str = TMP_INFIX) -> Path:
    """A hidden-by-name sibling of ``path`` that no reader mistakes for a checkpoint."""
    return path.with_name(f"{path.name}{infix}{uuid.uuid4().hex[:12]}")


def is_temporary_name(name: str) -> bool:
    return TMP_INFIX in name or TRASH_INFIX in name


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durably(path: Path, data: bytes) -> None:
    """Write a whole small file and fsync it; refuses to overwrite."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view)
            view = view[n:]
        os.fsync(fd)
    finally:
        os.close(fd)


def crc32_file(path: Path) -> tuple[int, int]:
    """(size, crc32) of a whole file, read in large chunks."""
    crc = 0
    size = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            chunk = f.read(16 << 20)
            if not chunk:
                break
            size += len(chunk)
            crc = crc32(chunk, crc)
    return size, crc


# --------------------------------------------------------------------------- commit


def _renameat2_exchange() -> Any:
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return None
    try:
        libc = ctypes.CDLL(libc_name, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_RENAMEAT2 = _renameat2_exchange()
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux ``renameat2``); False where unsupported."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def write_commit_marker(tmp: Path, manifest_bytes: bytes) -> None:
    marker = codec.encode(
        {
            "format": FORMAT_NAME,
            "version": FORMAT_VERSION,
            "manifest_size": len(manifest_bytes),
            "manifest_crc32": crc32(manifest_bytes),
        }
    )
    write_file_durably(tmp / COMMIT_MARKER, marker)


def remove_tree(path: Path) -> None:
    """Delete a checkpoint-like directory so that no crash leaves it looking valid.

    The marker goes first (it is what makes a directory a checkpoint), then the rest.
    """
    with contextlib.suppress(OSError):
        os.unlink(path / COMMIT_MARKER)
    shutil.rmtree(path, ignore_errors=True)


def commit(tmp: Path, final: Path, *, overwrite: bool) -> None:
    """Make a fully written ``tmp`` directory visible as ``final``, atomically.

    With ``overwrite`` an existing ``final`` stays readable until the new one has
    taken its place (an atomic exchange where the OS offers it; otherwise the old
    one is moved aside for the shortest possible moment and put back on failure).
    """
    fsync_dir(tmp)
    parent = final.parent
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExists(
                f"{final}: a checkpoint already exists here; pass overwrite=True to replace it"
            )
        if not final.is_dir() or final.is_symlink():
            raise CheckpointExists(f"{final}: exists and is not a checkpoint directory")
        if _exchange(tmp, final):
            fsync_dir(parent)
            remove_tree(tmp)  # tmp now holds the old checkpoint
            return
        aside = tmp_sibling(final, TRASH_INFIX)
        os.rename(final, aside)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(aside, final)
            raise
        fsync_dir(parent)
        remove_tree(aside)
        return
    os.rename(tmp, final)
    fsync_dir(parent)


# --------------------------------------------------------------------------- reading


def _read_small(path: Path, limit: int, what: str) -> bytes:
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path}: the {what} is missing") from None
    if not os.path.isfile(path) or os.path.islink(path):
        raise UnsafeCheckpoint(f"{path}: the {what} is not a regular file")
    if st.st_size > limit:
        raise CorruptCheckpoint(
            f"{path}: the {what} is {st.st_size} bytes, more than the {limit} recorded or allowed"
        )
    with open(path, "rb") as f:
        return f.read()


_MARKER_KEYS = {"format", "version", "manifest_size", "manifest_crc32"}


def check_committed(path: Path) -> dict[str, Any]:
    """Return the commit marker of a checkpoint directory, or say why there is none."""
    if not path.exists():
        raise CheckpointNotFound(f"{path}: no checkpoint here (the path does not exist)")
    if not path.is_dir():
        raise CheckpointNotFound(f"{path}: not a checkpoint directory (it is a file)")
    if is_temporary_name(path.name):
        raise IncompleteCheckpoint(
            f"{path}: a temporary directory (an unfinished save or a deletion in progress), "
            "never a checkpoint"
        )
    if not (path / COMMIT_MARKER).exists():
        if (path / DCP_METADATA).exists() and not (path / MANIFEST).exists():
            raise CheckpointNotFound(
                f"{path}: a stock torch.distributed.checkpoint directory, not a functional_ckpt "
                "checkpoint: it has no checksums to verify (fc.restore reads it with a template)"
            )
        if (path / MANIFEST).exists():
            raise IncompleteCheckpoint(
                f"{path}: the checkpoint was never committed ({COMMIT_MARKER} is missing); "
                "it was interrupted or is still being written"
            )
        raise CheckpointNotFound(f"{path}: not a checkpoint (no {COMMIT_MARKER} or {MANIFEST})")
    raw = _read_small(path / COMMIT_MARKER, LIMITS.marker_bytes, "commit marker")
    marker = codec.decode(raw, source=str(path / COMMIT_MARKER))
    if (
        not isinstance(marker, dict)
        or set(marker) != _MARKER_KEYS
        or marker.get("format") != FORMAT_NAME
    ):
        raise CorruptCheckpoint(f"{path / COMMIT_MARKER}: not a functional_ckpt commit marker")
    version = marker.get("version")
    if type(version) is not int or version < 1:
        raise CorruptCheckpoint(f"{path / COMMIT_MARKER}: invalid format version {version!r}")
    if version > FORMAT_VERSION:
        raise CorruptCheckpoint(
            f"{path}: written by a newer format (version {version!r}; this reader knows "
            f"{FORMAT_VERSION}); upgrade functional_ckpt to read it"
        )
    return marker


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and authenticate the manifest of a committed checkpoint."""
    marker = check_committed(path)
    expected = marker.get("manifest_size")
    limit = expected if type(expected) is int and 0 <= expected <= MAX_MANIFEST_BYTES else 0
    raw = _read_small(path / MANIFEST, limit, "manifest")
    if len(raw) != marker.get("manifest_size") or crc32(raw) != marker.get("manifest_crc32"):
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: the manifest does not match its checksum in {COMMIT_MARKER} "
            f"({len(raw)} bytes); the checkpoint is damaged"
        )
    manifest = codec.decode(raw, source=str(path / MANIFEST))
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_NAME:
        raise CorruptCheckpoint(f"{path / MANIFEST}: not a functional_ckpt manifest")
    version = manifest.get("version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CorruptCheckpoint(
            f"{path / MANIFEST}: format version {version!r} is newer than this reader's "
            f"({FORMAT_VERSION}); upgrade functional_ckpt to read it"
        )
    return manifest


def safe_member(root: Path, name: object) -> Path:
    """Resolve a file name from a manifest, refusing anything outside ``root``."""
    if (
        not isinstance(name, str)
        or not name
        or name in (".", "..")
        or "/" in name
        or "\\" in name
        or "\x00" in name
    ):
        raise UnsafeCheckpoint(f"{root}: the manifest names an unsafe file {name!r}")
    path = root / name
    if path.is_symlink():
        raise UnsafeCheckpoint(f"{path}: checkpoint files may not be symbolic links")
    return path


# --------------------------------------------------------------------------- DCP metadata

_DCP_MD = "torch.distributed.checkpoint.metadata"
_ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}


def _allowed() -> dict[tuple[str, str], Any]:
    if _ALLOWED_GLOBALS:
        return _ALLOWED_GLOBALS
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization as ser

    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ):
        if hasattr(dcp_md, name):
            _ALLOWED_GLOBALS[(_DCP_MD, name)] = getattr(dcp_md, name)
    _ALLOWED_GLOBALS[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = (
        dcp_fs._StorageInfo
    )
    _ALLOWED_GLOBALS[("torch", "Size")] = torch.Size
    _ALLOWED_GLOBALS[("torch.serialization", "_get_layout")] = ser._get_layout
    _ALLOWED_GLOBALS[("collections", "OrderedDict")] = collections.OrderedDict
    for cls in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"):
        _ALLOWED_GLOBALS[("pathlib", cls)] = getattr(pathlib, cls)
        _ALLOWED_GLOBALS[("pathlib._local", cls)] = getattr(pathlib, cls)
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            _ALLOWED_GLOBALS[("torch", name)] = obj
    return _ALLOWED_GLOBALS


class SafeMetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` admitting only DCP's own plain-data classes."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _allowed().get((module, name))
        if obj is None:
            raise UnsafeCheckpoint(
                f"refusing to load {module}.{name}: DCP metadata may only hold DCP's own "
                "metadata classes (the file may be hostile)"
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpoint("refusing persistent ids in DCP metadata")


def read_dcp_metadata(path: Path) -> Any:
    """Load DCP's ``.metadata`` of checkpoint ``path`` without running foreign code."""
    import torch.distributed.checkpoint.metadata as dcp_md

    md_path = path / DCP_METADATA
    raw = _read_small(md_path, MAX_DCP_METADATA_BYTES, "DCP metadata")
    return parse_dcp_metadata(raw, md_path, dcp_md.Metadata)


def parse_dcp_metadata(raw: bytes, source: Path, expected: type) -> Any:
    try:
        md = SafeMetadataUnpickler(io.BytesIO(raw)).load()
    except UnsafeCheckpoint as e:
        raise UnsafeCheckpoint(f"{source}: {e}") from None
    except Exception as e:  # any malformed pickle
        raise CorruptCheckpoint(f"{source}: unreadable DCP metadata ({e})") from None
    if not isinstance(md, expected):
        raise CorruptCheckpoint(f"{source}: not DCP metadata (got {type(md).__name__})")
    return md
