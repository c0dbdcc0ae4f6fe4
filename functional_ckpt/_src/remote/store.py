"""An object store reached through fsspec: its checkpoints' objects and its failures.

Every failure becomes a ``RemoteError`` naming the URL; fsspec is imported only here.
"""

from __future__ import annotations

import contextlib
import errno
import re
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.format.checksum import crc32
from functional_ckpt._src.format.naming import BRANCHES_DIR, parse_step, step_name
from functional_ckpt._src.limits import LIMITS
from functional_ckpt._src.remote.mover import Mover, _MovedFailure, facts_of, reaches
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import (
    CheckpointError,
    CorruptCheckpoint,
    IncompleteCheckpoint,
    RemoteAccessDenied,
    RemoteBucketMissing,
    RemoteError,
    RemoteUnreachable,
    RemoteVanished,
)

T = TypeVar("T")

_UNREACHABLE = ("connection", "timeout", "endpoint", "dns", "gaierror", "clientconnector")


def remote_error(err: BaseException, where: str) -> CheckpointError:
    """The :class:`RemoteError` a failure of the store at ``where`` stands for."""
    if isinstance(err, CheckpointError):
        return err
    facts = err.facts if isinstance(err, _MovedFailure) else facts_of(err)
    names, number = set(facts["names"]), facts["errno"]
    text, message = redact(str(facts["text"])), redact(str(facts["message"]))
    if "PermissionError" in names:
        return RemoteAccessDenied(
            f"{where}: the object store refused access ({text}); check the credentials "
            "(environment, ~/.aws, storage_options=) and the bucket's permissions"
        )
    if "FileNotFoundError" in names and _missing_bucket(message):
        return RemoteBucketMissing(
            f"{where}: the bucket does not exist ({message}); create it, or fix the remote URL"
        )
    if "FileNotFoundError" in names:
        return RemoteVanished(
            f"{where}: the object is gone ({message}); it was deleted while it was read"
        )
    lowered = " ".join(n.lower() for n in names)
    refused = "OSError" in names and number in (errno.ECONNREFUSED, errno.EHOSTUNREACH)
    if refused or "TimeoutError" in names or any(w in lowered for w in _UNREACHABLE):
        return RemoteUnreachable(
            f"{where}: the object store did not answer ({text}); check the endpoint URL "
            "(storage_options client_kwargs endpoint_url) and the network"
        )
    return RemoteError(f"{where}: {text}")


def public_url(url: str) -> str:
    """``url`` without its secrets (a user's password, a query's token)."""
    try:
        parts = urllib.parse.urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password is None and not parts.query and not parts.fragment:
        return url
    netloc = parts.netloc
    if password is not None:
        user, host = netloc.rsplit("@", 1)
        netloc = f"{user.split(':', 1)[0]}@{host}"
    query = "..." if parts.query else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc, query=query, fragment=""))


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>]+")


def redact(text: str) -> str:
    """``text`` (a store's own error message) with every URL in it made public."""
    return _URL.sub(lambda m: public_url(m.group(0)), text)


def _missing_bucket(message: str, path: str = "") -> bool:
    """Whether the store said the bucket is missing (not merely the object at ``path``)."""
    text = message.replace(path, "").lower() if path else message.lower()
    return "nosuchbucket" in text or (
        "bucket" in text and ("not exist" in text or "not found" in text)
    )


@dataclass
class RemoteStep:
    """The objects of one remote checkpoint directory: name -> size."""

    objects: dict[str, int] = field(default_factory=dict)

    @property
    def committed(self) -> bool:
        return naming.COMMIT_MARKER in self.objects


