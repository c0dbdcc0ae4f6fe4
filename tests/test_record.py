"""Record and replay: ``fc.recording.Recorder`` and ``Replay`` on real files and processes.

A small vectorised environment is recorded; every committed record replays
exactly (batch sizes, dtypes, plain values), unchanged leaves are not written
again, a re-run from any step is deterministic, a SIGKILL loses only what was not
committed, and every bad input names what is wrong.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from tensordict import TensorDict

import functional_ckpt as fc
from functional_ckpt._src import cli, codec
from functional_ckpt._src.recording.layout import INDEX, segment_name
from functional_ckpt.errors import (
    CheckpointExists,
    CorruptCheckpoint,
    NotARecording,
    NotRecorded,
    TemplateMismatch,
)
from tests import prefork
from tests.patience import HANG, eventually

REPO = Path(__file__).resolve().parent.parent


def env_state(step: int) -> dict[str, Any]:
    """A deterministic state of 4 environments: pose changes, the map never does."""
    g = torch.Generator().manual_seed(step)
    env = TensorDict(
        {
            "pos": torch.randn(4, 3, generator=g, dtype=torch.float64),
            "done": torch.rand(4, generator=g) > 0.5,
            "map": torch.arange(4 * 16, dtype=torch.bfloat16).reshape(4, 16),
            "empty": torch.zeros(4, 0),
        },
        batch_size=[4],
    )
    return {
        "env": env,
        "action": torch.randint(0, 5, (4,), generator=g),
        "info": {"episode": step // 10, "tag": ("sim", 1 << 70)},
    }


def same(a: Any, b: Any) -> bool:
    return bool(
        (fc.codec.to_python(a) == fc.codec.to_python(b))
        if not isinstance(a, torch.Tensor)
        else (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    )


def check_record(got: TensorDict, step: int) -> None:
    want = env_state(step)
    assert got["env"].batch_size == torch.Size([4])
    for key in ("pos", "done", "map", "empty"):
        assert same(got["env", key], want["env"][key]), key
    assert same(got["action"], want["action"])
    assert fc.codec.to_python(got["info"]) == want["info"]
    assert type(fc.codec.to_python(got["info"])["tag"]) is tuple


def test_every_committed_record_replays_exactly(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    with fc.recording.Recorder(rec, every=2, commit_every=4) as recorder:
        recorded = [recorder.record(env_state(s), step=s) for s in range(21)]
    assert recorded == [s % 2 == 0 for s in range(21)]
    assert recorder.committed == 11
    with fc.recording.Replay(rec) as replay:
        assert replay.steps == list(range(0, 21, 2)) and len(replay) == 11 and 4 in replay
        for step in replay.steps[::-1]:  # any order: random access
            check_record(replay[step], step)
        assert [s for s, _ in replay.items(4, 9)] == [4, 6, 8]
        like = env_state(0)
        back = replay.restore(6, like=like)
        check_record(back, 6)
        assert not torch.equal(
            like["env"]["pos"], back["env", "pos"]
        )  # like untouched, new tensors


def test_unchanged_leaves_are_shared_not_written_again(tmp_path: Path) -> None:
    static = torch.arange(1000, dtype=torch.float32)
    moving = torch.zeros(100, dtype=torch.float32)
    with fc.recording.Recorder(tmp_path / "rec", commit_every=3) as recorder:
        for step in range(10):
            if step % 3 == 0:
                moving += 1  # changes on steps 0, 3, 6, 9 only
            recorder.record({"static": static, "moving": moving, "n": step // 5}, step=step)
    data = (tmp_path / "rec" / segment_name(0)).stat().st_size
    value = len(codec.encode(0))  # "n" changes once (0 -> 1)
    assert data == static.nbytes + 4 * moving.nbytes + 2 * value
    with fc.recording.Replay(tmp_path / "rec") as replay:
        added, _ = replay.committed.new_bytes()
        assert added.tolist()[:4] == [static.nbytes + moving.nbytes + value, 0, 0, moving.nbytes]
        for step in range(10):
            assert torch.equal(replay[step]["moving"], torch.full((100,), 1.0 + step // 3))
            assert torch.equal(replay[step]["static"], static)


def test_a_rerun_from_any_step_is_deterministic(tmp_path: Path) -> None:
    """With the random generators in the state, replaying step k and re-running matches."""

    def step_env(env: TensorDict) -> TensorDict:
        action = torch.randint(-1, 2, env.batch_size)
        env = env.clone()
        env["pos"] = env["pos"] + action + 0.01 * torch.randn(env.batch_size)
        return env

    torch.manual_seed(3)
    env = TensorDict({"pos": torch.zeros(8)}, batch_size=[8])
    with fc.recording.Recorder(tmp_path / "rec") as recorder:
        for step in range(30):
            recorder.record(fc.capture(env=env, step=step), step=step)
            env = step_env(env)
    with fc.recording.Replay(tmp_path / "rec") as replay:
        state = replay[12]
        fc.apply(state)  # puts torch, numpy and Python generators back where step 12 had them
        env = state["env"]
        for step in range(12, 30):
            assert torch.equal(env["pos"], replay[step]["env", "pos"]), step
            env = step_env(env)


def test_sigkill_loses_only_what_was_not_committed(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    child = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(REPO)!r})
        import functional_ckpt as fc
        from tests.test_record import env_state
        recorder = fc.recording.Recorder({str(rec)!r}, commit_every=1000, commit_secs=3600)
        for step in range(20):
            recorder.record(env_state(step), step=step)
        print("committed", recorder.commit(), flush=True)
        for step in range(20, 40):
            recorder.record(env_state(step), step=step)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = prefork.run(
        [sys.executable, "-c", child], capture_output=True, text=True, timeout=HANG, check=False
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert "committed 20" in proc.stdout
    with fc.recording.Replay(rec) as replay:
        assert replay.steps == list(range(20))
        for step in (0, 7, 19):
            check_record(replay[step], step)
        with pytest.raises(
            NotRecorded, match=r"step 25 is not recorded; 20 records, steps 0 to 19"
        ):
            replay[25]


def test_fckpt_ls_and_inspect_understand_recordings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with fc.recording.Recorder(tmp_path / "rec", every=5) as recorder:
        for step in range(11):
            recorder.record(env_state(step), step=step)
    assert cli.main(["ls", str(tmp_path / "rec"), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kind"] == "recording" and [r["step"] for r in doc["rows"]] == [0, 5, 10]
    assert doc["uncommitted_bytes"] == 0
    assert cli.main(["ls", str(tmp_path / "rec")]) == 0
    assert "3 committed records, steps 0..10" in capsys.readouterr().out
    assert cli.main(["inspect", str(tmp_path / "rec")]) == 0
    out = capsys.readouterr().out
    assert "batch [4]" in out and "bfloat16[4, 16]" in out
    assert cli.main(["inspect", str(tmp_path / "rec"), "--json", "--key", "env"]) == 0
    keys = [e["key"] for e in json.loads(capsys.readouterr().out)["entries"]]
    assert keys == ["env", "env/pos", "env/done", "env/map", "env/empty"]


def test_bad_inputs_name_the_argument(tmp_path: Path) -> None:
    with pytest.raises(NotARecording, match=r"Replay\(path='.*nowhere'\): .*does not exist"):
        fc.recording.Replay(tmp_path / "nowhere")
    fc.save(tmp_path / "ckpt", {"w": torch.ones(1)})
    with pytest.raises(NotARecording, match=r"ckpt is a checkpoint \(use fc.restore\)"):
        fc.recording.Replay(tmp_path / "ckpt")
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotARecording, match=r"Replay\(path=.*file'\): .*not a checkpoint dir"):
        fc.recording.Replay(tmp_path / "file")
    with pytest.raises(CheckpointExists, match=r"Recorder\(path=.*ckpt'\): the directory is not"):
        fc.recording.Recorder(tmp_path / "ckpt")
    with pytest.raises(ValueError, match=r"Recorder\(every=0\)"):
        fc.recording.Recorder(tmp_path / "r0", every=0)

    recorder = fc.recording.Recorder(tmp_path / "rec")
    recorder.record(env_state(0), step=0)
    bigger = env_state(1)
    bigger["action"] = torch.zeros(5, dtype=torch.int64)
    with pytest.raises(fc.CheckpointError, match=r"state\['action'\] is .*5.*, the first record"):
        recorder.record(bigger, step=1)
    missing = env_state(1)
    del missing["info"]
    with pytest.raises(fc.CheckpointError, match=r"state\['info'\] is missing"):
        recorder.record(missing, step=1)
    with pytest.raises(fc.CheckpointError, match=r"record\(step=0\): steps must increase"):
        recorder.record(env_state(0), step=0)
    for step in range(1, 6):  # a refused record takes no staging slot with it
        odd = env_state(step)
        odd["info"]["episode"] = object()
        with pytest.raises(fc.errors.UnsupportedValue, match=r"state\[\('info', 'episode'\)\]"):
            recorder.record(odd, step=step)
    recorder.record(env_state(1), step=1)
    recorder.close()
    with pytest.raises(fc.CheckpointError, match="the recorder is closed"):
        recorder.record(env_state(2), step=2)

    with fc.recording.Replay(tmp_path / "rec") as replay:
        assert replay.steps == [0, 1]
        with pytest.raises(NotRecorded, match=r"\[7\]: step 7 is not recorded"):
            replay[7]
        wrong = env_state(0)
        wrong["env"] = wrong["env"].to(torch.float32)
        with pytest.raises(TemplateMismatch, match=r"like\[\('env', 'pos'\)\] is float32"):
            replay.restore(0, like=wrong)


def test_damage_is_caught_where_it_is(tmp_path: Path) -> None:
    with fc.recording.Recorder(tmp_path / "rec") as recorder:
        for step in range(3):
            recorder.record({"w": torch.full((256,), float(step))}, step=step)
    segment = tmp_path / "rec" / segment_name(0)
    raw = bytearray(segment.read_bytes())
    raw[1024 + 10] ^= 0xFF  # inside step 1's tensor
    segment.write_bytes(bytes(raw))
    with fc.recording.Replay(tmp_path / "rec") as replay:
        assert torch.equal(replay[0]["w"], torch.zeros(256))
        with pytest.raises(CorruptCheckpoint, match=r"data-000000.bin: .*state\['w'\] at step 1"):
            replay[1]
    index = tmp_path / "rec" / INDEX
    raw = bytearray(index.read_bytes())
    raw[-3] ^= 0xFF
    index.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpoint, match=r"index\.bin: does not match its commit marker"):
        fc.recording.Replay(tmp_path / "rec")


def test_commits_happen_by_time_while_the_recorder_runs(tmp_path: Path) -> None:
    with fc.recording.Recorder(tmp_path / "rec", commit_every=1000, commit_secs=0.05) as recorder:
        for step in range(3):
            recorder.record({"w": torch.full((4,), float(step))}, step=step)
        eventually(lambda: recorder.committed >= 3, "three commits by time")
        with fc.recording.Replay(tmp_path / "rec") as replay:  # a reader next to the running writer
            assert replay.steps == [0, 1, 2]
            assert torch.equal(replay[2]["w"], torch.full((4,), 2.0))


def test_a_failure_in_the_background_surfaces_at_the_next_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorder = fc.recording.Recorder(tmp_path / "rec")
    recorder.record({"w": torch.zeros(4)}, step=0)
    assert recorder.commit() == 1

    def disk_full(self: Any, data: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(fc.recording.Recorder, "_append", disk_full)
    recorder.record({"w": torch.ones(4)}, step=1)  # staged; the write fails behind it
    with pytest.raises(
        fc.CheckpointError, match=r"No space left.*the 1 records committed before it are safe"
    ):
        recorder.commit()
    with pytest.raises(fc.CheckpointError, match="No space left"):
        recorder.close()
    with fc.recording.Replay(tmp_path / "rec") as replay:
        assert replay.steps == [0]  # what was committed stays


def test_a_damaged_recording_raises_only_checkpoint_errors(tmp_path: Path) -> None:
    """Random byte flips, truncations and appends in every file: a CheckpointError or the
    recorded values, never another exception."""
    import random
    import shutil

    src = tmp_path / "src"
    with fc.recording.Recorder(src, commit_every=3) as recorder:
        for step in range(6):
            recorder.record(env_state(step), step=step)
    rng = random.Random(0)
    names = sorted(os.listdir(src))
    for trial in range(150):
        copy = tmp_path / f"t{trial}"
        shutil.copytree(src, copy)
        target = copy / rng.choice(names)
        raw = bytearray(target.read_bytes())
        if rng.random() < 0.6 and raw:
            for _ in range(rng.randint(1, 3)):
                raw[rng.randrange(len(raw))] = rng.randrange(256)
        elif rng.random() < 0.5:
            raw = raw[: rng.randrange(len(raw) + 1)]
        else:
            raw += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
        target.write_bytes(bytes(raw))
        try:
            with fc.recording.Replay(copy) as replay:
                assert replay.steps == list(range(6))
                for step in replay.steps:
                    check_record(replay[step], step)  # what reads back is what was recorded
        except fc.CheckpointError:
            pass
        shutil.rmtree(copy)


def test_two_recorders_on_one_path_never_damage_each_other(tmp_path: Path) -> None:
    first = fc.recording.Recorder(tmp_path / "rec")
    with pytest.raises(CheckpointExists, match=r"Recorder\(path=.*rec'\): .*choose a new path"):
        fc.recording.Recorder(tmp_path / "rec")  # both found it empty: the second must not take it
    first.record({"w": torch.zeros(4)}, step=0)
    first.close()
    with fc.recording.Replay(tmp_path / "rec") as replay:
        assert replay.steps == [0] and torch.equal(replay[0]["w"], torch.zeros(4))


def test_a_step_beyond_the_format_is_refused_when_recorded(tmp_path: Path) -> None:
    with fc.recording.Recorder(tmp_path / "rec") as recorder:
        recorder.record({"w": torch.zeros(2)}, step=1)
        with pytest.raises(fc.CheckpointError, match=r"record\(step=9223372036854775808\)"):
            recorder.record({"w": torch.ones(2)}, step=1 << 63)
        recorder.record({"w": torch.ones(2)}, step=2)
    with fc.recording.Replay(tmp_path / "rec") as replay:  # what was committed stays readable
        assert replay.steps == [1, 2]


def test_a_forged_index_pointing_past_the_data_is_corrupt(tmp_path: Path) -> None:
    """The index and the marker rewritten consistently (a CRC authenticates nothing):
    a location whose offset wraps around 2**64 is refused as damage."""
    import numpy as np

    from functional_ckpt._src import codec
    from functional_ckpt._src.format.checksum import crc32
    from functional_ckpt._src.recording.layout import FRAME, LOC, RECORDING_MARKER

    rec = tmp_path / "rec"
    with fc.recording.Recorder(rec) as recorder:
        recorder.record({"w": torch.zeros(2)}, step=0)
    raw = (rec / INDEX).read_bytes()
    frame = codec.decode(raw[FRAME.size :])
    locs = np.frombuffer(frame["locs"], LOC).copy()
    locs["off"] = (1 << 64) - 4  # + 8 bytes wraps to 4: inside the segment
    frame["locs"] = locs.tobytes()
    body = codec.encode(frame)
    index = FRAME.pack(len(body)) + body
    (rec / INDEX).write_bytes(index)
    marker = codec.decode((rec / RECORDING_MARKER).read_bytes())
    marker.update(index_size=len(index), index_crc32=crc32(index))
    (rec / RECORDING_MARKER).write_bytes(codec.encode(marker))
    with pytest.raises(CorruptCheckpoint, match=r"index\.bin: a record points beyond"):
        fc.recording.Replay(rec)


def test_a_later_record_of_a_meta_or_sparse_tensor_is_refused(tmp_path: Path) -> None:
    with fc.recording.Recorder(tmp_path / "rec") as recorder:
        recorder.record({"w": torch.zeros(2)}, step=0)
        for step, bad in enumerate([torch.zeros(2, device="meta"), torch.zeros(2).to_sparse()]):
            with pytest.raises(fc.CheckpointError, match=r"state\['w'\] is .*the first record"):
                recorder.record({"w": bad}, step=step + 1)
        recorder.record({"w": torch.ones(4)[::2]}, step=3)  # a strided view is fine
    with fc.recording.Replay(tmp_path / "rec") as replay:
        assert replay.steps == [0, 3] and torch.equal(replay[3]["w"], torch.ones(2))
