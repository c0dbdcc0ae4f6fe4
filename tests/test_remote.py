"""The remote tier: uploads to an object store, per-tier retention, resumes, faults.

Against fsspec's in-process ``memory://`` store and a real S3-protocol server
(moto's standalone server, on a free loopback port, through s3fs).
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
import warnings
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src import cli
from functional_ckpt._src.remote import protocol, uploader
from functional_ckpt._src.remote.fetch import download
from functional_ckpt._src.remote.store import Store
from functional_ckpt._src.remote.tier import LEASE
from functional_ckpt._src.storage import committed
from functional_ckpt.errors import (
    CorruptCheckpoint,
    RemoteAccessDenied,
    RemoteBucketMissing,
    RemoteUnreachable,
    RemoteWarning,
    UploadFailed,
)
from tests import prefork
from tests.exact import assert_exact
from tests.remote_ranks_job import STEPS
from tests.test_dist import launch, wait_all

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("fast_retries")


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(64, generator=g), "b": torch.randn(3, 3, generator=g), "step": step}


def _objects(url: str, options: dict[str, Any] | None = None) -> dict[str, bytes]:
    store = Store(url, options)
    return {
        p[len(store.base) + 1 :]: bytes(store.fs.cat_file(p))
        for p in store.fs.find(store.base)
        if not p.endswith(".remote.json")
    }


def test_uploads_commit_with_the_marker_last_and_each_tier_keeps_its_own(
    tmp_path: Path, mem: str
) -> None:
    root = tmp_path / "ckpt"
    with fc.CheckpointManager(
        root, keep=fc.keep_last(2), tiers=(fc.manager.Remote(mem, keep=fc.keep_last(3)),)
    ) as mgr:
        for step in range(1, 6):
            mgr.maybe_save(_state(step), step=step)
        assert mgr.remote is not None and mgr.remote.wait()
        assert mgr.remote.steps() == [3, 4, 5]
    assert fc.CheckpointManager(root, read_only=True).steps() == [4, 5]
    remote = _objects(mem)
    local = root / "step_000000005"
    for f in local.iterdir():  # byte for byte the local checkpoint, marker included
        assert remote[f"step_000000005/{f.name}"] == f.read_bytes()
    status = json.loads((root / ".remote.json").read_text())
    assert status["url"] == mem and status["remote"] == [3, 4, 5] and status["failed"] == {}


def test_a_deleted_checkpoint_leaves_the_remote_tier_too(tmp_path: Path, mem: str) -> None:
    """The remote is one of the manager's tiers: a deletion reaches it, or a resume on
    an empty root would bring the step back."""
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
        mgr.delete(1)  # its upload may still run: it is waited for
        assert mgr.steps() == [2] and mgr.remote is not None and mgr.remote.steps() == [2]
    with fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Remote(mem),)) as mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 2


def test_a_failed_upload_is_reported_and_keeps_the_local_copy_until_one_succeeds(
    tmp_path: Path, mem: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    real = protocol.put_part

    def down(*a: Any, **k: Any) -> int:
        raise fc.errors.RemoteUnreachable(f"{mem}: the object store did not answer (test)")

    monkeypatch.setattr(protocol, "put_part", down)
    mgr = fc.CheckpointManager(root, keep=fc.keep_last(1), tiers=(fc.manager.Remote(mem),))
    assert mgr.remote is not None
    mgr.maybe_save(_state(1), step=1)
    with pytest.warns(RemoteWarning, match="upload of step 1 failed.*did not answer"):
        mgr.remote.wait()
    assert mgr.maybe_save(_state(2), step=2)  # training goes on
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        mgr.remote.wait()  # (or the next maybe_save, once the retries are over)
    assert any("upload of step 2 failed" in str(w.message) for w in seen)
    assert isinstance(mgr.remote.failures[2], UploadFailed)
    assert mgr.steps() == [1, 2]  # keep_last(1), but neither is on the remote tier yet
    status = json.loads((root / ".remote.json").read_text())
    assert set(status["failed"]) == {"1", "2"} and "did not answer" in status["failed"]["2"]
    assert cli.main(["ls", str(root)]) == 0
    out = capsys.readouterr().out
    assert "remote " + mem in out and "upload failed" in out and "did not answer" in out

    monkeypatch.setattr(protocol, "put_part", real)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteWarning)
        mgr.maybe_save(_state(3), step=3)
        mgr.remote.wait()
        mgr.maybe_save(_state(4), step=4)  # the next prune sees them uploaded
        mgr.close()
    assert Store(mem).listing().keys() == {1, 2, 3, 4}
    assert fc.CheckpointManager(root, read_only=True).steps() == [4]
    assert json.loads((root / ".remote.json").read_text())["failed"] == {}


def test_restore_on_an_empty_root_resumes_from_remote_bit_identically(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    url = bucket
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    state = fc.capture(model=model, optimizer=opt, step=7, lr=1e-3)
    with fc.CheckpointManager(
        tmp_path / "a", tiers=(fc.manager.Remote(url, storage_options=s3["options"]),)
    ) as mgr:
        mgr.maybe_save(state, step=7)
    # A fresh machine: an empty local root.
    fresh = tmp_path / "b"
    with fc.CheckpointManager(
        fresh, tiers=(fc.manager.Remote(url, storage_options=s3["options"]),)
    ) as mgr:
        got = mgr.restore_latest(like=state)
        assert got is not None and mgr.restored_step == 7 and mgr.steps() == [7]
    assert_exact(fc.restore(tmp_path / "a" / "step_000000007"), got)  # same bits, same types
    for f in (tmp_path / "a" / "step_000000007").iterdir():
        assert (fresh / "step_000000007" / f.name).read_bytes() == f.read_bytes()


def test_a_corrupted_remote_object_is_detected_and_the_previous_one_used(
    tmp_path: Path, mem: str
) -> None:
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    fs = fsspec.filesystem("memory")
    shard = mem.removeprefix("memory://") + "/step_000000002/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF  # same size: only the checksums can tell
    fs.pipe_file(shard, bytes(data))
    with fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Remote(mem),)) as mgr:
        with pytest.warns(RemoteWarning, match="step 2 is unusable.*CorruptCheckpoint"):
            got = mgr.restore_latest()
        assert got is not None and mgr.restored_step == 1
        assert torch.equal(got["w"], _state(1)["w"])
        assert mgr.steps() == [1]  # the damaged copy never became a local checkpoint


def _hostile_remote_step(tmp_path: Path, mem: str, edit: Any) -> None:
    """Replace remote step 2's manifest by an edited one, its marker re-signed."""
    import shutil

    from tests.forge import resign

    local = tmp_path / "a" / "step_000000002"
    forged = tmp_path / "forged"
    shutil.copytree(local, forged)
    resign(forged, edit)
    fs = fsspec.filesystem("memory")
    base = mem.removeprefix("memory://") + "/step_000000002/"
    for name in ("manifest.msgpack", "COMMITTED"):
        fs.pipe_file(base + name, (forged / name).read_bytes())


