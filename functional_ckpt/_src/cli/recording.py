"""``fckpt ls`` and ``fckpt inspect`` of a recording (``fc.recording.Recorder``'s directory).

``ls`` lists its committed records: each one's step and the bytes it added (a
record shares every leaf that did not change with the one before). ``inspect``
shows the recorded tree, once for all records, and the totals. Only the marker,
header and index are read.
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from functional_ckpt._src.cli.ui import UI, human, time_text
from functional_ckpt._src.format.manifest import NodeEntry, TensorEntry
from functional_ckpt._src.recording import Replay
from functional_ckpt._src.recording.layout import Committed

__all__ = ["inspect_recording", "ls_recording", "new_bytes"]


def new_bytes(rec: Committed) -> tuple[np.ndarray, np.ndarray]:
    """Per record: (bytes it appended, leaves it appended); the others it shares."""
    locs = rec.locs
    fresh = np.ones(locs.shape, dtype=bool)
    if len(locs) > 1:
        same = (locs[1:]["seg"] == locs[:-1]["seg"]) & (locs[1:]["off"] == locs[:-1]["off"])
        fresh[1:] = ~same
    sizes = np.where(fresh, locs["n"], 0).sum(axis=1) if len(locs) else np.zeros(0)
    return sizes.astype(np.int64), fresh.sum(axis=1)


def _summary(rec: Committed) -> dict[str, Any]:
    steps = rec.steps.tolist()
    tensor_bytes = sum(e.nbytes for e in rec.leaves if isinstance(e, TensorEntry))
    return {
        "path": str(rec.path),
        "kind": "recording",
        "created": rec.header.get("created"),
        "every": rec.header.get("every"),
        "records": len(steps),
        "first_step": steps[0] if steps else None,
        "last_step": steps[-1] if steps else None,
        "leaves": len(rec.leaves),
        "tensor_bytes_per_record": tensor_bytes,
        "data_bytes": sum(rec.segments),
        "file_bytes": rec.file_bytes,
        "uncommitted_bytes": rec.tail_bytes,
        "metadata": rec.header.get("metadata"),
    }


def _summary_lines(doc: dict[str, Any], ui: UI) -> list[str]:
    span = "no records" if not doc["records"] else f"steps {doc['first_step']}..{doc['last_step']}"
    lines = [
        ui.paint(doc["path"], "head"),
        f"  recording, started {time_text(doc['created'])}, every {doc['every']} steps: "
        f"{doc['records']} committed records, {span}",
        f"  {doc['leaves']} leaves, {human(doc['tensor_bytes_per_record'])} of tensors per "
        f"record; {human(doc['data_bytes'])} of data written, {human(doc['file_bytes'])} "
        "in files",
    ]
    if doc["uncommitted_bytes"]:
        lines.append(
            f"  {human(doc['uncommitted_bytes'])} past the last commit (a crash's leftovers; "
            "not part of the recording)"
        )
    return lines


def ls_recording(args: argparse.Namespace, ui: UI) -> int:
    with Replay(args.root) as replay:
        rec = replay.committed
    added, leaves = new_bytes(rec)
    rows = list(zip(rec.steps.tolist(), added.tolist(), leaves.tolist(), strict=True))
    if args.json:
        keys = ("step", "new_bytes", "new_leaves")
        ui.json({**_summary(rec), "rows": [dict(zip(keys, row, strict=True)) for row in rows]})
        return 0
    cells = [[str(s), human(b), f"{n}/{len(rec.leaves)}"] for s, b, n in rows]
    ui.table(["STEP", "NEW BYTES", "NEW LEAVES"], cells, [["", "", "dim"]] * len(cells))
    for line in _summary_lines(_summary(rec), ui):
        ui.print(line)
    return 0


def inspect_recording(args: argparse.Namespace, ui: UI) -> int:
    with Replay(args.path) as replay:
        rec = replay.committed
    entries: list[dict[str, Any]] = []
    lines = [*_summary_lines(_summary(rec), ui), ui.paint("tree (every record)", "head")]
    for e in rec.entries:
        key = "/".join(e.path)
        if args.key and not key.startswith(args.key):
            continue
        indent, name = "  " * key.count("/"), key.rsplit("/", 1)[-1]
        if isinstance(e, TensorEntry):
            entries.append({"key": key, "kind": "tensor", "spec": e.spec, "nbytes": e.nbytes})
            size = ui.paint(human(e.nbytes), "dim")
            lines.append(f"  {indent}{name}  {ui.paint(e.spec, 'dtype')}  {size}")
        elif isinstance(e, NodeEntry):
            batch = (e.info or {}).get("batch_size", [])
            entries.append({"key": key, "kind": "node", "batch_size": batch})
            batch_text = ui.paint(f"  batch {batch}" if batch else "", "dim")
            lines.append(f"  {indent}{ui.paint(name + '/', 'key')}{batch_text}")
        else:
            entries.append({"key": key, "kind": "value"})
            lines.append(f"  {indent}{name}  = (a value, per record)")
    if args.json:
        ui.json({**_summary(rec), "entries": entries})
        return 0
    for line in lines:
        ui.print(line)
    return 0
