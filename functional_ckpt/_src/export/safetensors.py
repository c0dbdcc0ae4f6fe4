"""Weights-only safetensors exports in the layout ``transformers`` writes, for
evaluation, serving and sharing without functional_ckpt. Safetensors refuses shared
memory, so a tied weight keeps its first name (as ``transformers`` does) and tensors
that merely overlap are copied. The directory appears atomically."""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt._src.arguments import is_name, items, mapping
from functional_ckpt._src.export.files import CONFIG_FILE, ExtraFile, carried_over, side_files
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS, step_in_name
from functional_ckpt._src.log import done, logger, warn
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy.base import SavePolicy
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.state.tree import as_state, from_python, iter_leaves
from functional_ckpt._src.storage import commit, durable
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    CheckpointWarning,
    TemplateMismatch,
)

__all__ = ["CONFIG_FILE", "Export", "export_safetensors", "parse_size"]

#: Decimal units are powers of 1000, binary ones (KiB ...) of 1024, as in transformers.
_UNITS = {"": 1, "b": 1} | {
    u + s: base**i
    for i, u in enumerate("kmgt", 1)
    for s, base in (("", 1000), ("b", 1000), ("ib", 1024))
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"``, ``"500MB"``, ``"1.5GiB"`` (case-insensitive)."""
    if isinstance(size, bool) or not isinstance(size, int | str):
        raise TypeError(f"max_shard_size={size!r}: expected an int or a string like '5GB'")
    value = size if isinstance(size, int) else 0
    if isinstance(size, str):
        m = _SIZE_RE.fullmatch(size)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size={size!r}: expected a number with an optional unit "
                f"({', '.join(u.upper() for u in _UNITS if u)})"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be positive")
    return value


#: Prefixes wrappers add to every name, where ``from_pretrained`` would find no weight.
WRAPPER_PREFIXES = {"_orig_mod.": "torch.compile", "module.": "DDP or DataParallel"}

Rename = Mapping[str, str] | Callable[[str], str]
_RENAME = "a mapping of name prefixes to their replacement (e.g. {'model.': ''}) or a function"
_HEADER = "a mapping of str to str, without 'format' (always 'pt')"


def _header_entry(key: object, value: object) -> bool:
    return key != "format" and is_name(key) and isinstance(value, str)


def checked_options(
    select: str | Sequence[str],
    dtype: torch.dtype | None,
    max_shard_size: int | str,
    strip_prefix: str | Sequence[str] | None,
    rename: Rename | None,
) -> tuple[KeyPath, int, tuple[str, ...]]:
    """The options an export and :class:`Export` share, checked before anything is read:
    (the path of ``select``, the shard size in bytes, the prefixes to strip)."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: expected a floating-point torch.dtype or None")
    given = (strip_prefix,) if isinstance(strip_prefix, str) else strip_prefix or ()
    strip = items(given, "strip_prefix", "", "a prefix such as '_orig_mod.' or a sequence of them")
    if not callable(rename):
        mapping(rename, "rename", "", _RENAME, lambda k, v: is_name(k) and isinstance(v, str))
    return _select_path(select), parse_size(max_shard_size), strip


def new_name(name: str, strip: tuple[str, ...], rename: Rename | None) -> str:
    """``name`` without the wrapper prefixes in ``strip``, then renamed."""
    left = list(strip)  # each prefix once: "model." of a wrapper, not HF's own "model."
    while hit := next((p for p in left if name.startswith(p)), None):
        name = name[len(hit) :]
        left.remove(hit)
    if callable(rename):
        new = rename(name)
        if not isinstance(new, str):
            raise TypeError(f"rename({name!r}) returned {new!r}, not a str")
        return new
    if rename:
        hits = [old for old in rename if name.startswith(old)]
        if hits:
            old = max(hits, key=len)  # the longest prefix is the most specific rule
            return rename[old] + name[len(old) :]
    return name


def map_names(
    tensors: dict[str, torch.Tensor], strip: tuple[str, ...], rename: Rename | None
) -> dict[str, torch.Tensor]:
    """Names as ``from_pretrained`` should see them; two tensors never get one name."""
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    for name, t in tensors.items():
        new = new_name(name, strip, rename)
        if not new:
            raise CheckpointError(f"export: the tensor {name!r} would get an empty name")
        if new in origin:
            raise CheckpointError(
                f"export: the tensors {origin[new]!r} and {name!r} would both be named {new!r}; "
                "check strip_prefix= and rename="
            )
        origin[new] = name
        out[new] = t
    for prefix, by in WRAPPER_PREFIXES.items():
        wrapped = [n for n in out if n.startswith(prefix) or f".{prefix}" in n]
        if wrapped and (prefix == "_orig_mod." or len(wrapped) == len(out)):
            warn(
                f"export: tensor names such as {wrapped[0]!r} carry the prefix {prefix!r} "
                f"that {by} adds; transformers would not find these weights and would "
                f"initialise them at random. Pass strip_prefix={prefix!r} (or rename=)",
                CheckpointWarning,
                stacklevel=4,
            )
    return out


def _select_path(select: str | Sequence[str]) -> KeyPath:
    """``"model"`` or ``("policy", "model")``; a string is one key, never split on dots."""
    path: KeyPath = (select,) if isinstance(select, str) else tuple(select)
    if not path or not all(isinstance(k, str) and k for k in path):
        raise ValueError(f"select={select!r}: expected a key or a non-empty sequence of keys")
    return path


@dataclass(frozen=True)
class Export:
    """An export on its own save policy, for ``CheckpointManager(..., export=...)``.

    ``dtype`` converts floating-point tensors only; ``max_shard_size`` bounds each
    file (a larger tensor gets a file of its own); the next four fields are those
    of :func:`export_safetensors`. ``keep`` is the exports' own retention (the
    newest export is never deleted).
    """

    policy: SavePolicy
    select: str | Sequence[str] = "model"
    dtype: torch.dtype | None = None
    max_shard_size: int | str = "5GB"
    config: Any = field(default=None, repr=False)
    extra_files: Mapping[str, ExtraFile] | None = field(default=None, repr=False)
    strip_prefix: str | Sequence[str] | None = None
    rename: Rename | None = None
    keep: RetentionPolicy = field(default_factory=keep_all)
    max_shard_bytes: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.policy, SavePolicy):
            raise TypeError(f"Export(policy={self.policy!r}): not a SavePolicy")
        if not isinstance(self.keep, RetentionPolicy):
            raise TypeError(f"Export(keep={self.keep!r}): not a RetentionPolicy")
        options = (self.select, self.dtype, self.max_shard_size, self.strip_prefix, self.rename)
        object.__setattr__(self, "max_shard_bytes", checked_options(*options)[1])
        side_files(self.config, self.extra_files, None)  # fails now, not at the first export


def _load(source: TensorDictBase | Mapping[str, Any] | PathLike, path: KeyPath) -> TensorDictBase:
    """The state, or the ``path`` subtree of a checkpoint read without the rest."""
    if isinstance(source, TensorDictBase | Mapping):
        return as_state(source)
    template = functools.reduce(lambda inner, key: {key: inner}, reversed(path), dict[str, Any]())
    try:
        return restore(source, from_python(template), partial=True)
    except TemplateMismatch:
        return restore(source)  # the selection is not a subtree (e.g. one tensor)


def subtree(state: TensorDictBase, path: KeyPath) -> Any:
    """``state[path]``: a sub-state or a tensor; a missing key is named with its siblings."""
    node: Any = state
    for i, key in enumerate(path):
        if not isinstance(node, TensorDictBase) or key not in node.keys():
            keys = node.keys() if isinstance(node, TensorDictBase) else ()
            have = sorted(str(k) for k in keys if k != NODE_KEY)
            raise CheckpointError(
                f"export: the state has no state[{format_path(path[: i + 1])}] (keys there: {have})"
            )
        node = node.get(key)
    return node


def _collect(state: TensorDictBase, path: KeyPath) -> dict[str, torch.Tensor]:
    """Tensor leaves under ``path`` by dotted name (the tensor at ``path`` by its key)."""
    node = subtree(state, path)
    if isinstance(node, torch.Tensor) and not isinstance(node, TensorDictBase):
        return {path[-1]: node}
    tensors = {
        ".".join(leaf.path): leaf.value for leaf in iter_leaves(node) if leaf.kind == "tensor"
    }
    if not tensors:
        raise CheckpointError(f"export: state[{format_path(path)}] holds no tensors")
    return tensors


def view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """What makes two tensors the very same view (a tied weight under two names)."""
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)


def _dedupe(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tied aliases: a later name for the very same tensor view is left out."""
    first: dict[tuple[Any, ...], str] = {}
    return {
        n: t for n, t in tensors.items() if not t.numel() or first.setdefault(view_key(t), n) == n
    }


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _plan_shards(
    tensors: dict[str, torch.Tensor], limit: int, dtype: torch.dtype | None
) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * _out_dtype(t, dtype).itemsize
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _prepared(
    names: list[str], tensors: dict[str, torch.Tensor], dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """CPU, converted, contiguous tensors that share no storage with each other."""
    storages: set[int] = set()
    for name in names:
        t = tensors[name].detach()
        t = t.to(device="cpu", dtype=_out_dtype(t, dtype)).contiguous()
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in storages:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        storages.add(ptr)
        yield name, t


def _write_shards(
    tmp: Path,
    shards: list[list[str]],
    tensors: dict[str, torch.Tensor],
    dtype: torch.dtype | None,
    header: Mapping[str, str],
) -> None:
    from safetensors.torch import save_file

    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, start=1):
        file = EXPORT_WEIGHTS if n == 1 else f"model-{i:05d}-of-{n:05d}.safetensors"
        shard = dict(_prepared(names, tensors, dtype))  # one shard in memory at a time
        meta = {**header, "format": "pt"} if i == 1 else {"format": "pt"}
        save_file(shard, str(tmp / file), metadata=meta)
        durable.fsync_and_close(os.open(tmp / file, os.O_RDONLY))
        total += sum(t.numel() * t.element_size() for t in shard.values())
        weight_map.update(dict.fromkeys(names, file))
        del shard
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        durable.write_new(tmp / EXPORT_INDEX, json.dumps(index, indent=2).encode())