def _marker_size(tmp_path: Path) -> int:
    return (tmp_path / "a" / "step_000000002" / "COMMITTED").stat().st_size


@pytest.mark.parametrize("attack", ["lists COMMITTED", "an integer file name", "files not a map"])
def test_a_hostile_remote_manifest_is_damage_and_the_previous_step_is_used(
    tmp_path: Path, mem: str, attack: str
) -> None:
    """Regression: a re-signed remote manifest listing ``COMMITTED`` or an integer file
    name made a fresh machine's restore_latest raise FileExistsError or KeyError('7')
    although remote step 1 was intact."""
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    size = _marker_size(tmp_path)

    def edit(m: dict[str, Any]) -> None:
        if attack == "lists COMMITTED":
            m["files"]["COMMITTED"] = {"size": size, "crc32": 0}
        elif attack == "an integer file name":  # and an object of that name beside it
            name = next(n for n in m["files"] if n.endswith(".distcp"))
            m["files"][7] = m["files"][name]
            fs = fsspec.filesystem("memory")
            remote = mem.removeprefix("memory://") + "/step_000000002/"
            fs.pipe_file(remote + "7", fs.cat_file(remote + name))
        else:
            m["files"] = [1, 2]

    _hostile_remote_step(tmp_path, mem, edit)
    with fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Remote(mem),)) as mgr:
        with pytest.warns(RemoteWarning, match="step 2 is unusable"):
            got = mgr.restore_latest()
        assert got is not None and mgr.restored_step == 1
        assert torch.equal(got["w"], _state(1)["w"])
        assert mgr.steps() == [1]


def test_a_damaged_local_checkpoint_falls_back_to_its_remote_copy(tmp_path: Path, mem: str) -> None:
    root = tmp_path / "ckpt"
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    ck = root / "step_000000002"
    (chunk,) = next(e for e in committed.read_manifest(ck)["entries"] if e["path"] == ["w"])[
        "chunks"
    ]
    shard = ck / chunk["file"]
    data = bytearray(shard.read_bytes())
    data[chunk["data_offset"]] ^= 0xFF  # a byte of the tensor the restore reads
    shard.write_bytes(bytes(data))
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        with pytest.warns(
            fc.errors.CheckpointWarning, match=r"(?s)step 2 is unreadable.*moved aside"
        ):
            got = mgr.restore_latest()
        assert mgr.restored_step == 2 and got is not None  # the remote copy, not step 1
        assert torch.equal(got["w"], _state(2)["w"])
    assert [p.name for p in root.glob("step_000000002.corrupt-*")]  # kept, never deleted


