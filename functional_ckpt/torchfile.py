"""Bridges to ``torch.save`` files (``.pt``/``.pth``): import one as a checkpoint, export one.

Users arrive with ``.pt`` files and leave with them. Both directions keep the
package's promise of never running code from a file: a ``.pt`` file is read with
``torch.load(weights_only=True)``, which builds only tensors and plain containers
and refuses a pickle that names anything else, and an export holds only what that
reader accepts, so the file it writes loads with ``weights_only=True`` too.

* import: a bare ``state_dict`` (a mapping of tensors only) becomes the state's
  ``model`` subtree, the layout ``fc.capture(model=...)`` gives; any other mapping
  (a training checkpoint: Lightning's ``{"state_dict", "optimizer_states",
  "epoch", ...}``, nested dicts of tensors and values) is the state as it is.
* export: the tensors under ``select`` by their dotted ``state_dict`` names (what
  ``model.load_state_dict`` takes), or the whole state as nested Python
  containers (``full``). The file appears atomically: written under a temporary
  name, fsynced, renamed, its directory fsynced.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import stat
import zipfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt import format
from functional_ckpt._types import PathLike
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointNotFound,
    UnsafeCheckpoint,
)
from functional_ckpt.export import _collect, _load, _select_path
from functional_ckpt.io import CheckpointInfo, restore, save
from functional_ckpt.tree import KeyPath, format_path, to_python

__all__ = ["WEIGHTS_KEY", "export_torch", "import_torch", "load_torch_file"]

#: Where a bare ``state_dict`` lands in an imported state.
WEIGHTS_KEY = "model"

#: Leaf types ``torch.load(weights_only=True)`` rebuilds (exact types: a subclass is
#: pickled by its class name, which that reader refuses).
_PLAIN_LEAVES = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    bytearray,
    torch.Size,
    torch.dtype,
    torch.device,
)
_CONTAINERS = (dict, OrderedDict, list, tuple, set)


# --------------------------------------------------------------------------- import


def load_torch_file(path: PathLike) -> Any:
    """What a ``torch.save`` file holds, read with ``weights_only=True`` (no code runs).

    A pickle that names a function or class outside torch's safe set raises
    :class:`UnsafeCheckpoint` and nothing of it runs; a file that is not a
    ``torch.save`` file raises :class:`CheckpointError`.
    """
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
        return torch.load(src, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(src))
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Weights only load failed" in text:
            reason = _refusal_reason(text)
            raise UnsafeCheckpoint(
                f"{src}: refused: the file holds pickled objects that "
                f"torch.load(weights_only=True) does not build{reason}; nothing in it "
                "was run. Load it with weights_only=False only if you trust its source, "
                "then save the state with fc.save"
            ) from None
        raise CheckpointError(f"{src}: not a torch.save file ({_first_line(text)})") from None
    except (RuntimeError, EOFError, ValueError, OSError, zipfile.BadZipFile) as exc:
        raise CheckpointError(
            f"{src}: not a readable torch.save file ({_first_line(str(exc))})"
        ) from None


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "unknown error")


def _refusal_reason(text: str) -> str:
    """The line of torch's refusal that names what was refused, if there is one."""
    for line in text.splitlines():
        line = line.strip()
        if "GLOBAL" in line or "Unsupported" in line:
            return f" ({line.rstrip('.')})"
    return ""


def is_bare_state_dict(obj: Any) -> bool:
    """A non-empty mapping of names to tensors, as ``module.state_dict()`` returns."""
    return (
        isinstance(obj, Mapping)
        and bool(obj)
        and all(isinstance(k, str) for k in obj)
        and all(isinstance(v, torch.Tensor) for v in obj.values())
    )


def state_of(obj: Any, src: Path) -> Mapping[str, Any]:
    """The state an imported object becomes (see the module's docstring)."""
    if is_bare_state_dict(obj):
        return {WEIGHTS_KEY: obj}
    if not isinstance(obj, Mapping):
        raise CheckpointError(
            f"{src}: holds a {type(obj).__name__}, not a state_dict or a checkpoint dict; "
            "load it with torch.load, put it in a dict and save that with fc.save"
        )
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise CheckpointError(
            f"{src}: the top-level keys must be strings to become a state; found {bad[0]!r}"
        )
    return obj


