"""``fckpt import`` and ``fckpt export --format torch``: in and out of ``torch.save`` files.

The conversions are :mod:`functional_ckpt._src.export.torch_save`'s; this adds the flags and
the report.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterator
from pathlib import Path

import functional_ckpt as fc
from functional_ckpt._src.cli.common import (
    UsageError,
    newest_checkpoint,
    print_json,
    require_exists,
)
from functional_ckpt._src.cli.show import cmd_export, export_json, parse_dtype
from functional_ckpt._src.cli.ui import UI, human
from functional_ckpt._src.export.torch_save import WEIGHTS_KEY, export_torch, import_torch

__all__ = ["cmd_export_any", "cmd_import"]


@contextlib.contextmanager
def flag_spelling() -> Iterator[None]:
    """The library's ``overwrite=True`` advice, as the flag a shell user passes."""
    try:
        yield
    except fc.errors.CheckpointError as e:
        text = str(e)
        if "overwrite=True" not in text:
            raise
        raise type(e)(text.replace("overwrite=True", "--overwrite")) from None  # same status


def cmd_import(args: argparse.Namespace, ui: UI) -> int:
    src, out = Path(args.file), Path(args.out)
    require_exists(src)
    with flag_spelling():
        info = import_torch(src, out, overwrite=args.overwrite)
    summary = fc.inspect(info.path)
    bare = list(summary.tree) == [WEIGHTS_KEY]
    if args.json:
        doc = {
            "file": str(src),
            "path": str(info.path),
            "layout": "state_dict" if bare else "state",
            "num_tensors": summary.num_tensors,
            "num_values": summary.num_values,
            "tensor_bytes": summary.tensor_bytes,
        }
        print_json(ui, doc)
        return 0
    layout = f" (a state_dict: under '{WEIGHTS_KEY}')" if bare else ""
    ui.print(
        f"imported {src} to {info.path}{layout}: {summary.num_tensors} tensors, "
        f"{human(summary.tensor_bytes)}"
    )
    return 0


def _export_torch(args: argparse.Namespace, ui: UI) -> int:
    if args.max_shard_size is not None:
        raise UsageError("--max-shard-size: a torch export is one file; leave it out")
    if args.full and args.dtype:
        raise UsageError("--dtype converts the weights; --full exports the state as saved")
    if args.config is not None:
        raise UsageError("--config: a torch export is one file of weights; leave it out")
    src = newest_checkpoint(Path(args.path))
    out = Path(args.out)
    select = None if args.full else tuple(k for k in args.select.split("/") if k)
    if select == ():
        raise UsageError(f"--select {args.select!r}: expected a key such as 'model'")
    with flag_spelling():
        converted = export_torch(
            src, out, select=select, dtype=parse_dtype(args.dtype), overwrite=args.overwrite
        )
    what = "the full state" if select is None else "/".join(select)
    if args.json:
        key = None if select is None else "/".join(select)
        conv = ["/".join(p) for p in converted]
        print_json(ui, export_json(src, out, "torch", key, [out], converted=conv))
        return 0
    ui.print(f"exported {what} of {src} to {out} ({human(out.stat().st_size)})")
    if converted:
        shown = ", ".join("/".join(p) for p in converted[:5])
        more = f" and {len(converted) - 5} more" if len(converted) > 5 else ""
        ui.print(
            f"numpy values saved as tensors / Python numbers (weights_only=True reads no "
            f"numpy): {shown}{more}"
        )
    return 0


def cmd_export_any(args: argparse.Namespace, ui: UI) -> int:
    if args.format == "torch":
        return _export_torch(args, ui)
    if args.full:
        raise UsageError("--full: only with --format torch (safetensors holds weights only)")
    if args.max_shard_size is None:
        args.max_shard_size = "5GB"
    return cmd_export(args, ui)
