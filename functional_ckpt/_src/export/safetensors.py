"""Weights-only safetensors exports in the Hugging Face layout.

Full checkpoints are for resuming; an export is for everything else (evaluation,
serving, sharing): just the model's tensors, in the format other tools load
without functional_ckpt. The layout is the one ``transformers`` writes and reads:

* ``model.safetensors`` when everything fits in one shard, else
* ``model-00001-of-0000K.safetensors`` … plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

Tensor names are the key path under ``select`` joined with ``"."``, i.e. the
model's ``state_dict`` names. Safetensors refuses tensors that share memory, so
tied weights (two names, one tensor) keep the first name in state order and drop
the alias, as ``transformers`` does; tensors that merely overlap in one storage
are copied. An export directory appears atomically (temporary sibling, fsync,
rename), so a reader never sees a partial one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tensordict import TensorDictBase

from functional_ckpt._src.export.files import (
    CONFIG_FILE,
    ExtraFile,
    carried_over,
    side_files,
)
from functional_ckpt._src.export.names import Rename, check_rename, map_names, prefixes
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath, format_path
from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS
from functional_ckpt._src.log import done, logger
from functional_ckpt._src.paths import PathLike
from functional_ckpt._src.policy import SavePolicy
from functional_ckpt._src.policy.retention import RetentionPolicy, keep_all
from functional_ckpt._src.restore.api import restore
from functional_ckpt._src.state.tree import as_state, from_python, iter_leaves
from functional_ckpt._src.storage import commit, durable
from functional_ckpt.errors import (
    CheckpointError,
    CheckpointExists,
    TemplateMismatch,
)

__all__ = [
    "CONFIG_FILE",
    "Export",
    "export_safetensors",
    "parse_size",
]

#: Prefixes that wrappers add to every name; transformers finds no weight under them.
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"5GB"``, ``"500MB"``, ``"1.5GiB"`` (case-insensitive).

    Decimal units (KB, MB, GB, TB, and the short K, M, G, T) are powers of 1000
    and binary ones (KiB …) of 1024, as in ``transformers``' ``max_shard_size``.
    """
    if isinstance(size, bool):
        raise TypeError(f"max_shard_size={size!r}: expected an int or a string like '5GB'")
    if isinstance(size, int):
        value = size
    elif isinstance(size, str):
        m = _SIZE_RE.fullmatch(size)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"max_shard_size={size!r}: expected a number with an optional unit "
                f"({', '.join(u.upper() for u in _UNITS if u)})"
            )
        value = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise TypeError(f"max_shard_size={size!r}: expected an int or a string like '5GB'")
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be positive")
    return value


def _select_path(select: str | Sequence[str]) -> KeyPath:
    """``"model"`` or ``("policy", "model")``: the subtree holding the weights.

    A string is one key, never split on dots (state_dict names contain dots).
    """
    if isinstance(select, str):
        path: KeyPath = (select,)
    else:
        path = tuple(select)
    if not path or not all(isinstance(k, str) and k for k in path):
        raise ValueError(f"select={select!r}: expected a key or a non-empty sequence of keys")
    return path


