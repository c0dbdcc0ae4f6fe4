"""``torch.save`` files (``.pt``/``.pth``) in and out, never running code from one: a
file is read with ``torch.load(weights_only=True)``, and an export holds only what
that reader builds, so it loads that way too."""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import struct
import time
import warnings
import zipfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt._src.export import safetensors as st
from functional_ckpt._src.format.keys import KeyPath, format_path
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.save.api import save
from functional_ckpt._src.save.info import CheckpointInfo
from functional_ckpt._src.state.tree import to_python
from functional_ckpt._src.storage import durable
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    UnsafeCheckpoint,
)

__all__ = ["WEIGHTS_KEY", "export_torch", "import_torch", "load_torch_file", "loadable"]

#: Where a bare ``state_dict`` lands in an imported state.
WEIGHTS_KEY = "model"

#: Leaf types ``torch.load(weights_only=True)`` rebuilds (exact types: a subclass is
#: pickled by its class name, which that reader refuses).
_PLAIN_LEAVES: tuple[type, ...] = (type(None), bool, int, float, complex, str, bytes, bytearray)
_PLAIN_LEAVES += (torch.Size, torch.dtype, torch.device)
#: What ``torch.load`` raises on bytes that are no torch.save file: a bad zip or stream, or
#: what the unpickler trips over in bytes that are no pickle (a memo index, a stack slot).
_UNREADABLE: tuple[type[BaseException], ...] = (RuntimeError, EOFError, ValueError, OSError)
_UNREADABLE += (zipfile.BadZipFile, LookupError, TypeError, AttributeError, AssertionError)
_UNREADABLE += (struct.error, MemoryError, RecursionError)


def load_torch_file(path: PathLike) -> Any:
    """What a ``torch.save`` file holds, read with ``weights_only=True``: a pickle naming
    anything outside torch's safe set raises :class:`UnsafeCheckpoint`, other bytes
    :class:`CheckpointError`."""
    src = Path(path)
    try:
        mode = os.stat(src).st_mode
    except FileNotFoundError:
        raise CheckpointNotFound(f"{src}: no such file") from None
    if not stat.S_ISREG(mode):
        hint = " (a checkpoint directory is read with fc.restore)" if stat.S_ISDIR(mode) else ""
        raise CheckpointError(f"{src}: not a regular file{hint}; expected a torch.save file")
    try:
        # mmap: tensors are read from the page cache as fc.save copies them, not first
        # into memory; the legacy (non-zip) format cannot be mapped.
        with warnings.catch_warnings():  # bytes that are no pickle: an error follows
            warnings.filterwarnings("ignore", message="Detected pickle protocol")
            return torch.load(
                src, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(src)
            )
    except pickle.UnpicklingError as exc:
        text = str(exc)
        # the line of torch's refusal that names what was refused, if there is one
        named = [ln.strip() for ln in text.splitlines() if "GLOBAL" in ln or "Unsupported" in ln]
        reason = f" ({named[0].rstrip('.')})" if named else ""
        if "Weights only load failed" in text and "GLOBAL" in reason:
            raise UnsafeCheckpoint(
                f"{src}: refused: the file holds pickled objects that "
                f"torch.load(weights_only=True) does not build{reason}; nothing in it "
                "was run. Load it with weights_only=False only if you trust its source, "
                "then save the state with fc.save"
            ) from None
        detail = reason.strip(" ()") or _first_line(text)
        raise CheckpointError(f"{src}: not a torch.save file ({detail})") from None
    except _UNREADABLE as exc:
        why = f"{type(exc).__name__}: {_first_line(str(exc))}"
        raise CheckpointError(f"{src}: not a readable torch.save file ({why})") from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")


def is_bare_state_dict(obj: Any) -> bool:
    """A non-empty mapping of names to tensors, as ``module.state_dict()`` returns."""
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def import_torch(src: PathLike, out: PathLike, *, overwrite: bool = False) -> CheckpointInfo:
    """Read a ``torch.save`` file safely and write what it holds as a checkpoint at ``out``."""
    path = Path(src)
    obj = load_torch_file(path)
    if is_bare_state_dict(obj):
        obj = {WEIGHTS_KEY: obj}
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{path}: holds a {type(obj).__name__}, not a state_dict or a checkpoint dict; "
            "load it with torch.load, put it in a dict and save that with fc.save"
        )
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise CheckpointError(
            f"{path}: the top-level keys must be strings to become a state; found {bad[0]!r}"
        )
    imported = {"imported": {"from": str(path), "format": "torch"}}
    return save(out, obj, metadata=imported, overwrite=overwrite)


