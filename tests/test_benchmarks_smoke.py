"""Smoke test of benchmarks/save_restore.py: it runs and writes the expected JSON.

No timing is asserted here: the benchmark's numbers are for people, not for CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "save_restore.py"

SAVE_TOOLS = {
    "fc.save",
    "torch.save+fsync",
    "safetensors.save_file+fsync",
    "dcp.save",
    "raw write+fsync",
}
RESTORE_TOOLS = {
    "fc.restore(template)",
    "fc.restore()",
    "torch.load(weights_only)",
    "safetensors.load_file",
    "dcp.load(template)",
    "raw read into template",
}


@pytest.mark.timeout(300)
def test_save_restore_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "save_restore.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--allow-tmpfs",  # tmp_path may be on tmpfs; this test does not look at timings
            "--json",
            str(out),
            "--dir",
            str(tmp_path / "s"),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(out.read_text())

    rows = {(r["state"], r["op"], r["tool"]) for r in data["rows"]}
    for state in ("big", "small"):
        assert {(state, "save", t) for t in SAVE_TOOLS} <= rows
        assert {(state, "restore", t) for t in RESTORE_TOOLS} <= rows
        assert (state, "checksum", "zlib.crc32 of tensor bytes") in rows
    for r in data["rows"]:
        assert len(r["times_s"]) == data["config"]["reps"] == 2
        assert r["median_s"] > 0

    assert set(data["peak_rss"]) == {"fc.restore(template)", "dcp.load(template)"}
    assert len(data["targets"]) == 9
    assert {t["result"] for t in data["targets"]} <= {"PASS", "FAIL"}
    assert not (tmp_path / "s").exists() or not any((tmp_path / "s").iterdir())