def test_a_remote_deletion_racing_the_download_falls_back(
    tmp_path: Path, mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    fs = fsspec.filesystem("memory")  # the one instance fsspec keeps: its own attribute
    real_get = fs.get  # wins (another test's patch of it, undone, is one too)

    def racing_get(rpaths: Any, lpaths: Any, *a: Any, **k: Any) -> Any:
        if any("step_000000002" in p for p in rpaths):  # a writer prunes step 2 meanwhile
            Store(mem).remove(2, ["COMMITTED", "__0_0.distcp"])
        return real_get(rpaths, lpaths, *a, **k)

    monkeypatch.setattr(fs, "get", racing_get)
    with fc.CheckpointManager(tmp_path / "b", tiers=(fc.manager.Remote(mem),)) as mgr:
        with pytest.warns(RemoteWarning, match="step 2 is unusable.*RemoteVanished"):
            got = mgr.restore_latest()
        assert mgr.restored_step == 1 and got is not None
        assert not any(p.name.startswith(".fc-download") for p in (tmp_path / "b").iterdir())


def test_store_faults_raise_clear_errors_at_open(
    tmp_path: Path, s3: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import moto.settings

    url = bucket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    options = {
        "client_kwargs": {"endpoint_url": dead},
        "config_kwargs": {"retries": {"max_attempts": 1}},
    }
    with pytest.raises(RemoteUnreachable, match=r"did not answer.*endpoint"):
        fc.CheckpointManager(
            tmp_path / "a", tiers=(fc.manager.Remote(url, storage_options=options),)
        )
    fc.CheckpointManager(tmp_path / "a").close()  # the lock was released
    # regression: a token in the endpoint's query string appeared in the message in full
    options["client_kwargs"]["endpoint_url"] = dead + "/?token=SEKRET-TOKEN"
    with pytest.raises(RemoteUnreachable, match=r"did not answer") as unreachable:
        fc.CheckpointManager(
            tmp_path / "a", tiers=(fc.manager.Remote(url, storage_options=options),)
        )
    assert "SEKRET" not in str(unreachable.value)
    assert "SEKRET" not in "".join(str(a) for a in unreachable.value.args)
    with pytest.raises(RemoteBucketMissing, match=r"no-such-bucket/x: the bucket does not exist"):
        fc.CheckpointManager(
            tmp_path / "a",
            tiers=(fc.manager.Remote("s3://no-such-bucket/x", storage_options=s3["options"]),),
        )
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    bad = {**s3["options"], "key": "wrong", "secret": "wrong", "skip_instance_cache": True}
    with pytest.raises(RemoteAccessDenied, match=r"refused access.*credentials"):
        fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(url, storage_options=bad),))
    with pytest.raises(TypeError, match="remote_keep"):
        fc.CheckpointManager(tmp_path / "a", remote_keep=fc.keep_last(1))


_KILLED_CHILD = """
import sys, time, torch
import functional_ckpt as fc
from functional_ckpt._src.remote import protocol

def stuck(*a, **k):  # every object is up, the marker is next: die here
    print("OBJECTS-UPLOADED", flush=True)
    time.sleep(600)

protocol.commit_upload = stuck
options = {{"client_kwargs": {{"endpoint_url": "{endpoint}"}}}}
remote = fc.manager.Remote(sys.argv[2], storage_options=options)
mgr = fc.CheckpointManager(sys.argv[1], tiers=(remote,))
mgr.maybe_save({{"w": torch.arange(1 << 16, dtype=torch.float32), "step": 1}}, step=1)
time.sleep(600)
"""