class Store:
    """One remote root: ``url`` (any fsspec URL) opened with ``storage_options``."""

    def __init__(self, url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        if not isinstance(url, str) or "://" not in url:
            raise ValueError(
                f"remote={url!r}: expected an fsspec URL such as 's3://bucket/prefix' "
                "or 'memory://name'"
            )
        scheme, _, rest = url.partition("://")
        full = f"{scheme}://{rest.rstrip('/')}"
        self.url = public_url(full)  # what messages and the status file show
        parts = rest.split("?", 1)[0].rstrip("/").split("/")
        if not rest.strip("/") or any(p in (".", "..") for p in parts):
            raise ValueError(
                f"remote={self.url!r}: name the directory of the remote root, without '.' or "
                "'..' (an object store does not resolve them), e.g. 's3://bucket/run1'"
            )
        try:
            import fsspec  # type: ignore[import-untyped]
        except ImportError:
            raise CheckpointError(
                f"remote={self.url!r} needs fsspec (and s3fs for s3://): "
                "pip install 'functional_ckpt[remote]'"
            ) from None
        options = dict(storage_options or {})
        with contextlib.suppress(ImportError, ValueError):  # unknown: ``url_to_fs`` says why
            if getattr(fsspec.get_filesystem_class(scheme), "local_file", False):
                options.setdefault("auto_mkdir", True)  # a directory, as on an object store
        try:
            self.fs, path = fsspec.core.url_to_fs(full, **options)
        except ImportError as e:
            raise CheckpointError(f"remote={self.url!r}: {e}") from None
        except Exception as e:
            raise remote_error(e, self.url) from e
        self.base = str(path).rstrip("/")
        self.mover = Mover(full, options if reaches(self.fs) else None)
        self.start_uploads, self.close = self.mover.start, self.mover.close
        self.pause_uploads, self.resume_uploads = self.mover.pause, self.mover.resume

    def __repr__(self) -> str:
        return f"Store({self.url!r})"

    def call(self, where: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args)`` with the store's failures as :class:`RemoteError`."""
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise remote_error(e, where) from e

    def put(self, where: str, lpaths: list[str], rpaths: list[str]) -> None:
        """Upload local files to objects, in parallel (in the helper process if any)."""
        self.call(where, self.mover.put if self.mover.start() else self.fs.put, lpaths, rpaths)

    def step_dir(self, step: int) -> str:
        return f"{self.base}/{step_name(step)}"

    def object_path(self, step: int, name: str) -> str:
        return f"{self.step_dir(step)}/{name}"

    def where(self, step: int, name: str | None = None) -> str:
        """A URL for messages: the checkpoint directory or one of its objects."""
        tail = step_name(step) if name is None else f"{step_name(step)}/{name}"
        return f"{self.url}/{tail}"

    def _fresh(self) -> None:
        invalidate = getattr(self.fs, "invalidate_cache", None)
        if invalidate is not None:
            invalidate()

    def _or_none(self, fn: Callable[[str], T], path: str, where: str) -> T | None:
        """``fn(path)``; None if nothing is there yet (a missing bucket is a failure)."""
        try:
            return fn(path)
        except FileNotFoundError as e:
            if _missing_bucket(str(e), path):
                raise remote_error(e, where) from e
            return None
        except Exception as e:
            raise remote_error(e, where) from e

    def _ls(self, path: str, where: str) -> list[dict[str, Any]]:
        """``ls`` (not ``find``, which some stores answer with nothing on any error)."""
        return list(self._or_none(lambda p: self.fs.ls(p, detail=True), path, where) or [])

    def listing(self) -> dict[int, RemoteStep]:
        """Every ``step_N`` directory of the remote root with its objects."""
        self._fresh()
        steps: dict[int, RemoteStep] = {}
        for info in self._ls(self.base, self.url):
            step = parse_step(str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1])
            if step is not None and info.get("type") == "directory":
                objects = self.objects(step, fresh=False)
                if objects:  # an empty prefix left by a deletion is nothing
                    steps[step] = RemoteStep(objects)
        return steps

    def branches(self) -> set[str]:
        """The names under ``url/branches/``, where rollbacks set remote steps aside."""
        self._fresh()
        found = self._ls(f"{self.base}/{BRANCHES_DIR}", f"{self.url}/{BRANCHES_DIR}")
        return {str(i.get("name", "")).rstrip("/").rsplit("/", 1)[-1] for i in found}

    def objects(self, step: int, *, fresh: bool = True) -> dict[str, int]:
        """The objects of one remote checkpoint directory (name -> size)."""
        if fresh:
            self._fresh()
        out = {}
        for info in self._ls(self.step_dir(step), self.where(step)):
            if info.get("type") == "directory":
                continue
            size = info.get("size")
            name = str(info.get("name", "")).rsplit("/", 1)[-1]
            out[name] = int(size) if isinstance(size, int) else -1
        return out

    def read_root(self, name: str) -> bytes | None:
        """An object beside the checkpoints (``url/name``); None if there is none."""
        data = self._or_none(self.fs.cat_file, f"{self.base}/{name}", f"{self.url}/{name}")
        return None if data is None else bytes(data)

    def write_root(self, name: str, data: bytes) -> None:
        self.call(f"{self.url}/{name}", self.fs.pipe_file, f"{self.base}/{name}", data)

    def read(self, step: int, name: str) -> bytes:
        data = self.call(self.where(step, name), self.fs.cat_file, self.object_path(step, name))
        return bytes(data)

    def write(self, step: int, name: str, data: bytes) -> None:
        self.call(self.where(step, name), self.fs.pipe_file, self.object_path(step, name), data)

    def remove(self, step: int, names: list[str]) -> None:
        for name in names:
            try:
                self.fs.rm_file(self.object_path(step, name))
            except FileNotFoundError:
                continue
            except Exception as e:
                raise remote_error(e, self.where(step, name)) from e

    def manifest(self, step: int) -> tuple[bytes, dict[str, Any]]:
        """The marker's bytes and the manifest it authenticates (committed checkpoints only)."""
        where = self.where(step)
        found = self.objects(step)  # sizes first: no object is read past what it may hold
        marker_size = found.get(naming.COMMIT_MARKER)
        uncommitted = (
            f"{where}: not a committed remote checkpoint ({naming.COMMIT_MARKER} is missing)"
        )
        if marker_size is None:
            raise IncompleteCheckpoint(uncommitted)
        if not 0 <= marker_size <= LIMITS.marker_bytes:
            raise CorruptCheckpoint(
                f"{self.where(step, naming.COMMIT_MARKER)}: {marker_size} bytes, too large for "
                "a commit marker; the remote checkpoint is damaged"
            )
        try:
            marker_bytes = self.read(step, naming.COMMIT_MARKER)
        except RemoteVanished:
            raise IncompleteCheckpoint(uncommitted) from None
        marker = decode_small(marker_bytes, self.where(step, naming.COMMIT_MARKER))
        size = marker.get("manifest_size")
        if not isinstance(size, int) or not 0 <= size <= committed.MAX_MANIFEST_BYTES:
            raise CorruptCheckpoint(f"{where}: the commit marker records no valid manifest size")
        if found.get(naming.MANIFEST) != size:
            have = found.get(naming.MANIFEST)
            raise CorruptCheckpoint(
                f"{self.where(step, naming.MANIFEST)}: "
                f"{'missing' if have is None else f'{have} bytes'}, the commit marker records "
                f"{size} bytes; the remote checkpoint is damaged (or being deleted)"
            )
        raw = self.read(step, naming.MANIFEST)
        if len(raw) != size or crc32(raw) != marker.get("manifest_crc32"):
            raise CorruptCheckpoint(
                f"{self.where(step, naming.MANIFEST)}: the manifest does not match its checksum "
                f"in {naming.COMMIT_MARKER}; the remote checkpoint is damaged"
            )
        manifest = decode_small(raw, self.where(step, naming.MANIFEST))
        if manifest.get("format") != naming.FORMAT_NAME or not isinstance(
            manifest.get("files"), dict
        ):
            raise CorruptCheckpoint(f"{where}: not a functional_ckpt manifest")
        return marker_bytes, manifest


def decode_small(raw: bytes, where: str) -> dict[str, Any]:
    """A marker or manifest decoded by the exact codec (never pickle)."""
    if len(raw) > committed.MAX_MANIFEST_BYTES:
        raise CorruptCheckpoint(f"{where}: {len(raw)} bytes, more than a manifest may hold")
    value = codec.decode(raw, source=where, unregistered=set())  # a placeholder is no damage
    if not isinstance(value, dict):
        raise CorruptCheckpoint(f"{where}: not a msgpack map")
    return value
