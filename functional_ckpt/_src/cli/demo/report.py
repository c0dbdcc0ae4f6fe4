"""The report of ``fckpt demo``: a loss sparkline, the numbers, the verdict."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from functional_ckpt._src.cli.demo.job import CKPT_DIR, CLASSES, HIDDEN, IN_DIM, RUN_DIR
from functional_ckpt._src.cli.demo.run import DemoResult

# --------------------------------------------------------------------------- report


SPARKS = "▁▂▃▄▅▆▇█"
ASCII_SPARKS = "_.-=+*#@"


def _run_losses(result: DemoResult) -> list[float]:
    """The curve the crashed-and-resumed run produced: first process, then the second."""
    resumed = result.second.resumed_from or 0
    merged = {s: v for s, v in result.first.losses.items() if s <= resumed}
    merged.update(result.second.losses)
    return [float.fromhex(merged[s]) for s in sorted(merged)]


def sparkline(
    values: Sequence[float], width: int, marks: Mapping[int, str], ascii_only: bool
) -> str:
    """Mean value per column on an 8-level (log) scale, and a second line with ``marks``.

    ``marks`` maps 1-based steps to a one-character marker placed under the
    column holding that step.
    """
    if not values:
        return ""
    levels = ASCII_SPARKS if ascii_only else SPARKS
    width = max(1, min(width, len(values)))
    cols = [values[i * len(values) // width : (i + 1) * len(values) // width] for i in range(width)]
    means = [sum(c) / len(c) for c in cols if c]
    if min(means) > 0:  # losses span decades: a log scale keeps the tail visible
        means = [math.log(m) for m in means]
    lo, hi = min(means), max(means)
    span = hi - lo or 1.0
    line = "".join(levels[min(len(levels) - 1, int((m - lo) / span * len(levels)))] for m in means)
    under = [" "] * len(means)
    for step, mark in marks.items():
        col = min(len(means) - 1, max(0, (step - 1) * width // len(values)))
        under[col] = mark
    return line + "\n" + "".join(under).rstrip()


def plot(result: DemoResult) -> Path | None:
    """A PNG of both loss curves with the crash and the resume marked, if matplotlib is there."""
    try:
        plt: Any = importlib.import_module("matplotlib.pyplot")
        return _draw(plt, result)
    except Exception:  # optional garnish: a broken matplotlib must not fail the demo
        return None


def _draw(plt: Any, result: DemoResult) -> Path:
    ref = [float.fromhex(v) for _, v in sorted(result.reference.losses.items())]
    run = _run_losses(result)
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(range(1, len(ref) + 1), ref, lw=2.5, alpha=0.4, label="reference (never stopped)")
    ax.plot(range(1, len(run) + 1), run, lw=0.8, label="crashed and resumed")
    ax.axvline(result.first.last_step, color="red", ls="--", label="SIGKILL")
    ax.axvline(result.second.resumed_from or 0, color="green", ls=":", label="resumed from")
    ax.set(xlabel="step", ylabel="training loss", title="fckpt demo")
    ax.legend()
    out = result.root / "loss.png"
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


Colour = Callable[[str, str], str]


def _plain(text: str, _style: str) -> str:
    return text


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _kept_lines(result: DemoResult) -> list[str]:
    """One line per part of the retention policy: the steps it keeps."""
    by_label: dict[str, list[int]] = {}
    for step in result.kept:
        for label in result.kept_by.get(step, []):
            by_label.setdefault(label, []).append(step)
    width = max((len(label) for label in by_label), default=0)
    return [
        f"    {label.ljust(width)}  keeps {', '.join(map(str, steps))}"
        for label, steps in by_label.items()
    ]


def _loss_text(result: DemoResult) -> str:
    n = len(result.reference.losses)
    verdict = "bit-identical" if result.losses_identical else "DIFFERENT"
    extra = f", the {result.replayed} replayed steps too" if result.replayed else ""
    return f"{n}/{n} {verdict} to the reference{extra}" if result.losses_identical else verdict


def _crash_text(result: DemoResult) -> str:
    text = f"SIGKILLed right after step {result.first.last_step}"
    if result.in_flight:
        return text + (
            f"; the save in flight was left as {result.in_flight[0]} "
            "(a temporary name: never read; on resume removed, or recovered if complete)"
        )
    return text + "; no save was in flight"


def report_lines(
    result: DemoResult, colour: Colour = _plain, ascii_only: bool = False
) -> list[str]:
    """The report as lines; ``colour(text, style)`` decorates (or not) a fragment."""
    s, first, second = result.schedule, result.first, result.second
    resumed = second.resumed_from or 0
    loop_s = first.loop_s + second.loop_s
    blocked = first.blocked_s + second.blocked_s
    saves = len(first.saves) + len(second.saves)
    committed = saves - len(result.in_flight)
    marks = {resumed or 1: "R" if ascii_only else "↺", first.last_step: "X" if ascii_only else "✗"}
    curve = sparkline(_run_losses(result), 60, marks, ascii_only).splitlines()
    mode = "async" if first.async_save else "synchronous"
    ok = result.identical
    lines = [
        f"fckpt demo report ({result.root})",
        f"  model       MLP {IN_DIM}-{HIDDEN}-{HIDDEN}-{CLASSES}, dropout 0.1, AdamW, warm-up + "
        f"cosine LR; {result.num_params / 1e6:.2f} M parameters",
        f"  save when   {s.save_policy()!r}  ({mode})",
        f"  keep        {s.retention()!r}",
        f"  crash       {_crash_text(result)}",
        f"  resume      from step {resumed} in a new process "
        f"({second.restore_s * 1000:.0f} ms to restore), trained to step {second.last_step}",
        "",
        f"  loss  {curve[0]}",
        f"        {curve[1] if len(curve) > 1 else ''}   "
        f"{marks[first.last_step]} killed at {first.last_step}, "
        f"{marks[resumed or 1]} resumed from {resumed}",
        "",
        f"  steps done           {s.steps} (+{result.replayed} replayed after the resume)",
        f"  checkpoints          {saves} saves started, {committed} committed, "
        f"{len(result.kept)} kept:",
        *_kept_lines(result),
        f"  blocked on saves     {blocked:.2f} s of {loop_s:.1f} s in the training loops "
        f"({100 * blocked / max(loop_s, 1e-9):.1f} %)",
        f"  final parameters     {result.model_tensors} tensors ({_mb(result.model_bytes)}): "
        + ("bit-identical" if not result.state_diff else "DIFFERENT"),
        "  full training state  "
        + (
            "bit-identical (optimizer moments, LR schedule, RNGs, loader position)"
            if not result.state_diff
            else f"{len(result.state_diff)} differences: " + "; ".join(result.state_diff[:3])
        ),
        f"  per-step losses      {_loss_text(result)}",
        f"  wall time            {result.wall_s:.1f} s (the reference ran alongside)",
    ]
    if result.plot is not None:
        lines.append(f"  plot                 {result.plot}")
    verdict = (
        colour("IDENTICAL", "ok") + ": the crashed and resumed run is, bit for bit, the run that "
        "never stopped."
        if ok
        else colour("NOT IDENTICAL", "bad") + ": see the differences above."
    )
    ckpts = result.root / RUN_DIR / CKPT_DIR
    lines += ["", verdict, f"Look around: fckpt ls {ckpts}   fckpt verify {ckpts}"]
    return lines


def format_report(result: DemoResult, colour: Colour = _plain, ascii_only: bool = False) -> str:
    return "\n".join(report_lines(result, colour, ascii_only))
