"""An export directory: its weight files, its side files (config, tokenizer), and
what an overwrite carries over (everything but the old weights)."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from functional_ckpt._src.codec import documents
from functional_ckpt._src.format.naming import EXPORT_INDEX, is_export_weights
from functional_ckpt._src.storage import opener
from functional_ckpt.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    import torch

CONFIG_FILE = "config.json"
#: Largest side file taken from a model directory: a tokenizer.json of a large
#: vocabulary is tens of MB; past this it is weights or something else entirely.
SIDE_FILE_BYTES = 1 << 30
#: What a model directory holds that is weights, not a side file (in any framework).
_WEIGHT_SUFFIXES: tuple[str, ...] = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5")
_WEIGHT_SUFFIXES += (".msgpack", ".gguf", ".onnx", ".index.json")

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
        if not isinstance(name, str) or name in ("", ".", "..") or {"/", "\\", "\0"} & set(name):
            raise ValueError(f"extra_files: {name!r} is not a plain file name")
        if is_weight_file(name):
            raise ValueError(f"extra_files: {name!r} is a name the weights use")
        if name in files:
            raise ValueError(f"extra_files: {name!r} is written from config=; pass only one")
        files[name] = _file_bytes(name, value)
    return files


def carried_over(out: Path, given: Mapping[str, bytes]) -> dict[str, bytes]:
    """Side files of the export being replaced that this export does not write anew."""
    names = [n for n in sorted(os.listdir(out)) if not (is_weight_file(n) or n in given)]
    return {n: opener.read_file(out / n, limit=SIDE_FILE_BYTES, what="export file") for n in names}


#: Largest safetensors header read (the bound the safetensors library itself sets).
HEADER_BYTES = 100_000_000


def header_metadata(path: Path) -> dict[str, str]:
    """The safetensors header metadata of an export (``{"format": "pt", ...}``), read bounded."""
    files = sorted(n for n in os.listdir(path) if is_export_weights(n))
    if not files:
        raise CheckpointError(f"{path}: holds no model*.safetensors file")
    weights = path / files[0]  # the single file, or the first shard (it holds the header)
    dir_fd = opener.open_directory(weights.parent)
    try:
        fd = opener.open_member(dir_fd, weights.name, weights, what="export's weights")
    finally:
        os.close(dir_fd)
    try:
        size = os.fstat(fd).st_size
        declared = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\xff"), "little")
        if declared > min(size - 8, HEADER_BYTES):
            raise CheckpointError(f"{weights}: not a safetensors file (its header is cut off)")
        header = documents.load(os.pread(fd, declared, 8), str(weights))
    except (OSError, ConfigError) as e:
        raise CheckpointError(f"{weights}: not a readable safetensors file ({e})") from None
    finally:
        os.close(fd)
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        return {}
    return {k: v for k, v in meta.items() if isinstance(k, str) and isinstance(v, str)}


def _plain_kind(mode: int) -> str | None:
    """Why a directory entry is no file to copy, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link (links are not followed; copy the file it points to)"
    return opener.file_kind(mode)


def _read_side_file(path: Path) -> bytes:
    try:
        return opener.read_file(path, limit=SIDE_FILE_BYTES, what="side file")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file") from None
    except CheckpointError as e:  # swapped for a link or a FIFO after it was listed
        raise CheckpointError(f"{path}: not copied: {e}") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read it ({e.strerror or e})") from None


def _config_of(data: bytes, where: Path) -> dict[str, Any]:
    try:
        config = documents.load(data, str(where))
    except ConfigError as e:
        raise CheckpointError(f"{where}: not a JSON config ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: not a JSON config (a {type(config).__name__})")
    return config


def model_files(source: Path) -> tuple[dict[str, Any], dict[str, bytes], list[str]]:
    """(config, other side files, names left out) of a model directory or a config file: a
    directory's ``config.json`` and every other regular file beside it, not its weights,
    hidden files or subdirectories; nothing through a link (its target would land in the
    export), a FIFO or a device."""
    try:
        mode = os.lstat(source).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{source}: no such file or directory") from None
    except OSError as e:
        raise CheckpointError(f"{source}: cannot read it ({e.strerror or e})") from None
    if not stat.S_ISDIR(mode):
        why = _plain_kind(mode)
        if why is not None:
            raise CheckpointError(f"{source}: {why}; expected a config.json or a model directory")
        return _config_of(_read_side_file(source), source), {}, []
    try:
        names = sorted(os.listdir(source))
    except OSError as e:
        raise CheckpointError(f"{source}: cannot list it ({e.strerror or e})") from None
    if CONFIG_FILE not in names:
        raise CheckpointError(
            f"{source}: holds no {CONFIG_FILE}; pass the directory save_pretrained wrote, "
            "or the config file itself"
        )
    config: dict[str, Any] = {}
    files: dict[str, bytes] = {}
    left_out: list[str] = []
    for name in names:
        where = source / name
        kind = os.lstat(where).st_mode
        if name.startswith(".") or stat.S_ISDIR(kind) or name.endswith(_WEIGHT_SUFFIXES):
            left_out.append(name)
            continue
        why = _plain_kind(kind)
        if why is not None:
            raise CheckpointError(f"{where}: {why}; not copied into the export")
        data = _read_side_file(where)
        if name == CONFIG_FILE:
            config = _config_of(data, where)
        else:
            files[name] = data
    return config, files, left_out
