"""Write docs/performance.md, its chart and the README's headline ratios from the JSON.

The numbers a reader sees are never copied by hand: a benchmark run writes its JSON
(``--json``), the run worth keeping is copied to ``benchmarks/results/``, and this
script turns what is there into

* ``docs/performance.md``: every row of the run, fc against its floors, the targets;
* ``docs/performance.png``: each tool's save and restore time against the raw floor
  (matplotlib, the ``bench`` extra);
* the block of README.md between ``<!-- headline:begin -->`` and ``<!-- headline:end -->``:
  three ratios of the same run.

``--check`` writes nothing and fails if the Markdown differs from what the JSON says
(the test suite runs it; the chart is only drawn where matplotlib is installed).

Usage::

    python benchmarks/report.py [--results DIR] [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
PAGE = REPO / "docs" / "performance.md"
CHART = REPO / "docs" / "performance.png"
README = REPO / "README.md"
BEGIN, END = "<!-- headline:begin -->", "<!-- headline:end -->"

#: The tools of the chart, with the raw floor each is measured against.
SAVES = ["fc.save", "torch.save+fsync", "safetensors.save_file+fsync", "dcp.save"]
RESTORES = [
    "fc.restore(like)",
    "fc.restore(out=)",
    "torch.load(weights_only)",
    "dcp.load(template)",
]
RAW_SAVE, RAW_READ = "raw write+fsync", "raw read into template"
SHORT = {
    "torch.save+fsync": "torch.save",
    "safetensors.save_file+fsync": "safetensors",
    "fc.restore(like)": "fc (like)",
    "fc.restore(out=)": "fc (out=)",
    "torch.load(weights_only)": "torch.load",
    "dcp.load(template)": "dcp.load",
}
STATES = {"big": "1 GiB of large tensors", "small": "10k small tensors + 1k values"}


def load(results: Path, name: str) -> dict[str, Any] | None:
    path = results / f"{name}.json"
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def medians(run: dict[str, Any]) -> dict[tuple[str, str, str], float]:
    return {(r["state"], r["op"], r["tool"]): r["median_s"] for r in run["rows"]}


def seconds(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s < 1 else f"{s:.2f} s"


def headline(run: dict[str, Any]) -> list[str]:
    """Three ratios of one run, as the README states them."""
    m = medians(run)

    def r(state: str, op: str, tool: str, other: str) -> str:
        return f"{m[(state, op, tool)] / m[(state, op, other)]:.2f}x"

    return [
        "- saving 10,000 small tensors and 1,000 values takes "
        f"{r('small', 'save', 'fc.save', 'torch.save+fsync')} the time of `torch.save` "
        f"(fsynced) and {r('small', 'save', 'fc.save', 'dcp.save')} that of stock `dcp.save`;",
        f"- restoring them takes {r('small', 'restore', 'fc.restore(like)', 'dcp.load(template)')}"
        " the time of stock `dcp.load`;",
        "- against `torch_checkpointing` made durable through its hooks, saving them takes "
        f"{r('small', 'save', 'fc.save', 'torch_checkpointing save+fsync hooks')} its time and "
        "restoring them "
        f"{r('small', 'restore', 'fc.restore(like)', 'torch_checkpointing load() new tensors')}.",
    ]


def about(run: dict[str, Any], script: str) -> str:
    env, cfg = run.get("environment", {}), run.get("config", {})
    when = f" ({run['started']})" if run.get("started") else ""
    return (
        f"`python benchmarks/{script}`{when}, {cfg.get('reps', '?')} repetitions, medians; "
        f"{env.get('cpus', '?')} CPUs, torch {env.get('torch', '?')}, python "
        f"{env.get('python', '?')}."
    )


def save_restore_page(run: dict[str, Any]) -> list[str]:
    m = medians(run)
    out = [
        "## Save and restore",
        "",
        about(run, "save_restore.py") + " Every save is fsynced; each restore reads the "
        "files its tool has just written (a warm page cache). `fc / tool` below 1 means "
        "fc took less time; `spread` is the fastest and the slowest repetition, where a "
        "wide one says the machine's other work (its disk above all) set the pace.",
        "",
        "![save and restore time against the raw floor](performance.png)",
        "",
    ]
    for state, label in STATES.items():
        rows = [r for r in run["rows"] if r["state"] == state and r["op"] != "checksum"]
        if not rows:
            continue
        out += [f"### {label}", "", "| op | tool | median | spread | GB/s | fc / tool | note |"]
        out.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            fc = m.get((state, r["op"], "fc.save" if r["op"] == "save" else "fc.restore(like)"))
            vs = "" if fc is None else f"{fc / r['median_s']:.2f}x"
            note = r["note"].replace("|", "/")
            spread = f"{seconds(min(r['times_s']))} - {seconds(max(r['times_s']))}"
            out.append(
                f"| {r['op']} | {r['tool']} | {seconds(r['median_s'])} | {spread} "
                f"| {r['gb_per_s']:.2f} | {vs} | {note} |"
            )
        out.append("")
    if run.get("floors"):
        out += ["### fc against its floors", ""]
        out += [f"- {line}" for line in run["floors"]] + [""]
    if run.get("targets"):
        out += ["### Targets", "", "| state | target | measured | limit | result |"]
        out.append("| --- | --- | --- | --- | --- |")
        for t in run["targets"]:
            value = "-" if t.get("value") is None else f"{t['value']:.3f}"
            out.append(
                f"| {t.get('state', '')} | {t['target']} | {value} | {t['limit']} | {t['result']} |"
            )
        out.append("")
    ab = run.get("template_ab")
    if ab:
        out += [
            f"Restoring the {ab['state']} state into a template (`fc.restore(path, like)`) costs "
            f"{ab['ratio']:.2f}x a restore without one (like / no template: "
            f"{seconds(ab['like_s'])} against {seconds(ab['none_s'])} of CPU time, medians of "
            f"{ab['reps']} alternating restores in one process"
            + (f", {ab['measured']}" if ab.get("measured") else "")
            + "; the wall-clock row above also counts what the machine's other work took).",
            "",
        ]
    return out


def cli_page(run: dict[str, Any]) -> list[str]:
    out = ["## Start-up", "", about(run, "cli_startup.py"), ""]
    out += ["| command | median | against `python -c pass` |", "| --- | --- | --- |"]
    for r in run["rows"]:
        out.append(f"| `{r['command']}` | {seconds(r['median_s'])} | {r['ratio']:.2f}x |")
    out += ["", "| target | measured | result |", "| --- | --- | --- |"]
    for t in run.get("targets", []):
        out.append(f"| {t['target']} | {t['value']:.2f}x | {t['result']} |")
    return [*out, ""]


def compression_page(run: dict[str, Any]) -> list[str]:
    cfg, env = run.get("config", {}), run.get("environment", {})
    when = f" ({run['started']})" if run.get("started") else ""
    out = [
        "## Compression",
        "",
        f"`python benchmarks/compression.py`{when}: a transformer of "
        f"{cfg.get('params', 0) / 1e6:.2f}M parameters trained {cfg.get('steps', '?')} AdamW "
        f"steps; {env.get('cpus', '?')} CPUs, torch {env.get('torch', '?')}. Ratio is raw "
        "bytes over compressed bytes; throughputs are one core's, in MB/s of raw bytes, "
        'best of the repetitions. `plain` is what `compression="zstd"` writes (DCP\'s '
        "`stream.zstd/1`, which stock `dcp.load` reads); `grouped` regroups each "
        "element's bytes first, which no stock reader undoes (measured, not written).",
        "",
        "| part | MB | variant | level | ratio | compress MB/s | decompress MB/s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in run["rows"]:
        out.append(
            f"| {r['part']} | {r['bytes'] / 1e6:.1f} | {r['variant']} | {r['level']} "
            f"| {r['ratio']:.3f}x | {r['compress_mb_s']:.0f} | {r['decompress_mb_s']:.0f} |"
        )
    e2e = run.get("end_to_end", [])
    if e2e:
        out += [
            "",
            f"End to end through a {cfg.get('gbit', 1):g} Gbit/s link (`fc.save` of the "
            "whole state, then its files sent to an in-memory object store whose writes "
            "and reads sleep bytes / rate; back the same way, then `fc.restore`), seconds:",
            "",
            "| compression | stored MB | save | upload | save + upload | download + restore |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for r in e2e:
            out.append(
                f"| {r['compression']} | {r['stored_mb']:.1f} | {r['save_s']:.3f} "
                f"| {r['upload_s']:.3f} | {r['save_upload_s']:.3f} "
                f"| {r['download_restore_s']:.3f} |"
            )
        by = {r["compression"]: r for r in e2e}
        if "none" in by and "zstd:1" in by:
            up = by["zstd:1"]["save_upload_s"] / by["none"]["save_upload_s"]
            down = by["zstd:1"]["download_restore_s"] / by["none"]["download_restore_s"]
            verdict = "falls" if max(up, down) < 1 else "does not fall"
            out += [
                "",
                f"Against no compression, `zstd:1` takes {up:.2f}x the time to save and "
                f"upload and {down:.2f}x to download and restore: the end-to-end time "
                f"{verdict}, so the remote tier leaves compression off by default.",
            ]
    repl = run.get("replication", [])
    if repl:
        out += [
            "",
            "The memory tier's replication to a peer node: the whole state streamed over a "
            "local socket in 4 MiB pieces through a link that sleeps bytes / rate, each piece "
            "compressed on one core and decompressed on the other as it arrives, the stages "
            "overlapping; seconds until the peer holds every byte:",
            "",
            "| link Gbit/s | compression | seconds | vs raw |",
            "| --- | --- | --- | --- |",
        ]
        for r in repl:
            name = "none" if r["level"] is None else f"zstd:{r['level']}"
            out.append(f"| {r['gbit']:g} | {name} | {r['seconds']:.3f} | {r['vs_raw']:.2f}x |")
        pays = sorted({r["gbit"] for r in repl if r["level"] is not None and r["vs_raw"] < 1})
        fast = max(r["gbit"] for r in repl)
        out += [
            "",
            (
                f"Compression shortens a replica only at {', '.join(f'{g:g}' for g in pays)} "
                "Gbit/s here"
                if pays
                else "Compression shortens no replica at any link measured here"
            )
            + f"; at {fast:g} Gbit/s and above (what the nodes of a training cluster have) "
            "one core compresses slower than the link sends, so replication sends raw bytes "
            "and has no compression option.",
        ]
    return [*out, ""]


def page(results: Path) -> str:
    out = [
        "# Performance",
        "",
        "<!-- generated by benchmarks/report.py from benchmarks/results/*.json: edit the "
        "script or rerun the benchmarks, not this page -->",
        "",
        "Every number on this page comes from the JSON a benchmark script wrote, turned "
        "into this page by `python benchmarks/report.py`. The machine is shared: compare "
        "the ratios within a run, not absolute times across runs. What each script "
        "measures, and why, is its docstring.",
        "",
    ]
    run = load(results, "save_restore")
    if run is not None:
        out += save_restore_page(run)
    startup = load(results, "cli_startup")
    if startup is not None:
        out += cli_page(startup)
    packed = load(results, "compression")
    if packed is not None:
        out += compression_page(packed)
    return "\n".join(out).rstrip("\n") + "\n"


def readme(results: Path, text: str) -> str:
    """README.md with its headline block made from the run."""
    run = load(results, "save_restore")
    if run is None or BEGIN not in text:
        return text
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n" + "\n".join(headline(run)) + f"\n{END}{tail}"


def chart(results: Path, out: Path) -> None:
    """Each tool's median save and restore time as a multiple of the raw floor."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = load(results, "save_restore")
    if run is None:
        return
    m = medians(run)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, (op, tools, floor) in zip(
        axes, [("save", SAVES, RAW_SAVE), ("restore", RESTORES, RAW_READ)], strict=True
    ):
        width = 0.38
        for i, state in enumerate(STATES):
            base = m.get((state, op, floor))
            ys = [m.get((state, op, t), 0.0) / base if base else 0.0 for t in tools]
            xs = [j + (i - 0.5) * width for j in range(len(tools))]
            ax.bar(xs, ys, width, label=STATES[state])
        ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
        ax.set_xticks(range(len(tools)), [SHORT.get(t, t) for t in tools])
        ax.set_title(f"{op}: time / {floor}")
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", type=Path, default=RESULTS)
    p.add_argument("--check", action="store_true", help="fail if the pages are stale")
    args = p.parse_args(argv)
    want = {PAGE: page(args.results), README: readme(args.results, README.read_text("utf-8"))}
    stale = [p for p, text in want.items() if not p.is_file() or p.read_text("utf-8") != text]
    if args.check:
        for path in stale:
            print(
                f"{path.relative_to(REPO)} differs from what {args.results} says", file=sys.stderr
            )
        return 1 if stale else 0
    for path in stale:
        path.write_text(want[path], encoding="utf-8")
    chart(args.results, CHART)
    print(f"wrote {PAGE.relative_to(REPO)}, {CHART.relative_to(REPO)}; README headline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
