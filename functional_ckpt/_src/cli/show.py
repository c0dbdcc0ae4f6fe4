"""``fckpt inspect``, ``diff``, ``export`` and ``import``: the flags and reports of the
commands about one or two checkpoints (or a recording); the conversions are the library's."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import functional_ckpt as fc
from functional_ckpt._src.cli import listing, tiers
from functional_ckpt._src.cli.ui import PROG, UI, UsageError, human, jsonable, time_text
from functional_ckpt._src.format.keys import NODE_KEY, KeyPath
from functional_ckpt._src.format.kind import Kind, classify
from functional_ckpt._src.restore.summary import (
    CheckpointSummary,
    Node,
    TensorSpec,
    insert,
    node_of,
    unregistered_note,
)
from functional_ckpt._src.root.listing import entry_of
from functional_ckpt._src.storage.usage import dir_size
from functional_ckpt._src.text import printable, short_repr

if TYPE_CHECKING:
    import torch

__all__ = ["cmd_diff", "cmd_export", "cmd_import", "cmd_inspect", "parse_dtype"]

# ``inspect`` reads manifests only: torch and numpy are not imported for it.

#: One row of a summary tree: its key path and a node, a tensor spec or a plain value.
Row = tuple[KeyPath, Any]


def _rows(tree: Mapping[str, Any], prefix: KeyPath = ()) -> Iterator[Row]:
    for key, item in tree.items():
        yield (*prefix, str(key)), item
        if isinstance(item, Node):
            yield from _rows(item, (*prefix, str(key)))


def _matching(rows: list[Row], prefix: str | None) -> list[Row]:
    """Rows whose ``a/b/c`` key starts with ``prefix``, plus their ancestors for context."""
    if not prefix:
        return rows
    wanted: set[KeyPath] = set()
    for path, _ in rows:
        if "/".join(path).startswith(prefix):
            wanted.update(path[:i] for i in range(1, len(path) + 1))
    return [r for r in rows if r[0] in wanted]


#: How ``inspect`` notes a container that is no string-keyed dict.
_CONTAINERS = {"list": "  (list)", "tuple": "  (tuple)", "dict": "  (dict, non-str keys)"}


class _PerRecord:
    """A recording's value leaf: its value is one per record, not one to show."""

    def __repr__(self) -> str:
        return "(a value, per record)"


def _entry_line(path: KeyPath, item: Any, ui: UI, width: int) -> str:
    """One tree row; leaf names are padded to ``width`` so their specs line up."""
    indent, name = "  " * len(path), printable(path[-1])
    if isinstance(item, Node):
        record = item.get(NODE_KEY)
        kind = _CONTAINERS.get(str(record.get("kind")), "") if isinstance(record, dict) else ""
        kind = kind or (f"  batch {list(item.batch_size)}" if item.batch_size else "")
        return f"{indent}{ui.paint(name + '/', 'key')}{ui.paint(kind, 'dim')}"
    if isinstance(item, TensorSpec):
        spec = f"{item.dtype_name}{list(item.shape)}"
        size = ui.paint(human(item.nbytes), "dim")
        return f"{indent}{name.ljust(width)}  {ui.paint(spec, 'dtype')}  {size}"
    return f"{indent}{name.ljust(width)}  = {short_repr(item)}"


def _tree_lines(rows: list[Row], ui: UI) -> list[str]:
    """The one printer of a key tree, a checkpoint's or a recording's."""
    shown = [(path, item) for path, item in rows if path[-1] != NODE_KEY]
    widths: dict[KeyPath, int] = {}
    for path, item in shown:
        if not isinstance(item, Node):
            width = min(40, max(widths.get(path[:-1], 0), len(printable(path[-1]))))
            widths[path[:-1]] = width
    return [_entry_line(path, item, ui, widths.get(path[:-1], 0)) for path, item in shown]