def export_safetensors(
    state_or_checkpoint_path: TensorDictBase | Mapping[str, Any] | PathLike,
    out_dir: PathLike,
    *,
    select: str | Sequence[str] = "model",
    dtype: torch.dtype | None = None,
    max_shard_size: int | str = "5GB",
    overwrite: bool = False,
    config: Any = None,
    extra_files: Mapping[str, ExtraFile] | None = None,
    strip_prefix: str | Sequence[str] | None = None,
    rename: Rename | None = None,
    header: Mapping[str, str] | None = None,
) -> Path:
    """Write the tensors under ``select`` of a state, or of a checkpoint (only that
    subtree is read), as Hugging Face safetensors into ``out_dir``; returns it.

    ``config`` (a ``PretrainedConfig`` or dict) becomes ``config.json``;
    ``extra_files`` maps file names to bytes, text, a ``pathlib.Path`` to copy, a
    dict (JSON) or an object with ``to_json_string()``, so that ``from_pretrained``
    loads ``out_dir``. ``strip_prefix`` removes wrapper prefixes (``"_orig_mod."``,
    ``"module."``) leading a name, then ``rename`` maps a prefix (the longest
    wins) or is a function of the name. With ``overwrite`` only an export (or an
    empty directory) is replaced, atomically, its side files carried over unless
    written anew. ``header`` adds safetensors header metadata.
    """
    out, t0 = Path(out_dir), time.perf_counter()
    path, limit, strip = checked_options(select, dtype, max_shard_size, strip_prefix, rename)
    meta = mapping(header, "header", "", _HEADER, _header_entry)
    files = side_files(config, extra_files, dtype)
    replacing = out.exists() or out.is_symlink()
    if replacing:
        if not overwrite:
            raise CheckpointExists(f"{out}: already exists; pass overwrite=True to replace it")
        commit.check_replaceable(out, commit.EXPORTS)
    tensors = _collect(_load(state_or_checkpoint_path, path), path)
    tensors = _dedupe(map_names(tensors, strip, rename))
    shards = _plan_shards(tensors, limit, dtype)
    durable.make_dirs(out.parent)
    tmp = durable.tmp_sibling(out)
    try:
        tmp.mkdir()
        _write_shards(tmp, shards, tensors, dtype, meta)
        if replacing:
            files = {**carried_over(out, files), **files}
        for name, data in files.items():
            durable.write_new(tmp / name, data)
        commit.commit_checkpoint(tmp, out, overwrite=overwrite, replaces=commit.EXPORTS)
    except BaseException:
        commit.remove_tree(tmp)
        raise
    logged(out, t0)
    return out


def logged(out: Path, t0: float) -> None:
    """The INFO record of an export begun at ``t0``: a directory, or one ``torch.save`` file."""
    if _LOG.isEnabledFor(logging.INFO):
        files = list(os.scandir(out)) if out.is_dir() else [out]
        nbytes = sum(f.stat(follow_symlinks=False).st_size for f in files)
        seconds, step = time.perf_counter() - t0, step_in_name(out.name)
        done(_LOG, "exported", out, seconds=seconds, nbytes=nbytes, step=step)


_LOG = logger("export")
