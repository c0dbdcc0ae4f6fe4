"""The helper process that moves uploads' bytes: used, held by saves, failing clearly.

Against a real S3-protocol server (moto's, on loopback, through s3fs) and
fsspec's in-process ``memory://`` store, which no other process reaches.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ckpt as fc
from functional_ckpt._src.remote.mover import Mover, _MovedFailure, facts_of
from functional_ckpt._src.remote.store import Store, remote_error
from functional_ckpt.errors import (
    RemoteAccessDenied,
    RemoteBucketMissing,
    RemoteError,
    RemoteUnreachable,
    RemoteVanished,
)
from tests.patience import HANG

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("fast_retries")


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(1 << 14, generator=g), "step": step}


def _process_state(pid: int) -> str | None:
    """The kernel's one-letter state of ``pid`` (T: stopped, Z: dead), None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def _becomes(pid: int, states: tuple[str | None, ...], within: float = HANG) -> bool:
    """Whether ``pid`` is in one of ``states`` within ``within`` seconds (signals
    take effect a moment after they are sent)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if _process_state(pid) in states:
            return True
        time.sleep(0.01)
    return False


def _stopped(pid: int) -> bool:
    return _becomes(pid, ("T",))


def _running(pid: int) -> bool:
    return _becomes(pid, ("S", "R", "D"))


def _gone(pid: int) -> bool:
    return _becomes(pid, (None, "Z", "X"))


def _file(tmp_path: Path, size: int = 1 << 16) -> str:
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(size))
    return str(path)


needs_proc = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs /proc")


@needs_proc
def test_uploads_run_in_a_helper_process_that_every_save_holds_until_staged(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    with fc.CheckpointManager(
        tmp_path / "ckpt",
        tiers=(fc.manager.Remote(bucket, storage_options=s3["options"]),),
        async_save=True,
    ) as mgr:
        assert mgr.remote is not None and mgr.remote.wait()
        pid = mgr.remote.store.mover.pid
        assert pid is not None and pid != os.getpid()  # started when the manager opened
        assert _running(pid)
        mgr.remote.store.pause_uploads()  # as a save does, from its start until staged
        assert _stopped(pid)
        mgr.maybe_save(_state(1), step=1, force=True)
        mgr.wait_staged()  # the save's own hold is released by now; the outer one is not
        mgr.wait()
        assert _stopped(pid)
        assert not mgr.remote.wait(timeout=1.5)  # the upload cannot finish while held
        assert mgr.remote.steps() == []
        mgr.remote.store.resume_uploads()
        assert _running(pid)
        assert mgr.remote.wait() and mgr.remote.steps() == [1]
        mgr.maybe_save(_state(2), step=2, force=True)
        mgr.wait_staged()
        assert _running(pid)  # released once the state was staged
        mgr.wait()  # the commit, which asks for the upload
        assert mgr.remote.wait() and mgr.remote.steps() == [1, 2]
        assert mgr.remote.store.mover.pid == pid  # one process serves every upload
    assert _gone(pid)  # closing the manager ends it


@needs_proc
def test_a_failed_sync_save_releases_the_uploads(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    with fc.CheckpointManager(
        tmp_path / "ckpt", tiers=(fc.manager.Remote(bucket, storage_options=s3["options"]),)
    ) as m:
        assert m.remote is not None and m.remote.wait()
        pid = m.remote.store.mover.pid
        assert pid is not None
        with pytest.raises(TypeError):
            m.maybe_save({"bad": object()}, step=1, force=True)  # fails while held
        assert _running(pid)
        m.maybe_save(_state(2), step=2, force=True)
        assert _running(pid)
        assert m.remote.wait() and m.remote.steps() == [2]


_PARENT = """
import sys, time, torch
import functional_ckpt as fc
options = {{"client_kwargs": {{"endpoint_url": "{endpoint}"}}}}
remote = fc.manager.Remote(sys.argv[2], storage_options=options)
mgr = fc.CheckpointManager(sys.argv[1], tiers=(remote,))
assert mgr.remote.wait()
mgr.remote.store.pause_uploads()  # killed while its helper is stopped, too
print(mgr.remote.store.mover.pid, flush=True)
time.sleep(600)
"""


@needs_proc
def test_a_killed_training_process_takes_its_upload_process_with_it(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    code = textwrap.dedent(_PARENT.format(endpoint=s3["endpoint"]))
    parent = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / "ckpt"), bucket],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        assert parent.stdout is not None
        helper = int(parent.stdout.readline())
        assert _stopped(helper)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait()
    assert _gone(helper)  # no orphan goes on writing to the remote root


def test_a_helper_process_killed_mid_run_is_replaced(
    tmp_path: Path, s3: dict[str, Any], bucket: str
) -> None:
    with fc.CheckpointManager(
        tmp_path / "ckpt", tiers=(fc.manager.Remote(bucket, storage_options=s3["options"]),)
    ) as m:
        assert m.remote is not None and m.remote.wait()
        pid = m.remote.store.mover.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)  # the OOM killer, or a careless kill
        m.maybe_save(_state(1), step=1, force=True)
        assert m.remote.wait() and m.remote.steps() == [1]  # retried in a new process
        assert m.remote.store.mover.pid not in (None, pid)
        assert m.remote.failures == {}


def test_failures_in_the_helper_process_keep_their_meaning(
    tmp_path: Path, s3: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    blob = _file(tmp_path)
    missing = Store("s3://no-such-bucket-here/x", s3["options"])
    with pytest.raises(RemoteBucketMissing, match=r"no-such-bucket-here.*does not exist"):
        missing.put("s3://no-such-bucket-here/x", [blob], [f"{missing.base}/blob"])
    assert missing.mover.pid is not None  # it was the helper process that failed
    missing.close()

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    once = {"retries": {"max_attempts": 1}}
    unreachable = Store(bucket, {"client_kwargs": {"endpoint_url": dead}, "config_kwargs": once})
    with pytest.raises(RemoteUnreachable, match="did not answer"):
        unreachable.put(bucket, [blob], [f"{unreachable.base}/blob"])
    unreachable.close()

    import moto.settings

    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)
    refused = Store(bucket, {**s3["options"], "key": "wrong", "secret": "wrong"})
    with pytest.raises(RemoteAccessDenied, match="refused access"):
        refused.put(bucket, [blob], [f"{refused.base}/blob"])
    refused.close()


@pytest.mark.parametrize(
    "err, kind",
    [
        (PermissionError(errno.EACCES, "AccessDenied"), RemoteAccessDenied),
        (FileNotFoundError("NoSuchBucket: the bucket does not exist"), RemoteBucketMissing),
        (FileNotFoundError("s3://b/k"), RemoteVanished),
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), RemoteUnreachable),
        (TimeoutError("read timeout"), RemoteUnreachable),
        (type("ClientConnectorError", (Exception,), {})("no route"), RemoteUnreachable),
        (ValueError("odd"), RemoteError),
    ],
)
def test_a_failure_reported_by_the_helper_maps_as_it_does_in_process(
    err: BaseException, kind: type[RemoteError]
) -> None:
    here = remote_error(err, "s3://b/x")
    there = remote_error(_MovedFailure(facts_of(err)), "s3://b/x")
    assert type(here) is kind and type(there) is kind
    assert str(here) == str(there)


def test_stores_no_other_process_reaches_upload_in_process(tmp_path: Path, mem: str) -> None:
    blob = _file(tmp_path)
    store = Store(mem)
    store.put(mem, [blob], [f"{store.base}/blob"])
    assert store.mover.pid is None
    assert bytes(store.fs.cat_file(f"{store.base}/blob")) == Path(blob).read_bytes()
    local = Store(f"file://{tmp_path / 'remote'}")
    local.put("local", [blob], [f"{local.base}/blob"])
    assert local.mover.pid is None and (tmp_path / "remote" / "blob").exists()


@pytest.mark.parametrize(
    "options",
    [{"client_kwargs": {"hook": lambda: None}}, {"config_kwargs": {"retries": ("a", 1)}}],
    ids=["object", "tuple"],
)
def test_options_that_are_not_plain_json_leave_uploads_in_process(options: dict[str, Any]) -> None:
    """Nothing is pickled: what JSON cannot carry exactly stays in the training process."""
    mover = Mover("s3://b/x", options)
    assert not mover.usable and not mover.start()


@pytest.mark.parametrize(
    "launch", ["import sys; sys.exit(3)", "import time; time.sleep(600)"], ids=["exits", "silent"]
)
def test_a_helper_that_does_not_start_leaves_uploads_in_process(
    tmp_path: Path, s3: dict[str, Any], bucket: str, monkeypatch: pytest.MonkeyPatch, launch: str
) -> None:
    """An interpreter that cannot run the helper (or hangs) costs one try, not a hang."""
    from functional_ckpt._src.remote import mover

    monkeypatch.setattr(mover, "_LAUNCH", launch)
    monkeypatch.setattr(mover, "HELLO_TIMEOUT", 1.0)
    one = Mover("s3://b/x", {})
    began = time.monotonic()
    assert not one.start() and not one.usable and one.pid is None
    assert time.monotonic() - began < HANG / 3  # one second of waiting, not a hang
    assert not one.start()  # not tried again
    with pytest.raises(_MovedFailure, match="could not start"):
        one.put([], [])
    store = Store(bucket, s3["options"])
    blob = _file(tmp_path)
    store.put(bucket, [blob], [f"{store.base}/blob"])  # in this process instead
    assert store.mover.pid is None
    assert bytes(store.fs.cat_file(f"{store.base}/blob")) == Path(blob).read_bytes()
