"""The CI form of the fault and attack suite (benchmarks/faults.py), plus one test per weakness.

The scenario tests run the very functions the long form runs, at the CI scale:
>= 30 real SIGKILLs of forked savers, a real 8 MiB tmpfs filling up, a read-only
mount, a destination removed mid-save, every file of a checkpoint corrupted,
hostile checkpoints loaded in a memory-limited child, readers racing a writer,
manager roots (lock-file links, SIGKILLs without RENAME_EXCHANGE and during
rollbacks, bad templates, ``fckpt`` on odd manifests) and the values classes.
They assert the invariants that must never break (nothing committed lost, nothing
torn visible, no code run, no wrong data) and that every other problem the suite
reports is a known weakness. Each known weakness has a minimal, deterministic
reproduction below, marked ``xfail(strict=True)``: when the library is fixed the
xfail turns into a failure, and the entry in ``KNOWN`` must be deleted.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import sys
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import codec
from functional_ckpt._src.format import naming
from functional_ckpt._src.storage import commit, committed, durable, shards
from tests import prefork
from tests.patience import HANG

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "faults.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fc_faults", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["fc_faults"] = module
    spec.loader.exec_module(module)
    return module


faults = _load()

#: Problems the suite reports today, each reproduced by an xfail test below:
#: (scenario key, problem text fragment) -> the test that pins it down.
KNOWN: dict[tuple[str, str], str] = {}


def unexpected(key: str, res: Any) -> list[str]:
    """Problems of a scenario not explained by a known, separately tested weakness."""
    known = [frag for (k, frag) in KNOWN if k == key]
    return [p for p in res.problems if not any(frag in p for frag in known)]


def run(key: str) -> Any:
    res = faults.run_scenario(key, faults.CI, seed=7)
    assert res.lost == 0, res.problems
    assert res.torn == 0, res.problems
    assert res.executed == 0, res.problems
    assert not unexpected(key, res), unexpected(key, res)
    return res


# --------------------------------------------------------------------------- scenarios


@pytest.mark.parametrize("kind", faults.KINDS)
def test_sigkill(kind: str) -> None:
    """>= 8 real SIGKILLs per kind (>= 32 in all): nothing lost, nothing torn, resume works."""
    res = run(f"kill-{kind}")
    assert res.trials == faults.CI.kills_per_kind >= 8
    assert res.other == 0, res.problems
    assert res.counts.get("committed-at-end", 0) >= 1  # the children did get to commit


def test_disk_full() -> None:
    res = faults.run_scenario("disk-full", faults.CI, seed=7)
    if res.skipped:
        pytest.skip(res.skipped)
    assert res.lost == res.torn == res.other == 0, res.problems
    assert res.counts.get("failed-cleanly", 0) >= 3  # the disk did fill up mid-save
    assert res.counts.get("fit", 0) >= 1  # and the largest level let a save through


def test_destinations() -> None:
    res = run("destinations")
    assert res.trials >= faults.CI.vanish_trials + 7


def test_corruption() -> None:
    res = run("corruption")
    assert res.counts["verify"] == res.corruptions  # verify catches 100%
    assert res.other == 0, res.problems  # restore never raised an unclear error


def test_hostile() -> None:
    res = run("hostile")
    assert res.trials == len(faults.hostile_cases(Path("/x"), Path("/y")))


def test_concurrency() -> None:
    res = run("concurrency")
    assert res.counts.get("manager-read", 0) > 0


def test_durability_order() -> None:
    """Every file fsynced at its final size before the marker; new ancestors made durable."""
    res = run("durability")
    assert res.lost == res.other == 0, res.problems
    assert res.trials >= 20 and res.counts["files-checked"] >= 4 * res.trials


def test_special_files_never_hang() -> None:
    res = run("special-files")
    assert res.other == 0, res.problems
    assert res.detected == res.corruptions >= 12


def test_unpickler_attacks_change_nothing() -> None:
    res = run("unpickler")
    assert res.counts.get("attributes-changed", 0) == 0
    assert res.detected == res.corruptions == len(faults.ATTACK_PREFIXES)


def test_derived_metadata_disagreement() -> None:
    res = run("derived")
    assert res.detected == res.corruptions >= 9
    assert res.counts.get("honest-accepted") == 1
    assert res.other == 0, res.problems


def test_overwrite_scope() -> None:
    res = run("overwrite-scope")
    assert res.lost == res.other == 0, res.problems
    assert res.counts.get("refused") == res.trials >= 10


def test_overwrite_race() -> None:
    res = run("overwrite-race")
    assert res.torn == res.other == 0, res.problems
    assert res.counts.get("restore-read", 0) >= 10


def test_reader_fuzz_scenario() -> None:
    res = run("fuzz")
    assert res.trials == faults.CI.fuzz_examples
    assert res.torn == res.other == 0, res.problems


@pytest.mark.parametrize("name", list(faults.VALUE_CLASSES))
def test_values_and_manifests(name: str) -> None:
    """benchmarks/faults_values.py's classes run as scenarios of this suite (short form)."""
    res = run(f"values-{name}")
    assert res.trials > 0 and res.torn == res.other == 0, res.problems
    if faults.VALUE_CLASSES[name][1]:  # an attack class: every attack refused
        assert res.detected == res.corruptions == res.trials


