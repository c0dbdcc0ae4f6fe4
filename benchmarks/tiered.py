"""The remote tier against s3fs itself, on one S3-protocol server (moto, on loopback).

What is compared, in one run, against the same server (moto's standalone server,
started by this script in a child process on a free 127.0.0.1 port; it stands in
for another machine, so it runs at the lowest CPU priority and keeps its objects
in memory, not in temporary files on this machine's disk):

``upload``
    *fc upload*: the remote tier's commit of one local checkpoint (the manifest,
    every file through s3fs's bulk ``put`` in the tier's helper process, started
    beforehand as a manager starts it when it opens, every object confirmed, the
    marker);
    *s3fs put*: ``S3FileSystem.put`` of the same files to another prefix.
``restore``
    *fc restore_latest (remote)*: ``CheckpointManager(empty root,
    tiers=[Remote(...)]).restore_latest(like)`` (the call only, not opening the manager):
    listing, parallel download, ``fc.verify`` of every byte, local commit, restore;
    *s3fs get + fc.restore*: ``S3FileSystem.get`` of the same files, then
    ``fc.restore`` of them.
``training stall``
    A training loop (in-place updates of a state of a quarter of the checkpoint's
    size, plus matmuls) saving every 10 steps with
    ``CheckpointManager(async_save=True)``, with and without ``remote=`` (100
    steps, 10 saves, uploading all the time); *stall* is the time the loop spent
    blocked in ``maybe_save`` and ``wait_staged`` (which includes waiting for the
    previous save to commit before the next one).

Every measurement runs ``--reps`` times, interleaved; medians are reported, and
the targets are checked on the median of the per-repetition ratios (each pair of
tools runs back to back):

* upload throughput >= 0.9x s3fs ``put`` (time <= 1/0.9 x);
* stall with uploads running <= 1.1x the stall without;
* restore from remote <= 1.1x s3fs ``get`` plus the local ``fc.restore``.

Usage::

    python benchmarks/tiered.py [--quick] [--size MiB] [--reps N] [--dir DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from _common import (
    REPO_ROOT,
    MiB,
    Table,
    add_run_args,
    bench_parser,
    check_not_tmpfs,
    environment,
    finish,
    fmt_seconds,
    median,
    ratio,
    remove_path,
    render_targets,
    rotate,
    scratch_dir,
    settle,
    verdict,
)
from _common import timed as time_call

sys.path.insert(0, str(REPO_ROOT))

import functional_ckpt as fc
from functional_ckpt._src.remote import protocol
from functional_ckpt._src.remote.store import Store

UPLOAD_FC, UPLOAD_S3 = "fc upload", "s3fs put"
RESTORE_FC, RESTORE_S3 = "fc restore_latest (remote)", "s3fs get + fc.restore"
STALL_LOCAL, STALL_REMOTE = "manager, local only", "manager, remote uploads running"
#: Matmuls (512 x 512) per training step.
COMPUTE = 40


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    """moto's S3 server in a child process (its work does not share our interpreter)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = (
        "import sys, time\n"
        "from moto.server import ThreadedMotoServer\n"
        "s = ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False)\n"
        "s.start()\n"
        "print('ready', flush=True)\n"
        "time.sleep(1e9)\n"
    )
    # The server stands in for another machine: at the lowest CPU priority, its own
    # work (which a real object store does not put on the training machine) is not
    # counted as the client's.
    # Nor does its disk: moto spills every object over 5 MiB to a temporary file, whose
    # writeback would land on this machine's disk beside the checkpoints; a buffer of
    # 8 GiB keeps the objects in the server's memory.
    env = {**os.environ, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(8 << 30)}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: os.nice(19),
        env=env,
    )
    assert proc.stdout is not None
    proc.stdout.readline()
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc, endpoint
        time.sleep(0.05)
    raise RuntimeError("moto server did not start")


