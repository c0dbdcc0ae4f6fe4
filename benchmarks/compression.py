"""Lossless compression of real training state: zstd levels, plain and byte-grouped.

A small transformer (token embedding, ``--layers`` encoder layers of width
``--width``, a tied output head) trains ``--steps`` steps of next-token prediction
on a fixed random corpus with AdamW, so its weights and the optimizer's two
moments hold what a real run holds (not the initial random draws). Then each part
of the state is compressed alone and the whole state together:

* fp32 weights; the same weights cast to bf16 (what a mixed-precision run or an
  export keeps); AdamW's ``exp_avg`` and ``exp_avg_sq`` (fp32);
* *plain*: the tensors' bytes as they are stored (what DCP's ``stream.zstd/1``
  transform compresses, so stock ``dcp.load`` reads it back with ``zstandard``);
* *grouped*: each element's bytes regrouped by position (all first bytes, then all
  second bytes, ...), so the exponent bytes, which repeat, sit together (the idea
  of ZipNN and DFloat11). Stock DCP has no such transform: only a reader of this
  project's format could undo it.

For each zstd level: the ratio (raw bytes / compressed bytes) and the throughput
of one core (compress, decompress; MB/s of raw bytes, one thread, best of
``--reps``). Needs ``zstandard`` (the ``zstd`` or ``bench`` extra).

Then end to end, as the remote tier sees it: ``fc.save`` of the whole state (model
and optimizer, fp32) into ``--dir`` with ``compression=None`` and each zstd level,
then its files uploaded to a store throttled to ``--gbit`` Gbit/s (an fsspec
in-memory store whose ``pipe_file``/``cat_file`` sleep ``bytes / rate``, so the link
is simulated on top of the real save and restore); then downloaded and restored
with ``fc.restore``. Only plain zstd (``compression="zstd"``) is what ``fc.save``
writes, and what stock ``dcp.load`` reads.

Last, the memory tier's replication to a peer node: the whole state's bytes streamed
over a local socket in 4 MiB pieces through a link of ``--replication-gbit`` rates
(the sender sleeps ``bytes / rate`` after each piece), raw or compressed piece by
piece on one core and decompressed on the other, the three stages overlapping as a
streamed replica would; the time until the receiver holds every byte.

Usage::

    python benchmarks/compression.py [--quick] [--steps N] [--levels 1,3,9]
                                     [--reps N] [--gbit G] [--replication-gbit 1,10,25]
                                     [--json PATH]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _common import Table, add_run_args, bench_parser, environment, finish

WEIGHTS, WEIGHTS_BF16, EXP_AVG, EXP_AVG_SQ, WHOLE = (
    "weights fp32",
    "weights bf16",
    "AdamW exp_avg",
    "AdamW exp_avg_sq",
    "whole state (fp32 weights + moments)",
)


def train(width: int, layers: int, steps: int, vocab: int = 512, seq: int = 64) -> Any:
    """A trained model and its AdamW optimizer."""
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
    body = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    embed = torch.nn.Embedding(vocab, width)
    model = torch.nn.ModuleDict({"embed": embed, "body": body})
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    corpus = torch.randint(0, vocab, (256, seq + 1), generator=torch.Generator().manual_seed(1))
    corpus[:, 1::2] = (corpus[:, 0:-1:2] * 7 + 3) % vocab  # something to learn
    mask = torch.nn.Transformer.generate_square_subsequent_mask(seq)
    for step in range(steps):
        batch = corpus[(step * 16) % 256 :][:16]
        h = body(embed(batch[:, :-1]), mask=mask, is_causal=True)
        logits = h @ embed.weight.T
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, vocab), batch[:, 1:].reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt, float(loss.detach())


def parts(model: Any, opt: Any) -> dict[str, bytes]:
    """Each part of the state as the bytes a checkpoint stores (tensors concatenated)."""

    def raw(ts: list[torch.Tensor]) -> bytes:
        return b"".join(t.detach().contiguous().view(torch.uint8).numpy().tobytes() for t in ts)

    params = list(model.parameters())
    out = {
        WEIGHTS: raw(params),
        WEIGHTS_BF16: raw([p.to(torch.bfloat16) for p in params]),
        EXP_AVG: raw([opt.state[p]["exp_avg"] for p in params]),
        EXP_AVG_SQ: raw([opt.state[p]["exp_avg_sq"] for p in params]),
    }
    out[WHOLE] = out[WEIGHTS] + out[EXP_AVG] + out[EXP_AVG_SQ]
    return out


def grouped(data: bytes, width: int) -> bytes:
    """Bytes regrouped by their position in each ``width``-byte element."""
    t = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, width)
    return t.T.contiguous().numpy().tobytes()


def measure(data: bytes, level: int, reps: int) -> dict[str, float]:
    import zstandard

    cctx = zstandard.ZstdCompressor(level=level, threads=0)
    dctx = zstandard.ZstdDecompressor()
    best_c = best_d = float("inf")
    packed = b""
    for _ in range(reps):
        t0 = time.perf_counter()
        packed = cctx.compress(data)
        best_c = min(best_c, time.perf_counter() - t0)
        t0 = time.perf_counter()
        back = dctx.decompress(packed)
        best_d = min(best_d, time.perf_counter() - t0)
        assert back == data
    mb = len(data) / 1e6
    return {
        "ratio": len(data) / len(packed),
        "compress_mb_s": mb / best_c,
        "decompress_mb_s": mb / best_d,
    }


def end_to_end(
    state: Any, levels: list[int], gbit: float, reps: int, where: Path
) -> list[dict[str, Any]]:
    """Save, upload at ``gbit``; download, restore: per compression, best of ``reps``."""
    from fsspec.implementations.memory import MemoryFileSystem

    import functional_ckpt as fc

    rate = gbit * 1e9 / 8  # bytes per second

    class Throttled(MemoryFileSystem):  # type: ignore[misc]
        """An object store behind a link of ``rate`` bytes per second."""

        def pipe_file(self, path: str, value: bytes, *a: Any, **k: Any) -> None:
            time.sleep(len(value) / rate)
            super().pipe_file(path, value, *a, **k)

        def cat_file(self, path: str, *a: Any, **k: Any) -> bytes:
            data: bytes = super().cat_file(path, *a, **k)
            time.sleep(len(data) / rate)
            return data

    store = Throttled()
    fc.save(where / "warm", state)  # the first save's one-time costs, untimed
    shutil.rmtree(where / "warm")
    rows = []
    for compression in [None, *(f"zstd:{n}" for n in levels)]:
        best: dict[str, float] = {}
        for rep in range(reps):
            ck, back = where / f"ck{rep}", where / f"back{rep}"
            times = {}
            t0 = time.perf_counter()
            fc.save(ck, state, compression=compression)
            times["save_s"] = time.perf_counter() - t0
            files = sorted(p for p in ck.iterdir())
            t0 = time.perf_counter()
            for f in files:
                store.pipe_file(f"/bench/{f.name}", f.read_bytes())
            times["upload_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            back.mkdir()
            for f in files:
                (back / f.name).write_bytes(store.cat_file(f"/bench/{f.name}"))
            times["download_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            fc.restore(back, like=state)
            times["restore_s"] = time.perf_counter() - t0
            stored = sum(f.stat().st_size for f in files)
            shutil.rmtree(ck)
            shutil.rmtree(back)
            store.rm("/bench", recursive=True)
            for k, v in times.items():
                best[k] = min(best.get(k, v), v)
        rows.append(
            {
                "compression": compression or "none",
                "gbit": gbit,
                "stored_mb": stored / 1e6,
                **best,
                "save_upload_s": best["save_s"] + best["upload_s"],
                "download_restore_s": best["download_s"] + best["restore_s"],
            }
        )
        print(f"end to end, {compression}: {rows[-1]}", file=sys.stderr, flush=True)
    return rows


def replicate(data: bytes, level: int | None, gbit: float, piece: int = 4 << 20) -> float:
    """Seconds to stream ``data`` to a receiving thread through a ``gbit`` link, each
    piece compressed at ``level`` (None: raw) and decompressed on arrival."""
    import socket
    import struct
    import threading

    import zstandard

    rate = gbit * 1e9 / 8
    send, recv = socket.socketpair()
    got: list[int] = []

    def receive() -> None:
        dctx = zstandard.ZstdDecompressor()
        total = 0
        with recv.makefile("rb") as f:
            while head := f.read(8):
                (n,) = struct.unpack("<Q", head)
                body = f.read(n)
                total += len(dctx.decompress(body)) if level is not None else len(body)
        got.append(total)

    t = threading.Thread(target=receive)
    t0 = time.perf_counter()
    t.start()
    cctx = zstandard.ZstdCompressor(level=level or 1)
    view = memoryview(data)
    for at in range(0, len(data), piece):
        body = view[at : at + piece]
        wire = cctx.compress(body) if level is not None else body
        send.sendall(struct.pack("<Q", len(wire)))
        send.sendall(wire)
        time.sleep(len(wire) / rate)  # the link's time for these bytes
    send.close()
    t.join()
    recv.close()
    assert got == [len(data)]
    return time.perf_counter() - t0


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = bench_parser(__doc__)
    p.add_argument("--quick", action="store_true", help="a tiny model, a few steps")
    p.add_argument("--steps", type=int, default=None, help="training steps (default 200)")
    p.add_argument("--width", type=int, default=None, help="model width (default 256)")
    p.add_argument("--layers", type=int, default=None, help="encoder layers (default 4)")
    p.add_argument("--levels", default="1,3,9,19", help="zstd levels, comma-separated")
    p.add_argument("--reps", type=int, default=3, help="timings per measurement (best kept)")
    p.add_argument("--gbit", type=float, default=1.0, help="the simulated link, Gbit/s")
    p.add_argument(
        "--replication-gbit",
        default="1,10,25",
        help="links between nodes for the replication rows, Gbit/s, comma-separated",
    )
    add_run_args(p, "compression")  # --dir and --allow-tmpfs too: nothing is written there
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import zstandard
    except ImportError:
        print("compression.py needs zstandard: pip install 'functional-ckpt[zstd]'")
        return 0
    steps = args.steps if args.steps is not None else (5 if args.quick else 200)
    width = args.width or (64 if args.quick else 256)
    layers = args.layers or (1 if args.quick else 4)
    levels = [int(x) for x in args.levels.split(",")]
    model, opt, loss = train(width, layers, steps)
    torch.set_num_threads(1)  # the throughputs are one core's
    state = parts(model, opt)
    rows = []
    for name, data in state.items():
        size = 2 if name == WEIGHTS_BF16 else 4
        for variant, payload in (("plain", data), ("grouped", grouped(data, size))):
            for level in levels:
                m = measure(payload, level, args.reps)
                rows.append(
                    {"part": name, "bytes": len(data), "variant": variant, "level": level, **m}
                )
                print(
                    f"{name} {variant} zstd-{level}: {m['ratio']:.3f}x", file=sys.stderr, flush=True
                )
    table = Table(["part", "MB", "variant", "level", "ratio", "compress MB/s", "decompress MB/s"])
    for r in rows:
        table.add(
            r["part"],
            f"{r['bytes'] / 1e6:.1f}",
            r["variant"],
            r["level"],
            f"{r['ratio']:.3f}x",
            f"{r['compress_mb_s']:.0f}",
            f"{r['decompress_mb_s']:.0f}",
        )
    import functional_ckpt as fc

    whole = fc.capture(model=model, optimizer=opt)
    args.dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.dir) as where:
        e2e = end_to_end(whole, levels, args.gbit, args.reps, Path(where))
    link = Table(["compression", "stored MB", "save", "upload", "save+upload", "download+restore"])
    for r in e2e:
        link.add(
            r["compression"],
            f"{r['stored_mb']:.1f}",
            f"{r['save_s']:.3f}",
            f"{r['upload_s']:.3f}",
            f"{r['save_upload_s']:.3f}",
            f"{r['download_restore_s']:.3f}",
        )
    replication = []
    whole_bytes = state[WHOLE]
    for gbit in (float(x) for x in args.replication_gbit.split(",")):
        raw_s = min(replicate(whole_bytes, None, gbit) for _ in range(args.reps))
        for level in [None, *levels[:2]]:
            secs = (
                raw_s
                if level is None
                else min(replicate(whole_bytes, level, gbit) for _ in range(args.reps))
            )
            replication.append(
                {"gbit": gbit, "level": level, "seconds": secs, "vs_raw": secs / raw_s}
            )
            print(f"replication {gbit:g} Gbit/s zstd {level}: {secs:.3f} s", file=sys.stderr)
    repl = Table(["link Gbit/s", "compression", "seconds", "vs raw"])
    for r in replication:
        name = "none" if r["level"] is None else f"zstd:{r['level']}"
        repl.add(f"{r['gbit']:g}", name, f"{r['seconds']:.3f}", f"{r['vs_raw']:.2f}x")
    params = sum(p.numel() for p in model.parameters())
    print(
        f"\nzstd {zstandard.ZSTD_VERSION}, a trained transformer: {params / 1e6:.2f}M params, "
        f"{steps} AdamW steps (final loss {loss:.3f}); one thread; best of {args.reps}.\n"
    )
    print(table.render())
    print(f"\nEnd to end through a {args.gbit:g} Gbit/s link (seconds, best of {args.reps}):\n")
    print(link.render())
    print(
        f"\nReplication to a peer: {len(whole_bytes) / 1e6:.1f} MB streamed in 4 MiB pieces "
        f"(seconds, best of {args.reps}):\n"
    )
    print(repl.render())
    payload = {
        "benchmark": "compression",
        "config": {
            "steps": steps,
            "width": width,
            "layers": layers,
            "levels": levels,
            "params": params,
            "final_loss": loss,
            "gbit": args.gbit,
            "reps": args.reps,
        },
        "end_to_end": e2e,
        "replication": replication,
        "environment": environment(),
        "rows": rows,
        "targets": [],
    }
    return finish(args, payload)


if __name__ == "__main__":
    sys.exit(main())