def test_lock_file_links() -> None:
    """A .lock symlink, hard link, FIFO or directory: refused by name, nothing changes."""
    res = run("lock-links")
    attacks = faults._lock_attacks(Path("/r"), Path("/v"))
    assert res.detected == res.corruptions == res.trials == len(attacks)
    assert res.lost == res.other == 0, res.problems


def test_leftover_recovery_without_exchange() -> None:
    """SIGKILLs of overwrites and pruning saves with RENAME_EXCHANGE unavailable."""
    res = run("leftovers")
    assert res.trials == 2 * faults.CI.leftover_kills
    assert res.other == 0, res.problems
    assert res.counts.get("kill:window", 0) >= 1  # killed between the two renames
    assert res.counts.get("recovered", 0) >= 1  # and the newest step was renamed back


def test_rollback_crashes() -> None:
    """SIGKILL at random system calls of rollback: it completed or never started."""
    res = run("rollback")
    assert res.trials == faults.CI.rollback_kills and res.other == 0, res.problems
    assert res.counts.get("child-killed", 0) >= 1
    done = res.counts.get("completed", 0) + res.counts.get("never-started", 0)
    assert done == res.trials


def test_template_errors_never_quarantine() -> None:
    res = run("template-errors")
    assert res.lost == res.other == 0, res.problems
    assert res.counts.get("TemplateMismatch", 0) >= 1
    assert res.counts.get("UnsupportedValue", 0) >= 1


def test_cli_on_odd_manifests() -> None:
    """fckpt ls/inspect/verify: documented exit status, one line, others still listed."""
    res = run("cli-odd")
    assert res.trials == len(faults._odd_manifests()) and res.other == 0, res.problems
    assert res.detected == res.corruptions == 1