def _metadata_lines(meta: Any, ui: UI) -> list[str]:
    if not isinstance(meta, dict) or not meta:
        return []
    lines = [ui.paint("metadata", "head")]
    for key, value in meta.items():
        if isinstance(value, dict) and value:
            lines.append(f"  {printable(str(key))}:")
            lines += [f"    {printable(str(k))} = {short_repr(v, 100)}" for k, v in value.items()]
        else:
            lines.append(f"  {printable(str(key))} = {short_repr(value, 100)}")
    return lines


def _entry_json(path: KeyPath, item: Any) -> dict[str, Any]:
    doc = {"key": "/".join(path), "path": list(path)}
    if isinstance(item, Node):
        return {**doc, "kind": "node", "batch_size": list(item.batch_size)}
    if isinstance(item, TensorSpec):
        spec = {"dtype": item.dtype_name, "shape": list(item.shape), "nbytes": item.nbytes}
        return {**doc, "kind": "tensor", **spec}
    return {**doc, "kind": "value", "value": jsonable(item)}


def _inspect(path: Path) -> CheckpointSummary:
    """``fc.inspect`` with a pointer to ``ls`` when given a directory of checkpoints."""
    listing.require_exists(path)
    try:
        return fc.inspect(path)
    except fc.errors.CheckpointNotFound:
        if path.is_dir() and any(entry_of(p) for p in path.iterdir()):  # a root
            raise UsageError(
                f"{path}: a directory of checkpoints, not a checkpoint; "
                f"see '{PROG} ls {path}' and inspect one of them"
            ) from None
        raise


def cmd_inspect(args: argparse.Namespace, ui: UI) -> int:
    if tiers.is_url(args.path):  # a remote checkpoint: downloaded first
        with tiers.fetched(args.path, check=False) as local:
            return cmd_inspect(argparse.Namespace(**{**vars(args), "path": str(local)}), ui)
    path = Path(args.path)
    tail: list[str] = []  # a checkpoint's note on unregistered classes
    if classify(path) is Kind.RECORDING:
        doc, tree, head = _recording(path, ui)
    else:
        summary = _inspect(path)
        fields = [f.name for f in dataclasses.fields(summary) if f.name not in ("path", "tree")]
        doc = {"path": str(summary.path)} | {k: jsonable(getattr(summary, k)) for k in fields}
        tree, head = summary.tree, _inspect_lines(summary, ui)
        if summary.unregistered:
            tail = [ui.paint(unregistered_note(summary.unregistered), "warn")]
    entries = _matching(list(_rows(tree)), args.key)
    if args.key and not entries:
        top = ", ".join(sorted(tree)) or "none"
        raise UsageError(f"{path}: no key starts with {args.key!r} (top-level keys: {top})")
    if args.json:
        ui.json({**doc, "entries": [_entry_json(*e) for e in entries]})
        return 0
    for line in [*head, *_tree_lines(entries, ui), *tail]:
        ui.print(line)
    return 0


def _inspect_lines(summary: CheckpointSummary, ui: UI) -> list[str]:
    kind = "stock DCP checkpoint" if summary.foreign else f"format v{summary.format_version}"
    lines = [
        ui.paint(str(summary.path), "head"),
        f"  {kind}, saved {time_text(summary.created)}, written by "
        f"{summary.world_size} rank{'s' if summary.world_size != 1 else ''}",
        f"  {summary.num_tensors} tensors ({human(summary.tensor_bytes)}), "
        f"{summary.num_values} values, {human(summary.file_bytes)} in files",
    ]
    if summary.added_bytes is not None:
        lines.append(
            f"  {human(summary.shared_bytes)} shared with other checkpoints, "
            f"{human(summary.added_bytes)} added by this save"
        )
    return [*lines, *_metadata_lines(summary.metadata, ui), ui.paint("tree", "head")]