def test_sigkill_during_upload_leaves_no_remote_commit_and_the_restart_finishes_it(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    url = bucket
    root = tmp_path / "ckpt"
    code = textwrap.dedent(_KILLED_CHILD.format(endpoint=s3["endpoint"]))
    child = prefork.Popen(
        [sys.executable, "-c", code, str(root), url],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "OBJECTS-UPLOADED"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    store = Store(url, s3["options"])
    partial = store.listing()[1]
    assert not partial.committed and "__0_0.distcp" in partial.objects
    before = store.fs.info(store.object_path(1, "__0_0.distcp"))["LastModified"]
    with fc.CheckpointManager(
        tmp_path / "fresh", tiers=(fc.manager.Remote(url, storage_options=s3["options"]),)
    ) as m:
        assert m.restore_latest() is None  # a partial upload is never a checkpoint
    with fc.CheckpointManager(
        root, tiers=(fc.manager.Remote(url, storage_options=s3["options"]),)
    ) as mgr:
        assert mgr.remote is not None and mgr.remote.wait()  # the restart resumes the upload
        assert mgr.remote.steps() == [1]
    after = store.fs.info(store.object_path(1, "__0_0.distcp"))["LastModified"]
    assert after == before  # resumed, not sent again
    local = root / "step_000000001"
    remote = _objects(url, s3["options"])
    remote.pop(LEASE)  # the name of the manager that writes there, beside the checkpoints
    assert {f"step_000000001/{f.name}": f.read_bytes() for f in local.iterdir()} == remote


def test_fckpt_ls_shows_the_tiers_and_verify_inspect_take_remote_urls(
    tmp_path: Path, mem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ckpt"
    with fc.CheckpointManager(
        root, keep=fc.keep_last(1), tiers=(fc.manager.Remote(mem, keep=fc.keep_last(2)),)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(_state(step), step=step)
    with fc.CheckpointManager(tmp_path / "other", tiers=(fc.manager.Remote(mem),)) as other:
        other.restore_latest()
    assert cli.main(["ls", str(root), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "tier"]
    assert [(r["step"], r["tier"]) for r in rows] == [(2, "remote"), (3, "both")]
    fs = fsspec.filesystem("memory")
    shard = mem.removeprefix("memory://") + "/step_000000003/__0_0.distcp"
    whole = fs.cat_file(shard)
    fs.pipe_file(shard, whole[:-7])  # a copy cut short is none, as the uploader sees it
    assert cli.main(["ls", str(root), "--json"]) == 0
    rows = [r for r in json.loads(capsys.readouterr().out) if r.get("kind") == "tier"]
    assert [(r["step"], r["tier"]) for r in rows] == [(2, "remote"), (3, "local")]
    assert rows[1]["note"].startswith("the remote copy is cut short: __0_0.distcp ("), rows
    fs.pipe_file(shard, whole)
    assert cli.main(["ls", mem]) == 0
    out = capsys.readouterr().out
    assert "step_000000002" in out and "2 committed checkpoints" in out
    assert cli.main(["verify", mem]) == 0
    assert "2 checkpoints intact" in capsys.readouterr().out
    assert cli.main(["inspect", f"{mem}/step_000000003", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"]["manager"]["step"] == 3
    shard = mem.removeprefix("memory://") + "/step_000000002/__0_0.distcp"
    data = bytearray(fs.cat_file(shard))
    data[-40] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    assert cli.main(["verify", mem]) == 1
    out = capsys.readouterr().out
    assert f"DAMAGED  {mem}/step_000000002" in out and "1 of 2 checkpoints damaged" in out
    assert cli.main(["verify", mem, "--json"]) == 1
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == mem and doc["intact"] == 1 and doc["damaged"] == 1
    statuses = {c["path"]: c["status"] for c in doc["checkpoints"]}
    assert statuses == {f"{mem}/step_000000002": "damaged", f"{mem}/step_000000003": "intact"}
    fs.pipe_file(mem.removeprefix("memory://") + "/step_000000003/.metadata", b"garbage")
    assert cli.main(["verify", f"{mem}/step_000000003"]) == 1
    damaged = f"  {mem}/step_000000003/.metadata: 7 bytes, the manifest records"
    assert capsys.readouterr().out.splitlines()[1].startswith(damaged)  # the file named once


def test_ranks_on_one_remote_with_roots_of_their_own_or_one_shared_root(
    tmp_path: Path, s3: dict[str, Any]
) -> None:
    """Two ranks, launched once (tests/remote_job.py, every part below), then three:
    one test, so that no two test processes launch the same ranks."""
    two = _two_ranks(tmp_path, s3)
    assert two["rc"] == [0, 9], two["err"]  # rank 1 dies in the last part
    _own_roots_commit_on_one_remote(two, s3)
    _sharing_one_root_each_download_what_they_read(two)
    _resharded_and_past_remote_damage(two, s3)
    _runs_never_upload_over_another_runs_steps(two, s3)


def _two_ranks(base: Path, s3: dict[str, Any]) -> dict[str, Any]:
    """tests/remote_job.py, launched on two ranks, with the variables torchrun sets:
    its return codes, stderr, each part's output per rank, its base and URL."""
    name = f"b-{uuid.uuid4().hex[:10]}"
    Store(f"s3://{name}", s3["options"]).fs.mkdir(name)
    url = f"s3://{name}/run"
    env = {"ENDPOINT": s3["endpoint"], "FCKPT_TIMEOUT": "60"}  # a dead rank fails within
    ran = wait_all(launch(2, str(base), url, env=env, job=REPO / "tests" / "remote_job.py"))
    out = {
        part: [(base / f"{part}.{r}.out").read_text() for r in (0, 1)]
        for part in ("shared", "ranks", "own")
        if (base / f"{part}.1.out").exists()
    }
    err = "".join(e[-3000:] for _, _, e in ran)
    return {"rc": [rc for rc, _, _ in ran], "err": err, "out": out, "base": base, "url": url}


def _own_roots_commit_on_one_remote(two_ranks: dict[str, Any], s3: dict[str, Any]) -> None:
    out0, out1 = two_ranks["out"]["own"]
    base, url = two_ranks["base"] / "own", f"{two_ranks['url']}/own"
    assert "REFUSED" in out0 and "REFUSED" in out1
    assert not list((base / "plain0").iterdir())  # nothing committed, nothing left
    assert "UPLOADED [1, 2, 3]" in out0
    assert "RESUMED 3" in out0 and "RESUMED 3" in out1  # from the remote tier, bit-identically
    # Each rank fetched what it reads: the index, the file its replicated values lie in
    # (rank 0's), its own part and shard file; never another rank's part or shard file,
    # nor .metadata (for stock readers and fc.verify).
    got = [ast.literal_eval(o.split("FETCHED ", 1)[1].splitlines()[0]) for o in (out0, out1)]
    index = ["__0_0.distcp", "manifest.msgpack"]
    assert got[0] == [*index, "manifest.part-00000.msgpack"], got
    assert got[1] == [
        "__0_0.distcp",
        "__1_0.distcp",
        "manifest.msgpack",
        "manifest.part-00001.msgpack",
    ]
    assert "FAILED [4]" in out0 and "upload of step 4 failed" in out0, out0  # reported, no hang
    listing = Store(url, s3["options"]).listing()
    assert sorted(s for s, r in listing.items() if r.committed) == [1, 2, 3]  # 4: no commit
    assert {"__0_0.distcp", "__1_0.distcp", "COMMITTED", "manifest.msgpack"} <= set(
        listing[3].objects
    )
    assert "LOCAL [3]" in out0 and "LOCAL []" in out1  # rank 1 keeps parts only
    part = base / "run1" / "step_000000004"
    assert sorted(p.name for p in part.iterdir()) == ["__1_0.distcp"]
    assert fc.CheckpointManager(base / "run0", read_only=True).steps() == [4]


def _sharing_one_root_each_download_what_they_read(two_ranks: dict[str, Any]) -> None:
    out0, out1 = two_ranks["out"]["shared"]
    assert "ROLLED BACK [1]" in out0 and "ROLLED BACK [1]" in out1, (out0, out1)
    got = [ast.literal_eval(o.split("FETCHED ", 1)[1].splitlines()[0]) for o in (out0, out1)]
    # The coordinator fetches the index, the files it lists (.metadata too: the local
    # copy is whole) and its part; rank 1 only the index, its part and its shard file.
    assert got[0] == [
        ".metadata",
        "__0_0.distcp",
        "manifest.msgpack",
        "manifest.part-00000.msgpack",
    ]
    assert got[1] == ["__1_0.distcp", "manifest.msgpack", "manifest.part-00001.msgpack"]
    assert "RESUMED True" in out0 and "RESUMED True" in out1  # committed whole, intact
    assert "TORN" in out0 and "TORN" in out1  # one rank's failure fails every rank
    assert "LEFT []" in out0 and "LEFT []" in out1
    assert "MARKERS []" in out0, out0  # nothing looks committed, in the download directory too
    torn = two_ranks["base"] / "shared" / "torn"
    assert [n for n in os.listdir(torn) if n.startswith(".fc-download-")], os.listdir(torn)
    with fc.CheckpointManager(torn):  # the next writer, with no remote tier
        pass
    assert not [n for n in os.listdir(torn) if n.startswith(".fc-download-")]


def _resharded_and_past_remote_damage(two_ranks: dict[str, Any], s3: dict[str, Any]) -> None:
    """Three ranks resume a two-rank remote checkpoint, each fetching the parts its
    shards meet; then (in the two-rank job, on a copy), each newest remote step
    damaged in its own way, every rank walks down, warned of each, to the one intact
    step, all alike, bit-exactly."""
    base, steps = two_ranks["base"] / "ranks", STEPS
    env = {"ENDPOINT": s3["endpoint"], "FCKPT_TIMEOUT": "30"}
    job = REPO / "tests" / "remote_ranks_job.py"
    for rc, _, err in wait_all(launch(3, str(base), f"{two_ranks['url']}/ranks", env=env, job=job)):
        assert rc == 0, err[-3000:]
    for r in range(3):
        told = json.loads((base / f"resume.{r}.json").read_text())
        assert "error" not in told and told["step"] == steps, told
        assert told["match"] and told["step_value"] == steps, told
    for r in range(2):
        told = json.loads((base / "walk" / f"resume.{r}.json").read_text())
        assert "error" not in told and told["step"] == 1, told
        assert told["match"] and told["step_value"] == 1, told
        for step in range(steps, 1, -1):  # each damaged step named, on every rank
            assert any(f"step {step} is unusable" in w for w in told["warnings"]), told


def _runs_never_upload_over_another_runs_steps(
    two_ranks: dict[str, Any], s3: dict[str, Any]
) -> None:
    """The upload of a checkpoint saved on two ranks, a root each, meets the lineage
    rule: a second run on the same remote keeps its steps 1 and 2, every rank's part,
    locally."""
    base, store = two_ranks["base"] / "lineage", Store(f"{two_ranks['url']}/lineage", s3["options"])

    def run_id(path: Path) -> str:
        run: dict[str, str] = fc.inspect(path).metadata["run"]
        return run["id"]

    remote = {s: run_id(download(store, s, base / "fetched" / str(s))) for s in (1, 2)}
    run_a = run_id(base / "a" / "root0" / "step_000000002")
    assert remote[2] == run_a, "run a's remote step 2 was replaced"
    assert remote[1] == run_a
    for rank in (0, 1):
        assert sorted(p.name for p in (base / "b" / f"root{rank}").glob("step_*")) == [
            "step_000000001",
            "step_000000002",
        ]


def test_credentials_are_never_written_or_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A password in the URL (ftp://user:pw@host/…) and storage_options given the wrong
    way (a JSON string read from the environment) stay out of files, errors and output."""
    url = f"memory://user:SEKRET@t-{uuid.uuid4().hex[:8]}/run"
    root = tmp_path / "ckpt"

    def down(*a: Any, **k: Any) -> int:
        raise fc.errors.RemoteUnreachable("the object store did not answer (test)")

    monkeypatch.setattr(protocol, "put_part", down)
    mgr = fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),))
    mgr.maybe_save(_state(1), step=1)
    with pytest.warns(RemoteWarning) as seen:
        mgr.remote.wait()  # type: ignore[union-attr]
    shown = [str(w.message) for w in seen] + [repr(mgr.remote), str(mgr.remote.failures[1])]  # type: ignore[union-attr]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteWarning)
        mgr.close()
    assert cli.main(["ls", str(root)]) == 0
    shown.append(capsys.readouterr().out)
    shown += [p.read_text() for p in root.rglob("*.json")]
    with pytest.raises(TypeError) as err:
        fc.CheckpointManager(
            tmp_path / "b", tiers=(fc.manager.Remote(url, storage_options='{"secret": "SEKRET"}'),)
        )  # type: ignore[arg-type]
    shown.append(str(err.value))
    assert "user@t-" in shown[0]
    assert not [s for s in shown if "SEKRET" in s]


def test_a_second_manager_on_the_remote_root_takes_it_over(tmp_path: Path, mem: str) -> None:
    """The stale process of a restarted job on one prefix (the job restarted elsewhere,
    its root copied): the manager that began writing there last writes there; the other
    stops uploading and deleting, and says so. (A second run's checkpoints there are
    another lineage's: tests/test_tiers.py.)"""
    stale = fc.CheckpointManager(
        tmp_path / "old", keep=fc.keep_last(1), tiers=(fc.manager.Remote(mem),)
    )
    stale.maybe_save(_state(1), step=1)
    assert stale.remote is not None
    stale.remote.wait()
    shutil.copytree(tmp_path / "old", tmp_path / "new")  # the same run, restarted elsewhere
    with fc.CheckpointManager(
        tmp_path / "new", tiers=(fc.manager.Remote(mem, keep=fc.keep_last(1)),)
    ) as mgr:
        mgr.maybe_save(_state(2), step=2)
        assert mgr.remote is not None and mgr.remote.wait()  # the new run has written there
        stale.maybe_save(_state(3), step=3)  # a different step 3 than the new run's
        with pytest.warns(RemoteWarning, match=r"upload of step 3 failed.*another manager"):
            stale.remote.wait()
        mgr.maybe_save(_state(30), step=3)
    assert Store(mem).listing().keys() == {3}  # the new run's retention, the new run's data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RemoteWarning)
        stale.close()
    assert stale.steps()[-1] == 3  # kept locally: never uploaded by the stale one
    fresh = fc.CheckpointManager(tmp_path / "fresh", tiers=(fc.manager.Remote(mem),))
    got = fresh.restore_latest()
    assert got is not None and torch.equal(got["w"], _state(30)["w"])
    fresh.close()


def test_upload_rounds_asked_for_while_one_runs_are_served_by_one_more() -> None:
    """A store that is down makes a round last its retries: the rounds asked for by the
    saves meanwhile must not queue up behind it (close() waits for them)."""
    import threading

    started, release, rounds = threading.Event(), threading.Event(), []

    def round_() -> None:
        rounds.append(1)
        started.set()
        release.wait()

    worker = uploader.Worker(round_)
    worker.request()
    assert started.wait(30)
    for _ in range(10):  # ten saves while the first round hangs on the store
        worker.request()
    release.set()
    assert worker.drain(30)
    worker.stop()
    assert len(rounds) == 2  # the running one, then one for everything asked meanwhile


def test_a_remote_that_is_the_local_root_itself_is_refused(tmp_path: Path) -> None:
    """Its retention would delete local checkpoints the local retention keeps; its uploads
    inside a checkpoint would damage it; around the memory folder, lose the tier's steps."""
    root, folder = tmp_path / "ckpt", tmp_path / "ram" / "tier"
    (tmp_path / "link").symlink_to(root, target_is_directory=True)
    with fc.CheckpointManager(root) as mgr:
        mgr.maybe_save(_state(1), step=1)
    inside, memory = f"file://{root}/step_000000001", fc.manager.Memory(path=folder)
    for url in (f"file://{root}", f"file://{root}//", f"file://{tmp_path}/link", inside):
        with pytest.raises(fc.CheckpointError, match=r"remote=.*the local root itself"):
            fc.CheckpointManager(root, tiers=(fc.manager.Remote(url),))
    for url in (f"file://{folder}", f"file://{folder}/r", f"file://{folder.parent}"):
        with pytest.raises(fc.CheckpointError, match=rf"remote=.*{folder}"):
            fc.CheckpointManager(root, tiers=(memory, fc.manager.Remote(url)))
    assert not folder.exists() and fc.verify(root / "step_000000001").ok  # nothing written
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(f"file://{tmp_path}/remote"),)) as mgr:
        mgr.maybe_save(_state(1), step=1)  # a remote beside it is fine
    assert Store(f"file://{tmp_path}/remote").listing().keys() == {1}


def test_a_rollback_sets_the_remote_trunk_aside_too(tmp_path: Path, mem: str) -> None:
    """After a rollback, a restart (here or on a fresh machine) resumes the new trunk,
    not the newer checkpoints of the old one still on the remote tier. The remote 2 cut
    short (its listing shows a shard's size wrong) is no copy: the rollback uploads 2."""
    root, store = tmp_path / "ckpt", Store(mem)
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        for step in (1, 2, 3, 4):
            mgr.maybe_save(_state(step), step=step)
        assert mgr.remote is not None and mgr.remote.wait()
        shard = store.object_path(2, "__0_0.distcp")
        store.fs.pipe_file(shard, store.fs.cat_file(shard)[:-7])
        mgr.rollback(2, branch="old")
        mgr.maybe_save(_state(30), step=3)
    assert fc.verify(download(store, 2, tmp_path / "fresh2")).ok  # uploaded whole again
    assert Store(mem).listing().keys() == {1, 2, 3}
    assert Store(f"{mem}/branches/old").listing().keys() == {3, 4}  # set aside, not lost
    for where in (root, tmp_path / "fresh"):
        with fc.CheckpointManager(where, tiers=(fc.manager.Remote(mem),)) as mgr:
            got = mgr.restore_latest()
            assert mgr.restored_step == 3 and torch.equal(got["w"], _state(30)["w"])  # type: ignore[index]
    marker = Store(f"{mem}/branches/old").read(4, "COMMITTED")
    shutil.rmtree(root / "branches" / "old")  # the remote's branch alone holds the name now
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.restore_latest()
        mgr.maybe_save(_state(40), step=4)
        assert mgr.remote is not None and mgr.remote.wait()
        with pytest.raises(fc.errors.CheckpointExists, match="branch 'old' already exists"):
            mgr.rollback(2, branch="old")  # it would copy this 4 over the branch's 4
        assert mgr.steps()[-2:] == [3, 4] and mgr.remote.steps()[-2:] == [3, 4]
        assert mgr.restored_step == 3  # refused before the run went back to 2 either
    assert Store(f"{mem}/branches/old").read(4, "COMMITTED") == marker


_ROLLED_BACK_THEN_KILLED = """
import os, signal, sys, torch
import functional_ckpt as fc

remote = fc.manager.Remote(sys.argv[2], keep=fc.keep_last(2))
mgr = fc.CheckpointManager(sys.argv[1], tiers=(remote,))
for step in (1, 2, 3, 4, 5):
    mgr.maybe_save({"w": torch.full((4,), float(step)), "step": step}, step=step)
assert mgr.remote.wait() and mgr.remote.steps() == [4, 5]
mgr.rollback(3, newer=sys.argv[3])
os.kill(os.getpid(), signal.SIGKILL)  # no close, no upload round after the rollback
"""


@pytest.mark.parametrize("newer", ["delete", "branch"])
def test_a_rollback_below_the_remote_retention_leaves_its_step_on_the_remote(
    tmp_path: Path, newer: str
) -> None:
    """The remote's keep_last(2) held 4 and 5 only; the rollback to 3 takes them off the
    remote trunk, so it puts 3 there first: killed right after it, a fresh machine
    resumes 3 (it found nothing and started over); the run's next save is the newest."""
    url, root = (tmp_path / "bucket").as_uri(), tmp_path / "a"
    code = [sys.executable, "-c", _ROLLED_BACK_THEN_KILLED, str(root), url, newer]
    child = prefork.run(code, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert child.returncode == -signal.SIGKILL

    def resumed(where: Path) -> tuple[int | None, float]:
        with fc.CheckpointManager(where, tiers=(fc.manager.Remote(url),)) as mgr:
            got = mgr.restore_latest()
            return mgr.restored_step, float("nan") if got is None else float(got["w"][0])

    assert resumed(tmp_path / "fresh") == (3, 3.0)
    with fc.CheckpointManager(root, tiers=(fc.manager.Remote(url, keep=fc.keep_last(2)),)) as mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 3
        mgr.maybe_save({"w": torch.full((4,), 40.0), "step": 4}, step=4)
    assert resumed(tmp_path / "fresh_again") == (4, 40.0)


@pytest.mark.filterwarnings("ignore::functional_ckpt.errors.RemoteWarning")
def test_a_rollback_whose_step_cannot_be_uploaded_moves_nothing(
    tmp_path: Path, mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its newer remote steps would leave a remote trunk without it: it raises, naming
    the failed upload, before any tier moved a step. The failure is the rollback's: no
    upload of step 3 (which the remote's retention does not keep) is reported later."""
    with fc.CheckpointManager(
        tmp_path / "a", tiers=(fc.manager.Remote(mem, keep=fc.keep_last(2)),)
    ) as mgr:
        for step in (1, 2, 3, 4, 5):
            mgr.maybe_save(_state(step), step=step)
        assert mgr.remote is not None and mgr.remote.wait()

        def down(*a: Any, **k: Any) -> int:
            raise fc.errors.RemoteUnreachable(f"{mem}: the object store did not answer (test)")

        real = protocol.put_part
        monkeypatch.setattr(protocol, "put_part", down)
        with pytest.raises(fc.CheckpointError, match=r"rollback\(3\): .*upload of step 3 failed"):
            mgr.rollback(3)
        assert mgr.steps() == [1, 2, 3, 4, 5] and mgr.remote.steps() == [4, 5]
        monkeypatch.setattr(protocol, "put_part", real)

        def unlisted(*a: Any) -> Any:  # the round's plan: its cause is the rollback's error
            raise fc.errors.RemoteUnreachable(f"{mem}: the listing did not answer (test)")

        with monkeypatch.context() as patched:
            patched.setattr(type(mgr.remote), "_plan", unlisted)
            with pytest.raises(fc.CheckpointError, match=r"rollback\(3\): .*listing did not"):
                mgr.rollback(3)
        assert mgr.steps() == [1, 2, 3, 4, 5] and mgr.remote.steps() == [4, 5]
        with warnings.catch_warnings(record=True) as told:
            warnings.simplefilter("always")
            mgr.maybe_save(_state(6), step=6)
            assert mgr.remote.wait() and mgr.remote.steps() == [5, 6]
        assert mgr.remote.failures == {}, mgr.remote.failures
        assert not [w for w in told if "upload of step 3" in str(w.message)], told


def test_a_renamed_remote_step_counts_in_no_retention_of_the_remote(
    tmp_path: Path, mem: str
) -> None:
    """A remote step_9 holding step 3's checkpoint is damage: the remote's keep_last(2)
    keeps the intact 3 and 4 beside it (it kept 9 and 4, and deleted 3)."""
    with fc.CheckpointManager(
        tmp_path / "a", tiers=(fc.manager.Remote(mem, keep=fc.keep_last(2)),)
    ) as mgr:
        for step in (1, 2, 3):
            mgr.maybe_save(_state(step), step=step)
        assert mgr.remote is not None and mgr.remote.wait()
        store = Store(mem)
        store.fs.copy(
            f"{store.base}/step_000000003", f"{store.base}/step_000000009", recursive=True
        )
        mgr.maybe_save(_state(4), step=4)
        assert mgr.remote.wait()
        assert mgr.remote.steps() == [3, 4, 9]


def test_a_remote_marker_or_manifest_of_the_wrong_size_is_never_read(
    tmp_path: Path, mem: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Like a local file, a remote object is checked to have its recorded size before
    a byte of it is read (an object of many GiB would be read into memory)."""
    with fc.CheckpointManager(tmp_path / "a", tiers=(fc.manager.Remote(mem),)) as mgr:
        mgr.maybe_save(_state(1), step=1)
    store = Store(mem)
    read: list[str] = []
    real = store.fs.cat_file
    monkeypatch.setattr(store.fs, "cat_file", lambda p, *a, **k: read.append(p) or real(p, *a, **k))
    good = real(store.object_path(1, "manifest.msgpack"))
    for name, junk in (("manifest.msgpack", good + bytes(1 << 16)), ("COMMITTED", bytes(1 << 17))):
        saved = real(store.object_path(1, name))
        store.fs.pipe_file(store.object_path(1, name), junk)
        read.clear()
        with pytest.raises(CorruptCheckpoint, match=rf"{name}: .*bytes"):
            store.manifest(1)
        assert store.object_path(1, name) not in read
        store.fs.pipe_file(store.object_path(1, name), saved)
    assert store.manifest(1)[1]["files"]  # intact again
    shard = store.object_path(1, "__0_0.distcp")
    store.fs.pipe_file(shard, real(shard) + bytes(1 << 16))
    got: list[Any] = []
    monkeypatch.setattr(store.fs, "get", lambda *a, **k: got.append(a))
    with pytest.raises(CorruptCheckpoint, match=r"__0_0.distcp: \d+ bytes, the manifest records"):
        download(store, 1, tmp_path / "b")
    assert not got  # nothing downloaded


def test_a_remote_url_without_a_path_or_with_dot_dot_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """'s3://' lost its '//' to the trailing-slash strip and became the local path 's3:'."""
    monkeypatch.chdir(tmp_path)
    for url in ("s3://", "s3:///", "memory://", "s3://bucket/runs/../run1", "memory://a/./b"):
        with pytest.raises(ValueError, match=r"remote='.*': "):
            fc.CheckpointManager(tmp_path / "ckpt", tiers=(fc.manager.Remote(url),))
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # nothing written beside it
    assert Store("memory://bucket/run1//").url == "memory://bucket/run1"


def test_no_url_secret_is_ever_shown() -> None:
    from functional_ckpt._src.remote.store import public_url, redact

    assert public_url("s3://bucket/run") == "s3://bucket/run"
    assert public_url("ftp://me:pw@host/run") == "ftp://me@host/run"
    assert public_url("https://host/run?X-Amz-Signature=abc&token=t#frag") == "https://host/run?..."
    said = redact('Could not connect to "http://u:pw@10.0.0.1:9000/?token=SEKRET": refused')
    assert "SEKRET" not in said and "pw" not in said and "http://u@10.0.0.1:9000/?..." in said


def test_a_step_only_the_remote_holds_is_deleted_there(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    """A fresh machine's root holds nothing yet: the step is this run's all the same."""
    remote = fc.manager.Remote(bucket, storage_options=s3["options"])
    with fc.CheckpointManager(tmp_path / "a", tiers=(remote,)) as mgr:
        for step in (1, 2):
            mgr.maybe_save(_state(step), step=step)
    with fc.CheckpointManager(tmp_path / "b", tiers=(remote,)) as mgr:
        assert mgr.steps() == [] and mgr.remote is not None and mgr.remote.steps() == [1, 2]
        mgr.delete(1)
        assert mgr.remote.steps() == [2] and mgr.steps() == []
        assert "step_000000001/COMMITTED" not in _objects(bucket, s3["options"])
    with fc.CheckpointManager(tmp_path / "c", tiers=(remote,)) as mgr:
        assert mgr.restore_latest() is not None and mgr.restored_step == 2