@dataclass(frozen=True)
class Export:
    """An export on its own save policy, for ``CheckpointManager(..., export=...)``.

    ``dtype`` converts floating-point tensors only (integer buffers such as
    position ids keep their type). ``max_shard_size`` bounds each file's tensor
    bytes; a single tensor larger than it gets a file of its own. ``config``,
    ``extra_files``, ``strip_prefix`` and ``rename`` are those of
    :func:`export_safetensors`. ``keep`` is the exports' own retention policy
    (default: keep all), applied to ``root/exports`` after each export; the newest
    export is never deleted.
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
        _select_path(self.select)
        _check_dtype(self.dtype)
        side_files(self.config, self.extra_files, None)  # fails now, not at the first export
        prefixes(self.strip_prefix)
        check_rename(self.rename)
        object.__setattr__(self, "max_shard_bytes", parse_size(self.max_shard_size))


def _check_dtype(dtype: torch.dtype | None) -> None:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"dtype={dtype!r}: expected a floating-point torch.dtype or None")


# --------------------------------------------------------------------------- collect


def _load(source: TensorDictBase | Mapping[str, Any] | PathLike, path: KeyPath) -> TensorDictBase:
    """The state, or the ``path`` subtree of a checkpoint read without the rest."""
    if isinstance(source, TensorDictBase | Mapping):
        return as_state(source)
    template: dict[str, Any] = {}
    node = template
    for key in path:
        node[key] = {}
        node = node[key]
    try:
        return restore(source, from_python(template), partial=True)
    except TemplateMismatch:
        return restore(source)  # the selection is not a subtree (e.g. one tensor)


def _collect(state: TensorDictBase, path: KeyPath) -> dict[str, torch.Tensor]:
    """Tensor leaves under ``path`` by dotted name; non-tensor leaves are skipped."""
    node: Any = state
    for i, key in enumerate(path):
        if not isinstance(node, TensorDictBase) or key not in node.keys():
            have = (
                [str(k) for k in node.keys() if k != NODE_KEY]
                if isinstance(node, TensorDictBase)
                else []
            )
            have.sort()
            raise CheckpointError(
                f"export: the state has no state[{format_path(path[: i + 1])}] (keys there: {have})"
            )
        node = node.get(key)
    if isinstance(node, torch.Tensor) and not isinstance(node, TensorDictBase):
        return {path[-1]: node}
    tensors = {
        ".".join(leaf.path): leaf.value for leaf in iter_leaves(node) if leaf.kind == "tensor"
    }
    if not tensors:
        raise CheckpointError(f"export: state[{format_path(path)}] holds no tensors")
    return tensors


def _dedupe(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop tied aliases: a later name for the very same tensor view is left out."""
    seen: set[tuple[Any, ...]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        if t.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = t
    return out


def _out_dtype(t: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and t.is_floating_point() else t.dtype


def _plan_shards(
    tensors: dict[str, torch.Tensor], limit: int, dtype: torch.dtype | None
) -> list[list[str]]:
    """Greedy, in state order: start a new shard when the next tensor would overflow."""
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


# --------------------------------------------------------------------------- write


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        _fsync_file(tmp / file)
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
    """Write the tensors under ``select`` as Hugging Face safetensors into ``out_dir``.

    The source is a state (TensorDict or dict) or the path of a checkpoint, of
    which only the selected subtree is read. ``config`` (a transformers
    ``PretrainedConfig``, or a dict) becomes ``config.json``; ``extra_files`` maps
    more file names to their content: bytes, str (the text), a ``pathlib.Path``
    (a file to copy), a dict (JSON) or an object with ``to_json_string()`` such as
    a ``GenerationConfig``. With those, ``AutoModelForCausalLM.from_pretrained(out_dir)``
    works as it does on ``save_pretrained``'s output.

    Names are the state_dict names; ``strip_prefix`` removes wrapper prefixes
    (``"_orig_mod."``, ``"module."``, a LightningModule attribute such as
    ``"model."``) wherever they lead a name, then ``rename`` maps a prefix to
    another (``{"backbone.": "model."}``; the longest matching prefix wins) or is a
    function of the name. A warning says when names still look wrapped.

    ``out_dir`` appears complete or not at all. With ``overwrite`` a previous
    export (or an empty directory) is replaced atomically: its weights go, and
    every other file in it (config, tokenizer files, a README) is carried over
    into the new export unless this call writes a file of that name. Anything
    else is refused and left intact. ``header`` adds safetensors header metadata (a
    manager records the step and metrics there). Returns ``out_dir``.
    """
    out, t0 = Path(out_dir), time.perf_counter()
    path = _select_path(select)
    _check_dtype(dtype)
    limit = parse_size(max_shard_size)
    files = side_files(config, extra_files, dtype)
    replacing = out.exists() or out.is_symlink()
    if replacing:
        if not overwrite:
            raise CheckpointExists(f"{out}: already exists; pass overwrite=True to replace it")
        commit.check_replaceable(out, commit.EXPORTS)
    tensors = _collect(_load(state_or_checkpoint_path, path), path)
    tensors = _dedupe(map_names(tensors, strip_prefix, rename))
    shards = _plan_shards(tensors, limit, dtype)
    durable.make_dirs(out.parent)
    tmp = durable.tmp_sibling(out)
    try:
        tmp.mkdir()
        _write_shards(tmp, shards, tensors, dtype, header or {})
        if replacing:
            files = {**carried_over(out, files), **files}
        for name, data in files.items():
            durable.write_new(tmp / name, data)
        commit.commit_checkpoint(tmp, out, overwrite=overwrite, replaces=commit.EXPORTS)
    except BaseException:
        commit.remove_tree(tmp)
        raise
    if _LOG.isEnabledFor(logging.INFO):
        nbytes = sum(e.stat(follow_symlinks=False).st_size for e in os.scandir(out))
        done(_LOG, "exported", out, seconds=time.perf_counter() - t0, nbytes=nbytes)
    return out


_LOG = logger("export")