def _weights(source: PathLike, select: KeyPath, dtype: torch.dtype | None) -> dict[str, Any]:
    """What ``load_state_dict`` takes: a captured module's ``OrderedDict`` keeps ``_metadata``."""
    state = st._load(source, select)
    tensors = st._collect(state, select)
    node = st.subtree(state, select)
    python: Any = to_python(node) if isinstance(node, TensorDictBase) else None
    weights: dict[str, Any] = {}
    if is_bare_state_dict(python) and python.keys() == tensors.keys():
        tensors = dict(python)
        if isinstance(python, OrderedDict):
            weights = OrderedDict()
            if hasattr(python, "_metadata"):
                weights._metadata = python._metadata  # type: ignore[attr-defined]
    for name, t in tensors.items():
        weights[name] = t.to(st._out_dtype(t, dtype))
    return weights


def loadable(value: Any, path: KeyPath, converted: list[KeyPath]) -> Any:
    """``value`` as ``torch.load(weights_only=True)`` reads it back exactly: numpy values
    become tensors and numbers (their paths added to ``converted``); anything else
    it cannot build raises :class:`CheckpointError` naming its key path.
    """
    import numpy as np

    kind = type(value)
    if isinstance(value, torch.Tensor):
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            raise CheckpointError(
                f"state[{format_path(path)}]: a {kind.__name__} cannot be exported as a "
                "torch file that loads with weights_only=True; export plain tensors"
            )
        return value
    if kind in _PLAIN_LEAVES:
        return value
    if kind is np.ndarray or isinstance(value, np.generic):
        try:
            out = torch.from_numpy(np.array(value)) if kind is np.ndarray else value.item()
        except TypeError:
            out = None
        if isinstance(out, torch.Tensor) or type(out) in _PLAIN_LEAVES:
            converted.append(path)
            return out
    if kind in (dict, OrderedDict):
        mapping = kind()
        for k, v in value.items():
            mapping[loadable(k, (*path, repr(k)), converted)] = loadable(
                v, (*path, str(k)), converted
            )
        if hasattr(value, "_metadata"):
            meta = loadable(value._metadata, (*path, "_metadata"), converted)
            mapping._metadata = meta  # type: ignore[attr-defined]
        return mapping
    if kind in (list, tuple, set):
        return kind(loadable(v, (*path, str(i)), converted) for i, v in enumerate(value))
    raise CheckpointError(
        f"state[{format_path(path)}]: a {kind.__module__}.{kind.__qualname__} value; "
        "torch.load(weights_only=True) refuses it, so the export would not load safely. "
        "Export the weights only (without full), or convert the value to plain data "
        "(str, int, float, list, dict) in the state first"
    )


def write_torch_file(obj: Any, out: Path, *, overwrite: bool) -> Path:
    """``torch.save`` to ``out`` atomically and durably; never into a directory or a checkpoint."""
    for parent in out.parents:  # a checkpoint's files are never replaced, and none joins them
        if (kind := classify(parent)).checkpoint and kind is not Kind.EXPORT:
            raise CheckpointExists(f"{out}: inside {kind.value} ({parent}); choose another path")
    if out.is_dir() and not out.is_symlink():
        raise CheckpointExists(f"{out}: is a directory; give the path of the file to write")
    if out.exists() and not overwrite:
        raise CheckpointExists(f"{out}: already exists; pass overwrite=True to replace it")
    durable.make_dirs(out.parent)
    tmp = durable.tmp_sibling(out)
    try:
        with os.fdopen(durable.open_new(tmp), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if out appeared meanwhile: nothing is replaced
            os.unlink(tmp)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, FileExistsError):
            raise CheckpointExists(f"{out}: already exists; pass overwrite=True") from None
        raise
    durable.fsync_dir(out.parent)
    return out


def export_torch(
    checkpoint: PathLike,
    out: PathLike,
    *,
    select: str | Sequence[str] | None = "model",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> list[KeyPath]:
    """Write a checkpoint's weights (``select``; ``dtype`` converts floating ones) or
    whole state (``select=None``, see :func:`loadable`) as a ``torch.save`` file that
    ``weights_only=True`` reads back bit-exactly; returns the converted key paths.
    """
    dest, t0 = Path(out), time.perf_counter()
    obj: Any
    if select is None:
        if dtype is not None:
            raise ValueError("export_torch: dtype converts weights; the full state stays exact")
        obj = to_python(restore(checkpoint))
    else:
        obj = _weights(checkpoint, st._select_path(select), dtype)
    converted: list[KeyPath] = []
    obj = loadable(obj, (), converted)
    write_torch_file(obj, dest, overwrite=overwrite)
    st.logged(dest, t0)
    return converted