def make_state(nbytes: int, n: int = 16) -> dict[str, torch.Tensor]:
    per = max(1, nbytes // n // 4)
    g = torch.Generator().manual_seed(0)
    return {f"t{i:02d}": torch.randn(per, generator=g) for i in range(n)}


def files_of(path: Path) -> list[Path]:
    return sorted(p for p in path.iterdir() if p.is_file())


def fc_upload(store: Store, step: int, local: Path) -> None:
    """What one upload round does for one checkpoint on one rank."""
    sizes = protocol.expected_sizes(local)
    present = protocol.begin_upload(store, step, local)
    names = [n for n in os.listdir(local) if n not in ("COMMITTED", "manifest.msgpack")]
    protocol.put_part(store, step, local, names, present or {})
    protocol.commit_upload(store, step, local, sizes)


def s3fs_put(store: Store, prefix: str, local: Path) -> None:
    files = files_of(local)
    store.fs.put([str(f) for f in files], [f"{prefix}/{f.name}" for f in files])


def train_stall(
    workdir: Path, remote: str | None, options: dict[str, Any], nbytes: int, steps: int
) -> float:
    """Seconds the loop spent in checkpoint calls (the rest is compute)."""
    state = make_state(nbytes, 8)
    x = torch.randn(512, 512)
    root = workdir / f"train-{uuid.uuid4().hex[:6]}"
    stall = 0.0
    kwargs: dict[str, Any] = {}
    if remote is not None:
        kwargs = {
            "tiers": [fc.manager.Remote(remote, keep=fc.keep_last(2), storage_options=options)]
        }
    mgr = fc.CheckpointManager(
        root, save=fc.every_steps(10), keep=fc.keep_last(2), async_save=True, **kwargs
    )
    try:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            mgr.wait_staged()
            stall += time.perf_counter() - t0
            for t in state.values():
                t.mul_(0.999).add_(0.001)
            for _ in range(COMPUTE):  # a step long enough for the async save to overlap
                x = torch.tanh(x @ x.T / 512.0)
            t0 = time.perf_counter()
            mgr.maybe_save(state, step=step)
            stall += time.perf_counter() - t0
        mgr.wait()  # the last save's commit, after the loop: not a stall of the loop
    finally:
        mgr.close()  # waits for the uploads: not timed
        remove_path(root)
    return stall


def run(args: argparse.Namespace, workdir: Path, endpoint: str) -> dict[str, list[float]]:
    options = {"client_kwargs": {"endpoint_url": endpoint}}
    bucket = f"bench-{uuid.uuid4().hex[:8]}"
    Store(f"s3://{bucket}", options).fs.mkdir(bucket)
    nbytes = int(args.size * MiB)
    state = make_state(nbytes)
    like = {k: torch.empty_like(v) for k, v in state.items()}
    src_root = workdir / "src"
    fc.save(src_root / "step_000000001", state)
    local = src_root / "step_000000001"
    times: dict[str, list[float]] = {}

    def timed(label: str, fn: Callable[[], Any]) -> None:
        settle()
        times.setdefault(label, []).append(time_call(fn)[0])

    # The checkpoint every restore reads, uploaded once.
    remote_root = f"s3://{bucket}/restore"
    fc_upload(Store(remote_root, options), 1, local)
    reads = Store(remote_root, options)
    for k in range(args.reps):
        store = Store(f"s3://{bucket}/up{k}", options)
        store.start_uploads()  # as a manager does when it opens
        jobs: list[tuple[str, Callable[[], Any]]] = [
            (UPLOAD_FC, lambda s=store: fc_upload(s, 1, local)),
            (UPLOAD_S3, lambda s=store: s3fs_put(s, f"{s.base}/put", local)),
        ]
        for label, fn in rotate(jobs, k):
            timed(label, fn)
        store.fs.rm(store.base, recursive=True)
        store.close()

        def fc_restore() -> float:
            """Seconds of ``restore_latest`` (opening the manager is not counted)."""
            root = workdir / f"fresh-{uuid.uuid4().hex[:6]}"
            with fc.CheckpointManager(
                root, tiers=(fc.manager.Remote(remote_root, storage_options=options),)
            ) as mgr:
                mgr.remote.wait()  # the upload round every open starts: nothing to send
                settle()
                t0 = time.perf_counter()
                assert mgr.restore_latest(like=like) is not None
                seconds = time.perf_counter() - t0
            remove_path(root)
            return seconds

        def s3_restore() -> None:
            dest = workdir / f"get-{uuid.uuid4().hex[:6]}" / "step_000000001"
            dest.mkdir(parents=True)
            names = sorted(reads.objects(1))
            reads.fs.get([reads.object_path(1, n) for n in names], [str(dest / n) for n in names])
            fc.restore(dest, like)
            remove_path(dest.parent)

        for label in rotate([RESTORE_FC, RESTORE_S3], k):
            if label == RESTORE_FC:
                times.setdefault(label, []).append(fc_restore())
            else:
                timed(label, s3_restore)
        stall_jobs = [
            (STALL_LOCAL, None),
            (STALL_REMOTE, f"s3://{bucket}/train{k}"),
        ]
        for label, remote in rotate(stall_jobs, k):
            settle()
            stall = train_stall(workdir, remote, options, nbytes // 4, args.steps)
            times.setdefault(label, []).append(stall)
    return times


def paired(times: dict[str, list[float]], num: str, den: str) -> float | None:
    """Median over repetitions of ``num / den``: each pair ran back to back, so the
    ratio does not follow the drift of a shared machine's speed between repetitions."""
    ratios = [ratio(a, b) for a, b in zip(times[num], times[den], strict=True)]
    values = [r for r in ratios if r is not None]
    return median(values) if values else None


def evaluate(times: dict[str, list[float]]) -> list[dict[str, Any]]:
    throughput = paired(times, UPLOAD_S3, UPLOAD_FC)
    stall = paired(times, STALL_REMOTE, STALL_LOCAL)
    restore = paired(times, RESTORE_FC, RESTORE_S3)
    return [
        {
            "target": "upload throughput / s3fs put",
            "value": throughput,
            "limit": 0.9,
            "result": "SKIP" if throughput is None else ("PASS" if throughput >= 0.9 else "FAIL"),
        },
        {
            "target": "training stall, uploads running / without",
            "value": stall,
            "limit": 1.1,
            "result": verdict(stall, 1.1),
        },
        {
            "target": "restore from remote / (s3fs get + fc.restore)",
            "value": restore,
            "limit": 1.1,
            "result": verdict(restore, 1.1),
        },
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a tiny checkpoint and 1 repetition")
    p.add_argument("--size", type=float, default=None, help="checkpoint MiB (default 1024)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 5, quick 1)")
    p.add_argument(
        "--steps", type=int, default=None, help="training steps per stall run (default 100)"
    )
    add_run_args(p, "tiered")
    args = p.parse_args(argv)
    args.size = args.size or (4.0 if args.quick else 1024.0)
    args.reps = args.reps or (1 if args.quick else 5)
    args.steps = args.steps or (10 if args.quick else 100)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    fstype = check_not_tmpfs(args.dir, allow=args.allow_tmpfs)
    workdir = scratch_dir(args.dir)
    server, endpoint = start_server()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    try:
        times = run(args, workdir, endpoint)
    finally:
        server.kill()
        server.wait()
        remove_path(workdir)
    targets = evaluate(times)
    nbytes = int(args.size * MiB)
    rows = [
        {
            "op": op,
            "tool": tool,
            "times_s": times[tool],
            "median_s": median(times[tool]),
            "bytes": nbytes // 4 if op == "stall" else nbytes,
        }
        for op, tool in [
            ("upload", UPLOAD_FC),
            ("upload", UPLOAD_S3),
            ("restore", RESTORE_FC),
            ("restore", RESTORE_S3),
            ("stall", STALL_LOCAL),
            ("stall", STALL_REMOTE),
        ]
    ]
    print(
        f"\nfunctional_ckpt remote-tier benchmark ({started}): {args.reps} repetitions, "
        f"medians; a {args.size:g} MiB checkpoint (16 float32 tensors); moto S3 server "
        f"on loopback; scratch {args.dir} ({fstype}); torch {torch.__version__}."
    )
    table = Table(["op", "tool", "median", "MiB/s"])
    for r in rows:
        rate = r["bytes"] / MiB / r["median_s"] if r["op"] != "stall" else None
        table.add(
            r["op"], r["tool"], fmt_seconds(r["median_s"]), "-" if rate is None else f"{rate:.0f}"
        )
    print("\n" + table.render())
    print("\n" + render_targets(targets))
    if args.quick:
        print("(--quick: the checkpoint is too small for the targets to mean anything)")
    payload = {
        "benchmark": "tiered",
        "started": started,
        "config": {
            "reps": args.reps,
            "quick": args.quick,
            "size_mib": args.size,
            "steps": args.steps,
            "dir": str(args.dir),
            "filesystem": fstype,
        },
        "environment": environment(),
        "rows": rows,
        "targets": targets,
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