def import_torch(src: PathLike, out: PathLike, *, overwrite: bool = False) -> CheckpointInfo:
    """Read a ``torch.save`` file safely and write what it holds as a checkpoint at ``out``."""
    path = Path(src)
    state = state_of(load_torch_file(path), path)
    return save(
        out,
        state,
        metadata={"imported": {"from": str(path), "format": "torch"}},
        overwrite=overwrite,
    )


# --------------------------------------------------------------------------- export


def _weights(source: PathLike, select: KeyPath, dtype: torch.dtype | None) -> dict[str, Any]:
    """The tensors under ``select`` by dotted name: what ``load_state_dict`` takes.

    A subtree captured from a module comes back as its ``OrderedDict`` with
    ``_metadata`` (the per-module versions ``load_state_dict`` consults).
    """
    state = _load(source, select)
    tensors = _collect(state, select)
    node: Any = state
    for key in select:
        node = node.get(key)
    python: Any = to_python(node) if isinstance(node, TensorDictBase) else None
    weights: dict[str, Any] = {}
    if is_bare_state_dict(python) and python.keys() == tensors.keys():
        tensors = dict(python)
        if isinstance(python, OrderedDict):
            weights = OrderedDict()
            if hasattr(python, "_metadata"):
                weights._metadata = python._metadata  # type: ignore[attr-defined]
    for name, t in tensors.items():
        weights[name] = t.to(dtype) if dtype is not None and t.is_floating_point() else t
    return weights


def check_loadable(value: Any, path: KeyPath = ()) -> None:
    """Refuse a value that ``torch.load(weights_only=True)`` could not read back."""
    kind = type(value)
    if isinstance(value, torch.Tensor):
        if kind is not torch.Tensor and kind is not torch.nn.Parameter:
            raise CheckpointError(
                f"state[{format_path(path)}]: a {kind.__name__} cannot be exported as a "
                "torch file that loads with weights_only=True; export plain tensors"
            )
        return
    if kind in _CONTAINERS:
        if isinstance(value, Mapping):
            for k, v in value.items():
                check_loadable(k, (*path, repr(k)))
                check_loadable(v, (*path, str(k)))
            if hasattr(value, "_metadata"):
                check_loadable(value._metadata, (*path, "_metadata"))
        else:
            for i, v in enumerate(value):
                check_loadable(v, (*path, str(i)))
        return
    if kind not in _PLAIN_LEAVES:
        raise CheckpointError(
            f"state[{format_path(path)}]: a {kind.__module__}.{kind.__qualname__} value; "
            "torch.load(weights_only=True) refuses it, so the export would not load safely. "
            "Export the weights only (without full), or convert the value to plain data "
            "(str, int, float, list, dict) in the state first"
        )


def write_torch_file(obj: Any, out: Path, *, overwrite: bool) -> Path:
    """``torch.save`` to ``out`` atomically and durably; never replaces a directory."""
    if out.is_dir() and not out.is_symlink():
        raise CheckpointExists(f"{out}: is a directory; give the path of the file to write")
    if out.exists() and not overwrite:
        raise CheckpointExists(f"{out}: already exists; pass overwrite=True to replace it")
    format.make_dirs(out.parent)
    tmp = format.tmp_sibling(out)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if overwrite:
            os.replace(tmp, out)
        else:
            os.link(tmp, out)  # fails if out appeared meanwhile: nothing is replaced
            os.unlink(tmp)
    except FileExistsError:
        _remove(tmp)
        raise CheckpointExists(
            f"{out}: already exists; pass overwrite=True to replace it"
        ) from None
    except BaseException:
        _remove(tmp)
        raise
    format.fsync_dir(out.parent)
    return out


def _remove(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def export_torch(
    checkpoint: PathLike,
    out: PathLike,
    *,
    select: str | Sequence[str] | None = "model",
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
) -> Path:
    """Write a checkpoint's weights (``select``) or whole state (``select=None``) as a
    ``torch.save`` file that ``torch.load(weights_only=True)`` reads back bit-exactly.

    ``dtype`` converts floating-point weights; the whole state is always exported as
    saved. Only the selected subtree is read.
    """
    dest = Path(out)
    obj: Any
    if select is None:
        if dtype is not None:
            raise ValueError("export_torch: dtype converts weights; the full state stays exact")
        obj = to_python(restore(checkpoint))
    else:
        obj = _weights(checkpoint, _select_path(select), dtype)
    check_loadable(obj)
    return write_torch_file(obj, dest, overwrite=overwrite)
