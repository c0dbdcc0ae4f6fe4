"""An export directory: its weight files, its side files (config, tokenizer), and
recognising one.

An export replaces only an export: what makes a directory one is decided here,
and so is what an overwrite carries over (everything but the old weights).
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.format.naming import EXPORT_INDEX, EXPORT_WEIGHTS, is_export_weights
from functional_ckpt._src.storage import opener
from functional_ckpt.errors import CheckpointError

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"

ExtraFile = bytes | str | os.PathLike[str] | Mapping[str, Any] | Any


def _json_bytes(value: Any, what: str) -> bytes:
    try:
        return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: not JSON-serialisable ({e})") from None


def _config_bytes(config: Any, dtype: torch.dtype | None) -> bytes:
    """``config.json`` of a transformers config (duck-typed) or of a plain dict."""
    if hasattr(config, "to_json_string") and callable(config.to_json_string):
        try:
            text = config.to_json_string(use_diff=False)
        except TypeError:
            text = config.to_json_string()
        data = json.loads(text)
    elif hasattr(config, "to_dict") and callable(config.to_dict):
        data = config.to_dict()
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TypeError(
            f"config={config!r}: expected a transformers PretrainedConfig (anything with "
            "to_dict()) or a dict"
        )
    if not isinstance(data, dict):
        raise TypeError(f"config: to_dict() returned a {type(data).__name__}, not a dict")
    if dtype is not None:  # the weights' dtype, as save_pretrained records it
        for key in ("torch_dtype", "dtype"):
            if key in data:
                data[key] = str(dtype).removeprefix("torch.")
    return _json_bytes(data, "config")


def _file_bytes(name: str, value: ExtraFile) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, os.PathLike):
        path = Path(os.fspath(value))
        try:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"extra_files[{name!r}]={path}: not a regular file")
            return path.read_bytes()
        except OSError as e:
            raise CheckpointError(f"extra_files[{name!r}]={path}: cannot read it ({e})") from e
    if hasattr(value, "to_json_string") and callable(value.to_json_string):
        text = value.to_json_string()  # e.g. a transformers GenerationConfig
        return text.encode() if isinstance(text, str) else bytes(text)
    if isinstance(value, Mapping):
        return _json_bytes(dict(value), f"extra_files[{name!r}]")
    raise TypeError(
        f"extra_files[{name!r}]={value!r}: expected bytes, str (the text), a pathlib.Path "
        "(a file to copy), a dict (written as JSON) or an object with to_json_string()"
    )


def is_weight_file(name: str) -> bool:
    return is_export_weights(name) or name == EXPORT_INDEX


def side_files(
    config: Any, extra_files: Mapping[str, ExtraFile] | None, dtype: torch.dtype | None
) -> dict[str, bytes]:
    """File name -> bytes of everything an export holds beside the weights."""
    files: dict[str, bytes] = {}
    if config is not None:
        files[CONFIG_FILE] = _config_bytes(config, dtype)
    if extra_files is None:
        return files
    if not isinstance(extra_files, Mapping):
        raise TypeError(f"extra_files={extra_files!r}: expected a mapping of file name to data")
    for name, value in extra_files.items():
        if (
            not isinstance(name, str)
            or name in ("", ".", "..")
            or "/" in name
            or "\\" in name
            or "\0" in name
        ):
            raise ValueError(f"extra_files: {name!r} is not a plain file name")
        if is_weight_file(name):
            raise ValueError(f"extra_files: {name!r} is a name the weights use")
        if name in files:
            raise ValueError(f"extra_files: {name!r} is written from config=; pass only one")
        files[name] = _file_bytes(name, value)
    return files


def carried_over(out: Path, given: Mapping[str, bytes]) -> dict[str, bytes]:
    """Side files of the export being replaced that this export does not write anew."""
    kept: dict[str, bytes] = {}
    dir_fd = opener.open_directory(out)
    try:
        for name in sorted(os.listdir(out)):
            if is_weight_file(name) or name in given:
                continue
            where = out / name
            fd = opener.open_member(dir_fd, name, where, what="export file")
            try:
                kept[name] = opener.read_exact(fd, os.fstat(fd).st_size, where)
            finally:
                os.close(fd)
    finally:
        os.close(dir_fd)
    return kept


def first_weight_file(path: Path) -> Path:
    """The file holding an export's header metadata: the single file or the first shard."""
    if (path / EXPORT_WEIGHTS).is_file():
        return path / EXPORT_WEIGHTS
    shards = sorted(n for n in os.listdir(path) if is_export_weights(n))
    if not shards:
        raise CheckpointError(f"{path}: holds no model*.safetensors file")
    return path / shards[0]


def header_metadata(path: Path) -> dict[str, str]:
    """The safetensors header metadata of an export (``{"format": "pt", ...}``)."""
    from safetensors import safe_open

    with safe_open(str(first_weight_file(path)), framework="pt") as f:
        meta = f.metadata()
    return dict(meta or {})