def _recording(path: Path, ui: UI) -> tuple[dict[str, Any], dict[str, Any], list[str]]:
    """A recording's totals (JSON and lines) and the tree every record holds."""
    from functional_ckpt._src.format.manifest import NodeEntry, TensorEntry

    rec, doc = listing.read_recording(path)
    tree: dict[str, Any] = node_of(rec.header.get("root"))
    for e in rec.entries:
        item: Any = _PerRecord()
        if isinstance(e, NodeEntry):
            item = node_of(e.info)
        elif isinstance(e, TensorEntry):
            item = TensorSpec(e.dtype_name, e.shape, e.nbytes)
        insert(tree, e.path, item)
    head = [*listing.recording_lines(doc, ui), ui.paint("tree (every record)", "head")]
    return doc, tree, head


_DIFF_STYLE = {"added": "ok", "removed": "bad", "same": "dim"}
#: How ``diff`` names each kind of entry in its closing count, in this order.
_COUNTED = {"added": "added", "removed": "removed", "kind": "kind changed"}
_COUNTED |= {"shape": "shape changed", "dtype": "dtype changed", "value": "value(s) changed"}
_COUNTED |= {"tensor": "tensor(s) differ", "same": "identical"}


def cmd_diff(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.restore.diff import diff_checkpoints  # tensors: torch

    a, b = Path(args.a), Path(args.b)
    for p in (a, b):
        listing.require_exists(p)
        listing.refuse_stock_dcp(p, "diff")
    sizes = [dir_size(a), dir_size(b)]
    with ui.progress("reading A", sum(sizes)) as bar:
        reads, done = iter([("reading A", 0), ("reading B", sizes[0])]), [0]

        def progress(stage: str, path: Path | None) -> None:
            whole = (stage, bar.total)
            label, done[0] = next(reads, (stage, done[0])) if stage == "reading" else whole
            bar.update(done[0], force=True, label=label)

        result = diff_checkpoints(a, b, progress)
    shown = result.entries if args.all else result.changes
    counts = dict(collections.Counter(e.kind for e in result.entries))
    differ = 1 if args.exit_code and result.changes else 0
    if args.json:
        rows = [
            {"kind": e.kind, "key": "/".join(e.key), "path": list(e.key)}
            | {"detail": e.detail, "nbytes": e.nbytes}
            for e in shown
        ]
        doc = {"a": str(a), "b": str(b), "identical": not result.changes, "counts": counts}
        ui.json({**doc, "entries": rows})
        return differ
    ui.print(f"{ui.paint('A', 'head')} {a}\n{ui.paint('B', 'head')} {b}")
    for entry in shown:
        ui.print(ui.paint(str(entry), _DIFF_STYLE.get(entry.kind, "warn")))
    ui.print(", ".join(f"{counts[k]} {name}" for k, name in _COUNTED.items() if counts.get(k)))
    if not result.changes:
        ui.print("the checkpoints hold identical states")
    return differ


_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64", "half", "float", "double")
#: The short spellings of training scripts and model cards.
_ALIASES = {"bf16": "bfloat16"} | {
    f"{p}{n}": f"float{n}" for p in ("f", "fp") for n in (16, 32, 64)
}


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    key = name.strip().lower().removeprefix("torch.")
    key = _ALIASES.get(key, key)
    if key not in _FLOAT_DTYPES:
        names = ", ".join(sorted(_FLOAT_DTYPES)) + " (or bf16, fp16, fp32, fp64)"
        raise UsageError(f"--dtype {name}: expected one of {names}")
    import torch

    dtype: torch.dtype = getattr(torch, key)
    return dtype


def cmd_export(args: argparse.Namespace, ui: UI) -> int:
    torch_file = args.format == "torch"
    if args.full and not torch_file:
        raise UsageError("--full: only with --format torch (safetensors holds weights only)")
    for flag, given in (("--max-shard-size", args.max_shard_size), ("--config", args.config)):
        if torch_file and given is not None:
            raise UsageError(f"{flag}: a torch export is one file; leave it out")
    for flag, given in (("--dtype", args.dtype), ("--key/--select", args.select)):
        if args.full and given is not None:
            raise UsageError(f"{flag}: for the weights; --full exports the whole state as saved")
    src = listing.newest_checkpoint(Path(args.path))
    out = Path(args.out)
    keys = "model" if args.select is None else args.select
    select = None if args.full else tuple(k for k in keys.split("/") if k)
    if select == ():
        raise UsageError(f"--select {args.select!r}: expected a key such as 'model'")
    what = "the full state" if select is None else "/".join(select)
    dtype = parse_dtype(args.dtype)
    if torch_file:
        from functional_ckpt._src.export.torch_save import export_torch

        with _flag_spelling():
            converted = export_torch(src, out, select=select, dtype=dtype, overwrite=args.overwrite)
        files, more = [out], {"converted": ["/".join(p) for p in converted]}
    else:
        listing.refuse_stock_dcp(src, "export")
        assert select is not None
        config: tuple[Any, dict[str, bytes], list[str]] = (None, {}, [])
        if args.config is not None:
            from functional_ckpt._src.export.files import model_files  # torch: only now

            config = model_files(Path(args.config))
        options: dict[str, Any] = {"select": select, "dtype": dtype, "overwrite": args.overwrite}
        options |= {"max_shard_size": args.max_shard_size or "5GB", "config": config[0]}
        with ui.progress("exporting", 0), _flag_spelling():  # a bar with no end: work shown
            fc.export_safetensors(src, out, extra_files=config[1], **options)
        files = sorted(p for p in out.iterdir() if p.is_file())
        more = {} if args.config is None else {"config": args.config, "left_out": config[2]}
    if args.json:
        doc = {"path": str(src), "out": str(out), "format": args.format}
        doc |= {"select": None if select is None else what}
        sizes = [{"name": f.name, "size": f.stat().st_size} for f in files]
        ui.json({**doc, "files": sizes, **more})
    elif torch_file:
        ui.print(f"exported {what} of {src} to {out} ({human(out.stat().st_size)})")
        if converted:
            shown = ", ".join(more["converted"][:5])
            more_text = f" and {len(converted) - 5} more" if len(converted) > 5 else ""
            ui.print(
                f"numpy values saved as tensors / Python numbers (weights_only=True reads no "
                f"numpy): {shown}{more_text}"
            )
    else:
        ui.print(f"exported {what} of {src} to {out}:")
        for f in files:
            ui.print(f"  {f.name}  {human(f.stat().st_size)}")
        if more.get("left_out"):
            skipped = ", ".join(more["left_out"])
            ui.print(f"not taken from {args.config}: {skipped} (weights, hidden, folders)")
    return 0


@contextlib.contextmanager
def _flag_spelling() -> Iterator[None]:
    """The library's ``overwrite=True`` advice, as the flag a shell user passes."""
    try:
        yield
    except fc.errors.CheckpointError as e:
        text = str(e)
        if "overwrite=True" not in text:
            raise
        raise type(e)(text.replace("overwrite=True", "--overwrite")) from None  # same status


def cmd_import(args: argparse.Namespace, ui: UI) -> int:
    from functional_ckpt._src.export.torch_save import WEIGHTS_KEY, import_torch

    src, out = Path(args.file), Path(args.out)
    with _flag_spelling():
        info = import_torch(src, out, overwrite=args.overwrite)
    summary = fc.inspect(info.path)
    bare = list(summary.tree) == [WEIGHTS_KEY]
    if args.json:
        layout = "state_dict" if bare else "state"
        counts = {k: getattr(summary, k) for k in ("num_tensors", "num_values", "tensor_bytes")}
        ui.json({"file": str(src), "path": str(info.path), "layout": layout, **counts})
        return 0
    layout = f" (a state_dict: under '{WEIGHTS_KEY}')" if bare else ""
    ui.print(
        f"imported {src} to {info.path}{layout}: {summary.num_tensors} tensors, "
        f"{human(summary.tensor_bytes)}"
    )
    return 0