def test_cli_table_and_json(tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = prefork.run(
        [sys.executable, str(SCRIPT), "--ci", "--scenarios", "destinations", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=HANG,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torn visible" in proc.stdout and "code executed" in proc.stdout
    data = json.loads(out.read_text())
    assert data["form"] == "ci" and data["results"][0]["trials"] > 0


# --------------------------------------------------------------------------- helpers


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step_000000001"
    fc.save(path, faults.make_state(1, big=1, small=4))
    return path


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "mnt"
    why = faults.mount_tmpfs(mnt, "8m")
    if why is not None:
        pytest.skip(why)
    try:
        yield mnt
    finally:
        faults.umount(mnt)


def in_child(fn: Any, extra_mem: int = 768 << 20) -> Any:
    """Run ``fn`` in a forked child with a memory limit; its JSON-able result."""
    out = faults.run_forked(fn, timeout=HANG, mem_limit=faults.vm_size() + extra_mem)
    assert out != {"hang": True}, "the child hung"
    return out


def outcome(fn: Any) -> str:
    try:
        fn()
    except BaseException as e:
        return type(e).__name__
    return "ok"


# --------------------------------------------------------------------------- invariants


def test_hostile_pickle_never_runs(ckpt: Path, tmp_path: Path) -> None:
    """Even re-signed in the manifest, the payload never executes.

    Our readers never unpickle ``.metadata`` (it is derived from the manifest), so
    restore returns the intact tensors exactly; verify, which recomputes
    ``.metadata`` from the manifest, reports the hostile file.
    """
    marker = tmp_path / "PWNED"
    faults._hostile_metadata(marker, resigned=True)(ckpt)
    assert faults.state_version(fc.restore(ckpt)) == 1
    assert fc.inspect(ckpt).num_tensors > 0
    report = fc.verify(ckpt)
    assert not report.ok
    assert any(
        p.where == naming.DCP_METADATA and "posix.system" in p.detail for p in report.problems
    )
    assert not marker.exists()


def test_follower_never_sees_a_partial_commit(tmp_path: Path) -> None:
    """The read-only follower of a SIGKILLed writer resumes from the newest whole step."""
    res = faults.Result("x")
    root = tmp_path / "run"
    root.mkdir()
    import random

    for _ in range(3):
        faults.kill_trial("prune", root, random.Random(1), 0.3, res)
    assert res.lost == res.torn == res.other == 0, res.problems


# --------------------------------------------------------------------------- weaknesses


def test_forked_child_can_save(tmp_path: Path) -> None:
    big = {"w": torch.ones(1 << 20)}
    fc.save(tmp_path / "parent", big)  # the parent's pool thread now exists
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            fc.save(tmp_path / "child", big)
        finally:
            os._exit(0)
    deadline = time.monotonic() + HANG  # a save of 4 MiB takes ~0.05 s
    while time.monotonic() < deadline:
        if os.waitpid(pid, os.WNOHANG)[0]:
            break
        time.sleep(0.05)
    else:
        faults.kill(pid)
        pytest.fail("the forked child hung in fc.save")


def test_restore_detects_shard_header_flip(ckpt: Path) -> None:
    shard = next(p for p in ckpt.iterdir() if p.suffix == ".distcp")
    faults.flip_bit(shard, 40, 0)
    assert not fc.verify(ckpt).ok  # verify does see it
    with pytest.raises(fc.errors.CorruptCheckpoint):
        fc.restore(ckpt)


def test_marker_version_flip_detected(ckpt: Path) -> None:
    raw = bytearray((ckpt / naming.COMMIT_MARKER).read_bytes())
    at = raw.index(b"\xa7version\x01") + len(b"\xa7version")
    raw[at] ^= 0x01  # 1 -> 0: a single bit flip
    (ckpt / naming.COMMIT_MARKER).write_bytes(bytes(raw))
    assert codec.decode(bytes(raw))["version"] == 0  # type: ignore[index]
    assert not fc.verify(ckpt).ok


def test_verify_flags_resigned_hostile_metadata(ckpt: Path, tmp_path: Path) -> None:
    faults._hostile_metadata(tmp_path / "PWNED", resigned=True)(ckpt)
    assert not fc.verify(ckpt).ok


def test_empty_tensor_with_huge_dimension(ckpt: Path) -> None:
    faults.edit_manifest(ckpt, faults._zero_overflow)
    with pytest.raises(fc.CheckpointError):
        fc.restore(ckpt)


def _sparse_probe(path: Path, name: str) -> Any:
    with open(path / name, "r+b") as f:
        f.truncate(3 << 29)  # 1.5 GiB of holes: no disk, but reads as zeros
    return in_child(lambda: [outcome(lambda: fc.restore(path)), outcome(lambda: fc.verify(path))])


def test_oversized_manifest_is_not_read(ckpt: Path) -> None:
    assert _sparse_probe(ckpt, naming.MANIFEST) == ["CorruptCheckpoint", "ok"]


def test_oversized_metadata_is_not_read(ckpt: Path) -> None:
    """A restore never reads ``.metadata`` (it is for stock readers); verify reports it."""
    assert _sparse_probe(ckpt, naming.DCP_METADATA) == ["ok", "ok"]
    assert not fc.verify(ckpt).ok


def test_writer_on_read_only_root(mount: Path) -> None:
    with fc.CheckpointManager(mount / "run") as mgr:
        mgr.maybe_save({"w": torch.ones(4)}, step=1)
    faults.remount(mount, "ro")
    with fc.CheckpointManager(mount / "run", read_only=True) as ro:  # the reader works
        assert ro.restore_latest() is not None
    with pytest.raises(fc.CheckpointError, match="read"):
        fc.CheckpointManager(mount / "run")


def test_save_on_read_only_mount(mount: Path) -> None:
    faults.remount(mount, "ro")
    with pytest.raises(fc.CheckpointError, match=r"permission|read-only"):
        fc.save(mount / "ck", {"w": torch.ones(4)})
    with pytest.raises(fc.CheckpointError, match=r"permission|read-only"):
        fc.save_async(mount / "ck", {"w": torch.ones(4)}).result()


def test_save_below_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(fc.CheckpointError):
        fc.save(tmp_path / "f" / "ck", {"w": torch.ones(4)})


def test_manager_root_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    assert outcome(lambda: fc.CheckpointManager(tmp_path / "f")) == "CheckpointError"
    # a reader is refused as early: a file is no root to read either
    assert outcome(lambda: fc.CheckpointManager(tmp_path / "f", read_only=True)) == (
        "CheckpointError"
    )


def test_restore_racing_prune(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruned while its tensors are read: the reader still has every file open."""
    original = shards.read_tensors

    def pruned_first(fd: int, *args: Any, **kwargs: Any) -> Any:
        aside = durable.tmp_sibling(ckpt, naming.TRASH_INFIX)  # what the manager's prune does
        if ckpt.exists():
            os.rename(ckpt, aside)
            commit.remove_tree(aside)
        return original(fd, *args, **kwargs)

    monkeypatch.setattr(shards, "read_tensors", pruned_first)
    assert faults.state_version(fc.restore(ckpt)) == 1  # one consistent checkpoint
    assert not ckpt.exists()


def test_restore_pruned_before_opening(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pruned before its files could be opened: not found (never "corrupt")."""
    original = committed.Checkpoint.open_file

    def pruned_first(ck: Any, *args: Any) -> Any:
        aside = durable.tmp_sibling(ckpt, naming.TRASH_INFIX)
        if ckpt.exists():
            os.rename(ckpt, aside)
            commit.remove_tree(aside)
        return original(ck, *args)

    monkeypatch.setattr(committed.Checkpoint, "open_file", pruned_first)
    with pytest.raises(fc.errors.CheckpointNotFound):
        fc.restore(ckpt)


def test_marker_is_authenticated(ckpt: Path) -> None:
    """Every single-bit flip of COMMITTED is caught by restore (exhaustive)."""
    pristine = (ckpt / naming.COMMIT_MARKER).read_bytes()
    version_at = pristine.index(b"\xa7version\x01") + len(b"\xa7version")
    missed = []
    for off in range(len(pristine)):
        for bit in range(8):
            raw = bytearray(pristine)
            raw[off] ^= 1 << bit
            (ckpt / naming.COMMIT_MARKER).write_bytes(bytes(raw))
            if outcome(lambda: fc.restore(ckpt)) == "ok":
                missed.append((off, bit))
    (ckpt / naming.COMMIT_MARKER).write_bytes(pristine)
    assert missed == [], f"undetected flips (version byte at {version_at}): {missed}"


def test_manifest_flip_needs_the_marker(ckpt: Path) -> None:
    """A manifest flip that still decodes is caught by the CRC32 in COMMITTED."""
    raw = bytearray((ckpt / naming.MANIFEST).read_bytes())
    at = raw.index(b"\xa7created\xcb") + len(b"\xa7created\xcb") + 7
    raw[at] ^= 0x01  # the last mantissa bit of the creation time: still a valid manifest
    codec.decode(bytes(raw))
    (ckpt / naming.MANIFEST).write_bytes(bytes(raw))
    with pytest.raises(fc.errors.CorruptCheckpoint, match="checksum"):
        fc.restore(ckpt)
    assert not fc.verify(ckpt).ok
    assert (
        zlib.crc32(bytes(raw))
        != codec.decode((ckpt / naming.COMMIT_MARKER).read_bytes())["manifest_crc32"]
    )  # type: ignore[index]


def test_pickle_marker_not_created_by_stock_layout(tmp_path: Path) -> None:
    """A stock-DCP directory whose .metadata is hostile: refused, nothing runs."""
    marker = tmp_path / "PWNED"
    d = tmp_path / "d"
    d.mkdir()
    (d / ".metadata").write_bytes(pickle.dumps(faults.Payload(marker)))
    with pytest.raises(fc.errors.UnsafeCheckpoint):
        fc.restore(d, {"w": torch.zeros(2)})
    assert not marker.exists()


def test_lock_hard_link_is_refused(tmp_path: Path) -> None:
    """A hard-linked .lock shares its inode: taking the lock would truncate the other file."""
    root = tmp_path / "run"
    with fc.CheckpointManager(root) as mgr:
        mgr.maybe_save({"w": torch.ones(4)}, step=1)
    shard = next((root / "step_000000001").glob("*.distcp"))
    pristine = shard.read_bytes()
    os.unlink(root / ".lock")
    os.link(shard, root / ".lock")
    with pytest.raises(fc.CheckpointError, match=r"\.lock has 2 hard links"):
        fc.CheckpointManager(root)
    assert shard.read_bytes() == pristine
    assert fc.verify(root / "step_000000001").ok


def test_inspect_of_a_non_numeric_save_time(ckpt: Path) -> None:
    """A re-signed manifest whose created is a string: no time, and fckpt inspect exits 0."""
    faults.edit_manifest(ckpt, lambda m: m.update(created="yesterday"))
    assert fc.inspect(ckpt).created is None
    code, out, err = faults._cli(["inspect", str(ckpt)])
    assert (code, err) == (0, "") and "saved -" in out


@pytest.mark.parametrize("key", [k for k in faults.SCENARIOS if k.startswith("trust-")])
def test_trust_classes(key: str) -> None:
    """The third attack suite's classes: nothing lost, no raw exception, no hang, every
    hostile input refused (benchmarks/faults_trust.py)."""
    assert key.startswith("trust-")
    res = run(key)
    assert res.trials > 0 and res.other == 0, res.problems
    assert res.detected == res.corruptions, res.problems


def test_the_trust_classes_are_registered() -> None:
    assert len([k for k in faults.SCENARIOS if k.startswith("trust-")]) == 6
