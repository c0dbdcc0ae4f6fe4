"""Run many ``python -m functional_ckpt`` command lines for the price of one start.

``python tests/cli_driver.py JOBS OUT``: JOBS is a JSON list of argument lists;
each runs in a child forked from this process once the package is imported, as
``python -m functional_ckpt ARGS`` runs (the same ``__main__``, real stdout and
stderr, stdin from /dev/null), and OUT gets a JSON list of ``{argv, code, out,
err}``. An exception that escapes the command line prints its traceback as the
interpreter would, with exit status 1.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

# Imported once, before the forks: each command then costs a fork, not an interpreter's
# imports (torch's included: most commands on a checkpoint read tensors or dtypes).
import torch  # noqa: F401

import functional_ckpt._src.cli.listing
import functional_ckpt._src.cli.main
import functional_ckpt._src.cli.show
import functional_ckpt._src.cli.verify
import functional_ckpt._src.restore.api  # noqa: F401


def _child(argv: list[str], out: int, err: int) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    sys.argv = ["fckpt", *argv]
    code = 0
    try:
        runpy.run_module("functional_ckpt", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_one(argv: list[str]) -> dict[str, Any]:
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(argv, out.fileno(), err.fileno())
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return {
            "argv": argv,
            "code": os.waitstatus_to_exitcode(status),
            "out": out.read().decode(errors="replace"),
            "err": err.read().decode(errors="replace"),
        }


def main() -> None:
    jobs = json.loads(Path(sys.argv[1]).read_text())
    results = [run_one(argv) for argv in jobs]
    Path(sys.argv[2]).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
