"""Object stores for the remote tier's tests: fsspec's ``memory://`` and a real S3 server;
and Ctrl-C as a user's terminal sends it, whoever started the suite."""

from __future__ import annotations

import contextlib
import signal
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# A suite started in the background of a script (``cmd &``, ``nohup``) inherits SIGINT
# ignored, and so would every child process it starts: tests that send a child Ctrl-C
# would then wait on an interrupt that never comes. A handler here is reset to the
# default in each child at exec, where Python installs its own.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def fast_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Uploads retried three times from 10 ms, not five times from half a second."""
    from functional_ckpt._src.remote import uploader

    monkeypatch.setattr(uploader, "BACKOFF", 0.01)
    monkeypatch.setattr(uploader, "RETRIES", 3)


@pytest.fixture
def mem() -> Iterator[str]:
    """A fresh ``memory://`` remote root (fsspec's in-process store), removed after."""
    import fsspec

    url = f"memory://t-{uuid.uuid4().hex[:8]}/run"
    yield url
    with contextlib.suppress(FileNotFoundError):
        fsspec.filesystem("memory").rm(url.removeprefix("memory://"), recursive=True)


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, Any]]:
    """A moto S3 server on 127.0.0.1 (a free port), with dummy credentials in the env."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for k, v in {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            mp.setenv(k, v)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        try:
            yield {"endpoint": endpoint, "options": {"client_kwargs": {"endpoint_url": endpoint}}}
        finally:
            server.stop()


@pytest.fixture
def bucket(s3: dict[str, Any]) -> str:
    """A remote root in a new bucket of the S3 server."""
    from functional_ckpt._src.remote.store import Store

    name = f"b-{uuid.uuid4().hex[:10]}"
    Store(f"s3://{name}", s3["options"]).fs.mkdir(name)
    return f"s3://{name}/run"


@pytest.fixture(scope="session")
def shard_save(tmp_path_factory: pytest.TempPathFactory) -> Callable[[int], Path]:
    """``shard_save(n)``: tests/dist_job.py's ``shard_state`` (DTensors sharded on two
    dimensions, a replicated one, a plain tensor, values and each rank's ``loader``) as
    ``n`` gloo ranks saved it (``w<n>``), saved once per test process. A test that
    changes it works on a copy."""
    saved: dict[int, Path] = {}

    def get(world: int) -> Path:
        if world not in saved:
            from tests.test_dist import run_ok

            root = tmp_path_factory.mktemp(f"shard-save-{world}")
            run_ok(world, "shard-save", str(root))
            saved[world] = root / f"w{world}"
        return saved[world]

    return get
