"""The checkpoint directory: its files, its commit protocol, and safe reads of it.

A checkpoint is a directory that becomes visible only once complete. It is written
as ``<name>.tmp-<id>/``; every file is fsynced, the commit marker is written last
(it records the manifest's size and checksum, so a torn or altered manifest is
caught), the directory is fsynced, renamed into place and its parent fsynced.
Readers accept only directories that carry a valid marker, and open every file
of one through :func:`open_member`: without following links, without blocking,
checked to be a regular file of the recorded size before a byte is read. A
reader holds the directory open (:class:`Checkpoint`) and opens every member
through it up front, so it reads one consistent checkpoint even while a writer
replaces the path.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from functional_ckpt import codec
from functional_ckpt.checksum import crc32
from functional_ckpt.errors import (
    CheckpointError,
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
#: Upper bound on the manifest and marker sizes a reader accepts (hostile files).
MAX_MANIFEST_BYTES = LIMITS.manifest_bytes
MAX_MARKER_BYTES = LIMITS.marker_bytes


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


def make_dirs(path: Path) -> None:
    """``mkdir -p`` whose every newly created directory is durable in its parent."""
    missing: list[Path] = []
    probe = path
    while not probe.is_dir():
        if probe.exists() or probe.is_symlink():
            raise NotADirectoryError(errno.ENOTDIR, "not a directory", str(probe))
        missing.append(probe)
        if probe.parent == probe:
            break
        probe = probe.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        fsync_dir(d.parent)


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


def commit(
    tmp: Path,
    final: Path,
    *,
    overwrite: bool,
    replaceable: Callable[[Path], None] | None = None,
) -> None:
    """Make a fully written ``tmp`` directory visible as ``final``, atomically.

    With ``overwrite`` an existing ``final`` stays readable until the new one has
    taken its place (an atomic exchange where the OS offers it; otherwise the old
    one is moved aside for the shortest possible moment and put back on failure).
    ``replaceable(final)`` raises if what is there may not be replaced (checked
    again here, right before the exchange).
    """
    fsync_dir(tmp)
    parent = final.parent
    if final.exists() or final.is_symlink():
        if not overwrite:
            raise CheckpointExists(
                f"{final}: a checkpoint already exists here; pass overwrite=True to replace it"
            )
        if replaceable is not None:
            replaceable(final)
        elif not final.is_dir() or final.is_symlink():
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


# --------------------------------------------------------------------------- overwrite scope


def checkpoint_like(path: Path) -> bool:
    """Is the directory ``path`` something a checkpoint save may replace?

    A committed checkpoint of this format, an uncommitted one (only our files), a
    stock DCP checkpoint (``.metadata`` and ``*.distcp`` files only), or nothing.
    A directory holding anything else (a manager root, a source tree) is not.
    """
    try:
        names = os.listdir(path)
    except OSError:
        return False
    ours = {COMMIT_MARKER, MANIFEST, DCP_METADATA}
    for name in names:
        if name in ours or (name.endswith(".distcp") and "/" not in name):
            try:
                st = os.lstat(path / name)
            except OSError:
                return False
            if not stat.S_ISREG(st.st_mode):
                return False
            continue
        return False
    return not names or DCP_METADATA in names or MANIFEST in names


def check_replaceable(path: Path) -> None:
    """Refuse to replace anything at ``path`` but a checkpoint or an empty directory."""
    if path.is_symlink() or not path.is_dir():
        raise CheckpointExists(f"{path}: exists and is not a checkpoint directory; left intact")
    if not checkpoint_like(path):
        raise CheckpointExists(
            f"{path}: exists and is not a checkpoint (it holds other files, e.g. a "
            "checkpoint root or a source tree); overwrite=True replaces only a checkpoint or "
            "an empty directory, so it was left intact: choose another path or remove it"
        )


# --------------------------------------------------------------------------- opening files

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return "not a regular file"


def _check_mode(mode: int, where: Path, what: str) -> None:
    if stat.S_ISLNK(mode):
        raise UnsafeCheckpoint(f"{where}: checkpoint files may not be symbolic links ({what})")
    if not stat.S_ISREG(mode):
        raise UnsafeCheckpoint(
            f"{where}: the {what} is {_kind(mode)}, not a regular file; the checkpoint is "
            "damaged or hostile (a special file would block or mislead a reader)"
        )


def open_member(
    dir_fd: int, name: str, where: Path, *, size: int | None = None, what: str = "file"
) -> int:
    """Open one file of a checkpoint for reading, safely: the only way any is opened.

    Never follows a link, never blocks (a FIFO or device in place of a file would
    hang a plain ``open``), and checks that it is a regular file of the recorded
    ``size`` before a byte is read; the returned descriptor is blocking again.
    ``FileNotFoundError`` is left to the caller (missing or replaced?).
    """
    _check_mode(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode, where, what)
    try:
        fd = os.open(name, _OPEN_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UnsafeCheckpoint(f"{where}: checkpoint files may not be symbolic links") from None
        if e.errno in (errno.ENXIO, errno.EISDIR, errno.ENOTDIR):
            raise UnsafeCheckpoint(f"{where}: the {what} is not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        _check_mode(st.st_mode, where, what)
        if size is not None and st.st_size != size:
            raise CorruptCheckpoint(
                f"{where}: file is {st.st_size} bytes, the manifest recorded {size} "
                "(truncated or replaced)"
            )
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_exact(fd: int, size: int, where: Path) -> bytes:
    """All ``size`` bytes of an opened file (its size was checked when it was opened)."""
    parts: list[bytes] = []
    done = 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 16 << 20), done)
        if not chunk:
            raise CorruptCheckpoint(f"{where}: only {done} of {size} bytes could be read")
        parts.append(chunk)
        done += len(chunk)
    return b"".join(parts)


def crc32_fd(fd: int, size: int) -> int:
    """CRC32 of the first ``size`` bytes of an opened file, read in large chunks."""
    crc = 0
    done = 0
    while done < size:
        chunk = os.pread(fd, min(size - done, 16 << 20), done)
        if not chunk:
            return -1  # shorter than recorded: cannot match
        crc = crc32(chunk, crc)
        done += len(chunk)
    return crc


def _exists(dir_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def open_directory(path: Path) -> int:
    """A descriptor of the checkpoint directory ``path`` (the caller closes it)."""
    if is_temporary_name(path.name):
        raise IncompleteCheckpoint(
            f"{path}: a temporary directory (an unfinished save or a deletion in progress), "
            "never a checkpoint"
        )
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{path}: no checkpoint here (the path does not exist)") from None
    except NotADirectoryError:
        raise CheckpointNotFound(f"{path}: not a checkpoint directory (it is a file)") from None
    except OSError as e:
        raise CheckpointNotFound(f"{path}: cannot open the checkpoint directory: {e}") from None


_MARKER_KEYS = {"format", "version", "manifest_size", "manifest_crc32"}


def _read_small(dir_fd: int, path: Path, name: str, limit: int, what: str) -> bytes:
    where = path / name
    try:
        fd = open_member(dir_fd, name, where, what=what)
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{where}: the {what} is missing") from None
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise CorruptCheckpoint(
                f"{where}: the {what} is {size} bytes, more than the {limit} recorded or allowed"
            )
        return read_exact(fd, size, where)
    finally:
        os.close(fd)


def read_marker(dir_fd: int, path: Path) -> dict[str, Any]:
    """The commit marker of the directory held by ``dir_fd``, or why there is none."""
    if not _exists(dir_fd, COMMIT_MARKER):
        if _exists(dir_fd, DCP_METADATA) and not _exists(dir_fd, MANIFEST):
            raise CheckpointNotFound(
                f"{path}: a stock torch.distributed.checkpoint directory, not a functional_ckpt "
                "checkpoint: it has no checksums to verify (fc.restore reads it with a template)"
            )
        if _exists(dir_fd, MANIFEST):
            raise IncompleteCheckpoint(
                f"{path}: the checkpoint was never committed ({COMMIT_MARKER} is missing); "
                "it was interrupted or is still being written"
            )
        raise CheckpointNotFound(f"{path}: not a checkpoint (no {COMMIT_MARKER} or {MANIFEST})")
    raw = _read_small(dir_fd, path, COMMIT_MARKER, MAX_MARKER_BYTES, "commit marker")
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


def read_manifest_at(dir_fd: int, path: Path, marker: dict[str, Any]) -> dict[str, Any]:
    """Read and authenticate the manifest against its marker."""
    expected = marker.get("manifest_size")
    limit = expected if type(expected) is int and 0 <= expected <= MAX_MANIFEST_BYTES else 0
    raw = _read_small(dir_fd, path, MANIFEST, limit, "manifest")
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


@dataclass
class Checkpoint:
    """A committed checkpoint held open: its manifest and every file it lists.

    All files were opened through one directory descriptor before any tensor byte
    is read, so a reader sees one consistent checkpoint even if the path is
    replaced (``overwrite=True``) or pruned meanwhile. Close it (or use ``with``).
    """

    path: Path
    dir_fd: int
    manifest: dict[str, Any]
    fds: dict[str, int] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)

    def fd(self, name: str) -> int:
        try:
            return self.fds[name]
        except KeyError:
            raise CorruptCheckpoint(
                f"{self.path}: {name!r} is not a file of this checkpoint"
            ) from None

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()
        if self.dir_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.dir_fd)
            self.dir_fd = -1

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_members(ck: Checkpoint, problems: list[tuple[str, CheckpointError]] | None = None) -> None:
    """Open every file the manifest lists, checked against its recorded size.

    With ``problems`` each file that fails is recorded there (and left out)
    instead of raising, so a verifier can report them all.
    """
    files = ck.manifest.get("files")
    if not isinstance(files, dict):
        raise CorruptCheckpoint(f"{ck.path / MANIFEST}: missing file table")
    for name, info in files.items():
        member = safe_member(ck.path, name)
        size = info.get("size") if isinstance(info, dict) else None
        if type(size) is not int or size < 0:
            raise CorruptCheckpoint(f"{ck.path / MANIFEST}: bad entry for file {name!r}")
        # A derived file's size is checked with its checksum, to tell hostile from damaged.
        derived = name == DCP_METADATA
        try:
            try:
                fd = open_member(ck.dir_fd, name, member, size=None if derived else size)
            except FileNotFoundError:
                raise CorruptCheckpoint(f"{member}: file is missing from the checkpoint") from None
        except CheckpointError as err:
            if problems is None:
                raise
            problems.append((name, err))
            continue
        ck.fds[name] = fd
        ck.sizes[name] = os.fstat(fd).st_size if derived else size


def _replaced(path: Path, dir_fd: int, had_marker: bool) -> bool:
    """Was the directory we hold renamed away, replaced or deleted since we opened it?"""
    try:
        now = os.stat(path)
    except OSError:
        return True
    held = os.fstat(dir_fd)
    if (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
        return True
    return had_marker and not _exists(dir_fd, COMMIT_MARKER)


def open_checkpoint(
    path: Path,
    *,
    members: bool = True,
    problems: list[tuple[str, CheckpointError]] | None = None,
) -> Checkpoint:
    """Open a committed checkpoint: marker, manifest and (``members``) every listed file.

    If the directory is replaced or deleted before all its files are open (a
    writer's ``overwrite=True`` or a prune), this starts once more from what is
    at ``path`` now; a second race is reported as ``CheckpointNotFound``, never as
    damage. With ``problems``, files that cannot be opened are listed there
    instead of raising (see :func:`open_members`).
    """
    for attempt in (0, 1):
        dir_fd = open_directory(path)
        had_marker = False
        ck = Checkpoint(path, dir_fd, {})
        found: list[tuple[str, CheckpointError]] = []
        try:
            marker = read_marker(dir_fd, path)
            had_marker = True
            ck.manifest = read_manifest_at(dir_fd, path, marker)
            if members:
                open_members(ck, None if problems is None else found)
            if found and _replaced(path, dir_fd, had_marker):
                raise found[0][1]
            if problems is not None:
                problems += found
            return ck
        except (CheckpointError, OSError) as err:
            replaced = _replaced(path, dir_fd, had_marker)
            ck.close()
            if not replaced:
                if isinstance(err, CheckpointError):
                    raise
                raise CheckpointError(f"{path}: cannot read the checkpoint: {err}") from err
            if attempt:
                raise CheckpointNotFound(
                    f"{path}: the checkpoint was replaced or deleted while it was being read "
                    "(a writer overwrote or pruned it); read it again"
                ) from err
    raise AssertionError("unreachable")


def check_committed(path: Path) -> dict[str, Any]:
    """Return the commit marker of a checkpoint directory, or say why there is none."""
    dir_fd = open_directory(path)
    try:
        return read_marker(dir_fd, path)
    finally:
        os.close(dir_fd)


def read_manifest(path: Path) -> dict[str, Any]:
    """Read and authenticate the manifest of a committed checkpoint."""
    with open_checkpoint(path, members=False) as ck:
        return ck.manifest


def iter_names(dir_fd: int) -> Iterator[str]:
    """The names in a held directory."""
    yield from sorted(os.listdir(dir_fd))
