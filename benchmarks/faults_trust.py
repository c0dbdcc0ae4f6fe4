"""Fault classes of the third attack suite: the places where one path went around a safe primitive.

Run by ``benchmarks/faults.py`` (``--scenarios trust-...``), in that table's columns:
*lost* is a checkpoint that no longer verifies or restores after the attack (or a
wrong root written into), *other* a raw exception, a hang or an escape that reached
the terminal, *detected* a hostile input refused as it should be. Each class:

* ``trust-floods``: hash floods (keys ``k * (2**61 - 1)``, all hashing to 0) in every
  decoder of untrusted bytes: the restricted unpickler (a stock checkpoint's and a
  re-signed ``.metadata`` of ours, every opcode that fills a table), stock DCP's
  pickled plain values (the msgpack manifest's floods are ``values-decoder-complexity``);
  each read runs in a forked child with a hang guard and must be refused (or read as
  not plain) without the quadratic cost.
* ``trust-links``: a step that is a symbolic link to another run's checkpoint, under
  ``delete``, retention, ``rollback`` and ``fc.manager.remove_checkpoint``: the other run's
  checkpoint must still verify.
* ``trust-roots``: a manager opened on a checkpoint, stock DCP, an export, a
  recording, a file, or a directory inside a checkpoint, writing and read-only:
  refused with a ``CheckpointError``, nothing in the wrong root changed.
* ``trust-remote``: forged newest remote checkpoints on the resume path of a fresh
  machine (``COMMITTED`` or the manifest in the file table, an integer file name
  with an object beside it, a file table that is no map, junk entries, a size that
  lies): the previous remote step is restored, with a ``RemoteWarning``.
* ``trust-terminal``: control characters, a right-to-left override and line breaks
  in key names, values and metadata, through every ``fckpt`` command that prints
  them, plain and coloured: nothing a terminal would act on reaches the output.
* ``trust-state-files``: the remote status file replaced by a FIFO, a link to
  ``/dev/zero``, a 64 MiB file or garbage: ``fckpt ls`` answers (in a forked child
  with a hang guard) and the manager resumes.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import functional_ckpt as fc
from functional_ckpt._src.format.naming import step_name

#: Keys that all hash to 0 on a 64-bit CPython.
FLOOD_KEYS = [k * (2**61 - 1) for k in range(1, 20_001)]

_RAW = ("\x1b", "\x07", "\r", "\x9b", "\u202e")
_SGR = re.compile(r"\x1b\[[0-9;]*m")


def _faults() -> Any:
    import sys

    return sys.modules.get("fc_faults") or sys.modules["__main__"]


def _state(v: float) -> dict[str, Any]:
    return {"w": torch.full((16,), v), "b": torch.full((4,), v), "step": int(v)}


def _intact(path: Path, v: float) -> bool:
    try:
        return fc.verify(path).ok and torch.equal(fc.restore(path)["w"], torch.full((16,), v))
    except fc.CheckpointError:
        return False


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except fc.errors.UnsafeCheckpoint as e:
        return "refused" if "hash" in str(e) or "not plain data" in str(e) else f"unsafe: {e}"
    except fc.CheckpointError as e:
        return f"checkpoint-error: {type(e).__name__}: {e}"
    except Exception as e:
        return f"raw: {type(e).__name__}: {e}"
    return "accepted"


# --------------------------------------------------------------------------- floods


def _flood_pickles() -> dict[str, bytes]:
    keys = FLOOD_KEYS
    return {
        "dict (SETITEMS)": pickle.dumps(dict.fromkeys(keys, 0), protocol=2),
        "dict (DICT, protocol 0)": pickle.dumps(dict.fromkeys(keys[:5000], 0), protocol=0),
        "set (ADDITEMS)": pickle.dumps(set(keys), protocol=4),
        "frozenset (FROZENSET)": pickle.dumps(frozenset(keys), protocol=4),
        "one SETITEM per key": b"\x80\x02}"
        + b"".join(pickle.dumps(k, protocol=2)[2:-1] + b"Ns" for k in keys)
        + b".",
    }


def scenario_floods(scale: Any, base: Path, seed: int) -> Any:
    faults = _faults()
    res = faults.Result("hash floods in every decoder")
    for label, raw in _flood_pickles().items():
        for where in ("stock .metadata", "our .metadata (re-signed)"):
            work = base / f"flood{res.trials}"
            if where.startswith("stock"):
                work.mkdir(parents=True)
                (work / ".metadata").write_bytes(raw)
                probe: Callable[[], Any] = lambda w=work: _outcome(lambda: fc.inspect(w))  # noqa: E731
            else:
                fc.save(work, _state(1.0))
                _install_metadata(work, raw)
                probe = lambda w=work: "refused" if not fc.verify(w).ok else "accepted"  # noqa: E731
            _judge(res, f"{label}, {where}", faults.run_forked(probe, timeout=60))
    # stock DCP's pickled plain values
    import torch.distributed.checkpoint as dcp

    stock = base / "stock-values"
    flooded = (dict.fromkeys(FLOOD_KEYS[:5000], 0),)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.ones(2), "v": flooded}, checkpoint_id=str(stock), no_dist=True)
    probe = lambda: _outcome(  # noqa: E731
        lambda: fc.restore(stock, {"w": torch.zeros(2), "v": ()})
    )
    _judge(res, "stock DCP plain value", faults.run_forked(probe, timeout=60))
    return res


def _install_metadata(path: Path, raw: bytes) -> None:
    import zlib

    (path / ".metadata").write_bytes(raw)

    def edit(m: dict[str, Any]) -> None:
        m["files"][".metadata"] = {"size": len(raw), "crc32": zlib.crc32(raw)}

    _faults().edit_manifest(path, edit)


def _judge(res: Any, label: str, out: Any) -> None:
    res.trials += 1
    res.corruptions += 1
    if out is None or (isinstance(out, dict) and out.get("hang")):
        res.problem("hang", f"{label}: no answer within 60 s")
    elif out == "refused":
        res.detected += 1
    elif isinstance(out, str) and out.startswith("raw"):
        res.problem("raw", f"{label}: {out}")
    else:
        res.problem("accepted", f"{label}: {out}", column="torn")


# --------------------------------------------------------------------------- links


def scenario_links(scale: Any, base: Path, seed: int) -> Any:
    faults = _faults()
    res = faults.Result("symlinked steps under delete / prune / rollback / remove")
    actions: dict[str, Callable[[Path, Path], None]] = {
        "delete": lambda root, link: _with(root, lambda m: m.delete(5)),
        "prune (keep_last)": lambda root, link: _with(
            root, lambda m: [m.maybe_save(_state(s), step=s) for s in (7, 8)], keep=fc.keep_last(1)
        ),
        "rollback": lambda root, link: _with(root, lambda m: m.rollback(1)),
        "remove": lambda root, link: fc.manager.remove_checkpoint(link),
        "resume": lambda root, link: _with(root, lambda m: m.restore_latest()),
    }
    for i, (label, act) in enumerate(actions.items()):
        other = base / f"other{i}" / step_name(5)
        fc.save(other, _state(5.0))
        root = base / f"root{i}"
        with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
            mgr.maybe_save(_state(1.0), step=1)
        link = root / step_name(5)
        os.symlink(other, link)
        res.trials += 1
        try:
            act(root, link)
        except fc.CheckpointError:
            res.bump("refused")
        except Exception as e:
            res.problem("raw", f"{label}: {type(e).__name__}: {e}")
        if not _intact(other, 5.0):
            res.problem("followed", f"{label}: the linked checkpoint was damaged", column="lost")
    return res


def _with(root: Path, fn: Callable[[Any], Any], keep: Any = None) -> None:
    with fc.CheckpointManager(root, fc.every_steps(1), keep) as mgr:
        fn(mgr)


# --------------------------------------------------------------------------- roots


def scenario_roots(scale: Any, base: Path, seed: int) -> Any:
    import torch.distributed.checkpoint as dcp

    faults = _faults()
    res = faults.Result("wrong manager roots (checkpoint, DCP, export, recording, file)")
    root = base / "root"
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.maybe_save(_state(2.0), step=2)
    stock = base / "stock"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": torch.zeros(2)}, checkpoint_id=str(stock), no_dist=True)
    export = fc.export_safetensors({"model": {"w": torch.zeros(2)}}, base / "export")
    recording = base / "recording"
    with fc.recording.Recorder(recording, every=1) as rec:
        rec.record({"w": torch.zeros(2)}, step=0)
    (base / "file").write_text("x")
    wrong = {
        "a checkpoint": root / step_name(2),
        "inside a checkpoint": root / step_name(2) / "nested",
        "stock DCP": stock,
        "an export": Path(export),
        "a recording": recording,
        "a file": base / "file",
    }
    for label, path in wrong.items():
        for read_only in (False, True):
            res.trials += 1
            before = _listing(path.parent if label.startswith("inside") else path)
            try:
                fc.CheckpointManager(path, read_only=read_only).close()
                res.problem("accepted", f"{label} (read_only={read_only})", column="lost")
            except fc.CheckpointError:
                res.bump("refused")
            except Exception as e:
                res.problem("raw", f"{label}: {type(e).__name__}: {e}")
            if _listing(path.parent if label.startswith("inside") else path) != before:
                res.problem("written", f"{label}: the wrong root changed", column="lost")
    if not _intact(root / step_name(2), 2.0):
        res.problem("damaged", "the checkpoint taken for a root no longer verifies", column="lost")
    return res


def _listing(path: Path) -> list[str] | None:
    if not path.is_dir():
        return None
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# --------------------------------------------------------------------------- remote


def scenario_remote(scale: Any, base: Path, seed: int) -> Any:
    import uuid

    import fsspec

    faults = _faults()
    res = faults.Result("hostile newest remote checkpoint on resume")
    attacks: dict[str, Callable[[dict[str, Any], str, int], None]] = {
        "COMMITTED in the file table": lambda m, r, n: m["files"].__setitem__(
            "COMMITTED", {"size": n}
        ),
        "the manifest in the file table": lambda m, r, n: m["files"].__setitem__(
            "manifest.msgpack", {"size": 10}
        ),
        "an integer file name": _integer_name,
        "a file table that is no map": lambda m, r, n: m.__setitem__("files", [1, 2]),
        "junk entries": lambda m, r, n: m.__setitem__("entries", [7, "x", None]),
        "a size that lies": _lying_size,
    }
    fs = fsspec.filesystem("memory")
    for label, attack in attacks.items():
        url = f"memory://trust-{uuid.uuid4().hex[:8]}/run"
        local = base / f"a{res.trials}"
        with fc.CheckpointManager(local, tiers=(fc.manager.Remote(url),)) as mgr:
            for s in (1, 2):
                mgr.maybe_save(_state(float(s)), step=s)
        remote = url.removeprefix("memory://") + f"/{step_name(2)}/"
        forged = base / f"forged{res.trials}"
        shutil.copytree(local / step_name(2), forged)
        size = (forged / "COMMITTED").stat().st_size
        faults.edit_manifest(forged, lambda m, r=remote, n=size, a=attack: a(m, r, n))
        for name in ("manifest.msgpack", "COMMITTED"):
            fs.pipe_file(remote + name, (forged / name).read_bytes())
        res.trials += 1
        res.corruptions += 1
        fresh = base / f"b{res.trials}"
        try:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                with fc.CheckpointManager(fresh, tiers=(fc.manager.Remote(url),)) as mgr:
                    got = mgr.restore_latest()
                    step = mgr.restored_step
            warned = any(issubclass(w.category, fc.errors.RemoteWarning) for w in seen)
            if got is not None and step == 1 and warned:
                res.detected += 1
            else:
                res.problem("resume", f"{label}: restored step {step}, warned={warned}")
        except fc.CheckpointError as e:
            res.problem("stopped", f"{label}: resume stopped: {type(e).__name__}: {e}")
        except Exception as e:
            res.problem("raw", f"{label}: {type(e).__name__}: {e}")
    return res


def _integer_name(m: dict[str, Any], remote: str, n: int) -> None:
    import fsspec

    name = next(k for k in m["files"] if str(k).endswith(".distcp"))
    m["files"][7] = m["files"][name]
    fs = fsspec.filesystem("memory")
    fs.pipe_file(remote + "7", fs.cat_file(remote + name))


def _lying_size(m: dict[str, Any], remote: str, n: int) -> None:
    name = next(k for k in m["files"] if str(k).endswith(".distcp"))
    m["files"][name] = {**m["files"][name], "size": m["files"][name]["size"] + 1}


# --------------------------------------------------------------------------- terminal

HOSTILE = "k\x1b[2J\x1b]0;pwned\x07\rX\u202e\x9b31m\nline"


def scenario_terminal(scale: Any, base: Path, seed: int) -> Any:
    from functional_ckpt._src import cli
    from functional_ckpt._src.cli import ui

    faults = _faults()
    res = faults.Result("terminal control characters in printed strings")
    one, two = base / "one", base / "two"
    fc.save(one, {HOSTILE: torch.zeros(2), "v": {HOSTILE: HOSTILE}}, metadata={HOSTILE: HOSTILE})
    fc.save(two, {HOSTILE: torch.ones(2), "v": {HOSTILE: 1}})
    root = base / "root"
    with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
        mgr.maybe_save({HOSTILE: torch.zeros(2)}, step=1)
    commands = [
        ["inspect", str(one)],
        ["inspect", str(one), "--json"],
        ["diff", str(one), str(two)],
        ["verify", str(one)],
        ["ls", str(root)],
        ["export", str(one), str(base / "out")],
    ]
    original = ui.UI.__init__
    for colour in (False, True):

        def forced(self: Any, *a: Any, colour: bool = colour, **k: Any) -> None:
            k["colour"] = colour
            original(self, *a, **k)

        ui.UI.__init__ = forced  # type: ignore[method-assign]
        try:
            for argv in commands:
                res.trials += 1
                out, err = io.StringIO(), io.StringIO()
                try:
                    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                        cli.main(argv)
                except BaseException as e:
                    res.problem("raw", f"{argv[0]}: {type(e).__name__}: {e}")
                    continue
                text = (_SGR.sub("", out.getvalue()) if colour else out.getvalue()) + err.getvalue()
                if any(c in text for c in _RAW):
                    res.problem("escape", f"{argv[0]} (colour={colour}) wrote a control character")
                else:
                    res.bump("clean")
        finally:
            ui.UI.__init__ = original  # type: ignore[method-assign]
    return res


# --------------------------------------------------------------------------- state files


def scenario_state_files(scale: Any, base: Path, seed: int) -> Any:
    from functional_ckpt._src.remote.uploader import STATUS_FILE

    faults = _faults()
    res = faults.Result("special files among the tiers' state files")
    kinds: dict[str, Callable[[Path], None]] = {
        "FIFO": lambda p: os.mkfifo(p),
        "link to /dev/zero": lambda p: os.symlink("/dev/zero", p),
        "64 MiB file": lambda p: os.truncate(_touch(p), 64 << 20),
        "garbage": lambda p: p.write_bytes(b"\xff{not json"),
        "directory": lambda p: p.mkdir(),
    }
    for label, make in kinds.items():
        root = base / f"root{res.trials}"
        with fc.CheckpointManager(root, fc.every_steps(1)) as mgr:
            mgr.maybe_save(_state(1.0), step=1)
        make(root / STATUS_FILE)
        res.trials += 1

        def probe(root: Path = root) -> Any:
            from functional_ckpt._src import cli

            with (
                contextlib.redirect_stdout(io.StringIO()),
                contextlib.redirect_stderr(io.StringIO()),
            ):
                code = cli.main(["ls", str(root)])
            with fc.CheckpointManager(root) as mgr:
                found = mgr.restore_latest() is not None
            return {"code": code, "found": found}

        out = faults.run_forked(probe, timeout=60)
        if out is None or out.get("hang"):
            res.problem("hang", f"{label}: fckpt ls or the resume did not answer in 60 s")
        elif out["code"] != 0 or not out["found"]:
            res.problem("refused", f"{label}: {out}")
        else:
            res.bump("answered")
    return res


def _touch(p: Path) -> Path:
    p.write_bytes(b"")
    return p


SCENARIOS: dict[str, Callable[[Any, Path, int], Any]] = {
    "trust-floods": scenario_floods,
    "trust-links": scenario_links,
    "trust-roots": scenario_roots,
    "trust-remote": scenario_remote,
    "trust-terminal": scenario_terminal,
    "trust-state-files": scenario_state_files,
}
