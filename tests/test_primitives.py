"""The safe primitives are the only way: no module reads or deletes a file around them.

Files of checkpoints are read through ``storage/opener`` (no link followed, no
blocking on a FIFO, regular files of a bounded size), written through
``storage/durable`` and deleted through ``root/delete`` and ``storage/commit``
(nothing deleted through a link, a checkpoint's marker first). This test reads
every module's source and lists each direct file read, open or delete outside the
storage stage; each one left is here with the reason it is not a checkpoint's
file. A new one fails the test until it goes through a primitive or is argued here.
Likewise a state's leaves are walked through ``state/tree.leaves_of``, never by
building its TensorDict first, and a warning is raised only through ``log.warn``,
beside its WARNING record.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

from tests.patience import HANG

PACKAGE = Path(__file__).resolve().parent.parent / "functional_ckpt"

#: (module path, call) -> how many, and why each is not a way around a primitive.
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("_src/cli/demo/job.py", "open"): (1, "the demo's own event log"),
    ("_src/cli/demo/__init__.py", "open"): (2, "the demo's own event log and child log"),
    ("_src/cli/demo/__init__.py", "shutil.rmtree"): (1, "the demo's own scratch directory"),
    ("_src/cli/demo/__init__.py", "target.unlink"): (1, "the demo's own scratch file"),
    ("_src/cli/demo/__init__.py", "self.log.read_text"): (1, "the demo's own child log"),
    ("_src/cli/main.py", "os.open"): (1, "/dev/null in place of a closed stdout"),
    ("_src/cli/run.py", "open"): (1, "/proc/<pid>/stat of the supervised child"),
    ("_src/distributed/groups.py", "probe.unlink"): (1, "the probe file this rank made"),
    ("_src/export/files.py", "path.read_bytes"): (1, "a side file the user names (extra_files)"),
    ("_src/export/safetensors.py", "os.open"): (1, "fsync of a file this export wrote"),
    ("_src/export/torch_save.py", "torch.load"): (1, "a torch.save file the user names, no root's"),
    ("_src/export/torch_save.py", "zipfile.is_zipfile"): (1, "the same file, checked regular"),
    ("_src/export/torch_save.py", "os.unlink"): (2, "this writer's own temporary file"),
    ("_src/recording/recorder.py", "os.open"): (1, "the recording's directory (O_NOFOLLOW)"),
    ("_src/remote/fetch.py", "os.open"): (1, "fsync of a downloaded file (O_NOFOLLOW)"),
    ("_src/root/delete.py", "os.unlink"): (2, "the primitive: a marker, or a link itself"),
    ("_src/root/leftovers.py", "os.unlink"): (1, "a temporary file (not a directory) of a crash"),
    ("_src/root/listing.py", "os.open"): (1, "a step directory (O_NOFOLLOW), read by committed"),
    ("_src/root/lock.py", "os.open"): (1, "the lock file"),
    ("_src/root/rollback.py", "os.unlink"): (2, "the rollback's own intent file"),
    ("_src/save/incremental.py", "dst.unlink"): (1, "a link this save just made, swapped"),
    ("_src/state/allocation.py", "os.open"): (
        1,
        "kernel attributes under /sys (huge pages, balloon)",
    ),
    ("integrations/lightning.py", "target.unlink"): (1, "a link Lightning asks to remove"),
}

_ATTRS = {"read_text", "read_bytes", "unlink", "rmtree", "remove", "rmdir", "open"}

#: Library functions that open a path themselves, with a plain ``open`` (following
#: links, blocking on a FIFO): a file under a root read by any of them goes around
#: the opener.
_OPENING = {"safe_open", "load_file", "safetensors.torch.load_file", "torch.load", "np.load"}
_OPENING |= {"numpy.load", "np.fromfile", "np.memmap", "zipfile.is_zipfile"}
_OPENING |= {"tarfile.open", "codecs.open", "Image.open"}


def direct_file_calls(source: str) -> Counter[str]:
    """Each builtin ``open``, ``os.open``/``remove``/``rmdir``/``unlink``, ``rmtree``,
    ``Path.read_text``/``read_bytes``/``unlink`` in ``source``."""
    found: Counter[str] = Counter()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "open":
            found["open"] += 1
        elif ast.unparse(f) in _OPENING:
            if node.args and ast.unparse(node.args[0]).startswith("io.BytesIO("):
                continue  # bytes already read
            found[ast.unparse(f)] += 1
        elif isinstance(f, ast.Attribute) and f.attr in _ATTRS:
            base = ast.unparse(f.value)
            if f.attr in ("remove", "open", "rmdir") and base not in ("os", "io", "builtins"):
                continue  # list.remove, a store's open, ...
            found[f"{base}.{f.attr}"] += 1
    return found


def test_no_module_reads_or_deletes_around_the_primitives() -> None:
    seen: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel.startswith("_src/storage/"):
            continue  # the primitives themselves
        for call, n in direct_file_calls(path.read_text()).items():
            seen[(rel, call)] = n
    assert seen == {k: n for k, (n, _) in ALLOWED.items()}


def test_the_scan_sees_a_read_around_the_opener() -> None:
    src = (
        "def f(p):\n    import shutil\n    x = p.read_text()\n"
        "    shutil.rmtree(p)\n    [].remove(1)\n"
    )
    assert direct_file_calls(src) == Counter({"p.read_text": 1, "shutil.rmtree": 1})
    src = "from safetensors import safe_open\nwith safe_open(str(p), 'pt') as f:\n    pass\n"
    assert direct_file_calls(src + "x = torch.load(p)\n") == Counter(
        {"safe_open": 1, "torch.load": 1}
    )


def test_a_special_file_in_place_of_the_remote_status_is_not_followed(tmp_path: Path) -> None:
    """Regression: ``fckpt ls ROOT`` hung when ``ROOT/.remote.json`` was a FIFO (and
    followed a symlink there to ``/dev/zero``): it was read with ``Path.read_text``."""
    import os
    import subprocess
    import sys

    import torch

    import functional_ckpt as fc
    from functional_ckpt._src.remote.uploader import STATUS_FILE, read_status

    for kind in ("fifo", "link to /dev/zero", "huge"):
        root = tmp_path / kind.replace(" ", "_").replace("/", "")
        with fc.CheckpointManager(root) as mgr:
            mgr.maybe_save({"w": torch.zeros(2)}, step=1)
        status = root / STATUS_FILE
        if kind == "fifo":
            os.mkfifo(status)
        elif kind == "huge":
            with open(status, "wb") as f:
                f.truncate(64 << 20)
        else:
            os.symlink("/dev/zero", status)
        assert read_status(root) == {}
        done = subprocess.run(
            [sys.executable, "-m", "functional_ckpt", "ls", str(root)],
            capture_output=True,
            text=True,
            timeout=HANG,  # a guard against the hang this test is about, not a speed limit
        )
        assert done.returncode == 0, done.stderr
        assert "step_000000001" in done.stdout


def test_json_state_files_are_read_through_one_bounded_reader() -> None:
    """Every JSON document read from a file goes through ``storage/opener.read_state``
    (or a reader that names why it differs): no module decodes what it read itself
    (and ``tests/test_documents.py``: every parse is the bounded loader's)."""
    decoded: dict[str, int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and ast.unparse(node.func) in ("json.loads", "documents.load")
                and node.args
                and "read_file" in ast.unparse(node.args[0])
            ):
                decoded[rel] = decoded.get(rel, 0) + 1
    assert decoded == {"_src/storage/opener.py": 1}


def test_every_state_reader_takes_a_hostile_file_for_nothing_known(tmp_path: Path) -> None:
    """A FIFO, a link, a huge file or JSON nested past the recursion limit in place of
    any state file: the reader says nothing is known, at once, for each of them."""
    import os

    from functional_ckpt._src.remote.uploader import STATUS_FILE, read_status
    from functional_ckpt._src.storage.progress import read_progress
    from functional_ckpt._src.storage.ram import MEMORY_STATUS, read_memory_status

    readers = {
        STATUS_FILE: lambda d: read_status(d) == {},
        MEMORY_STATUS: lambda d: read_memory_status(d) == {},
        "progress.json": lambda d: read_progress(d / "progress.json") is None,
    }
    for i, kind in enumerate(("fifo", "link", "huge", "deep", "not json")):
        for name, nothing_known in readers.items():
            d = tmp_path / f"{i}-{name}"
            d.mkdir()
            target = d / name
            if kind == "fifo":
                os.mkfifo(target)
            elif kind == "link":
                os.symlink("/dev/zero", target)
            elif kind == "huge":
                with open(target, "wb") as f:
                    f.truncate(64 << 20)
            elif kind == "deep":
                target.write_text("[" * 200_000 + "]" * 200_000)
            else:
                target.write_bytes(b"\x00\xffnot json")
            assert nothing_known(d), (kind, name)


#: Collectives of ``torch.distributed`` used anywhere but as what ``groups._collective``
#: runs (the one place a lost peer becomes the project's error, under the helpers every
#: checkpoint collective passes through, counted by tests/dist_job.py and predicted by
#: benchmarks/scale.py), with why each may: none, in save, restore, verify, the tiers
#: and replication alike.
COLLECTIVES_ALLOWED: dict[tuple[str, str], tuple[int, str]] = {}

_COLLECTIVE_NAMES = {
    "all_gather", "all_gather_object", "all_gather_into_tensor", "all_reduce", "barrier",
    "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend",
    "recv", "reduce", "reduce_scatter", "scatter", "scatter_object_list", "send",
}  # fmt: skip


def direct_collectives(source: str) -> Counter[str]:
    """Each ``dist.<collective>`` in ``source`` (called, or passed anywhere but as the
    operation of ``_collective(...)``), each collective imported by name from
    ``torch.distributed``, and every use of ``dcp.save``'s or ``dcp.load``'s module
    (whose rounds all-gather one size per rank: docs/scale.md)."""
    found: Counter[str] = Counter()
    tree = ast.parse(source)
    wrapped = {
        id(node.args[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "_collective"
        and node.args
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in _COLLECTIVE_NAMES:
            if ast.unparse(node.value) in ("dist", "torch.distributed") and id(node) not in wrapped:
                found[f"dist.{node.attr}"] += 1
        elif isinstance(node, ast.ImportFrom) and (node.module or "").endswith(
            ("state_dict_saver", "state_dict_loader")
        ):
            found[(node.module or "").rsplit(".", 1)[-1]] += 1
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            for alias in node.names:
                if alias.name in _COLLECTIVE_NAMES:
                    found[f"dist.{alias.name}"] += 1
    return found


def test_no_module_runs_a_collective_around_the_helpers() -> None:
    seen: dict[tuple[str, str], int] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()  # groups.py too: its own run wrapped
        for call, n in direct_collectives(path.read_text()).items():
            seen[(rel, call)] = n
    assert seen == {k: n for k, (n, _) in COLLECTIVES_ALLOWED.items()}


def test_the_collective_scan_sees_an_object_gather_and_dcp_save() -> None:
    src = (
        "import torch.distributed as dist\n"
        "from torch.distributed.checkpoint.state_dict_saver import save\n"
        "from torch.distributed.checkpoint.state_dict_loader import load\n"
        "from torch.distributed import broadcast, get_rank\n"
        "def f(x, g):\n    dist.gather_object(x, None, 0, g)\n    [].gather(1)\n"
        "    _collective(dist.all_gather, x, g)\n    run(dist.send, x)\n"
        "    _collective(x, dist.recv)\n    op = torch.distributed.barrier\n"
    )
    assert direct_collectives(src) == Counter(
        {
            "dist.gather_object": 1,
            "state_dict_saver": 1,
            "state_dict_loader": 1,
            "dist.broadcast": 1,
            "dist.send": 1,  # passed to something else than the one wrapper
            "dist.recv": 1,  # not as the operation the wrapper runs
            "dist.barrier": 1,  # an alias taken
        }
    )


def state_walks_around_leaves_of(source: str) -> int:
    """Each ``iter_leaves(as_state(x))``: a state's leaves walked by building its tree
    first, which ``state/tree.leaves_of`` gives without the TensorDict."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "iter_leaves"
            and node.args
            and isinstance(node.args[0], ast.Call)
            and isinstance(node.args[0].func, ast.Name)
            and node.args[0].func.id == "as_state"
        ):
            n += 1
    return n


def test_a_state_is_walked_only_through_leaves_of() -> None:
    seen = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        n = state_walks_around_leaves_of(path.read_text())
        if n:
            seen[rel] = n
    assert seen == {"_src/state/tree.py": 1}  # leaves_of's own refusal of a non-mapping


def test_the_walk_scan_sees_a_tree_built_to_be_walked() -> None:
    src = "def f(s):\n    return [x for x in iter_leaves(as_state(s))] + list(iter_leaves(s))\n"
    assert state_walks_around_leaves_of(src) == 1


def test_a_fifo_named_like_an_exports_weights_hangs_no_reader(tmp_path: Path) -> None:
    """Regression: a FIFO at ``ROOT/exports/step_N/model.safetensors`` hung ``fckpt ls ROOT``
    forever, and the training process at its next export: the header was read with
    ``safetensors.safe_open``, a plain ``open`` that follows links and blocks."""
    import os
    import subprocess
    import sys

    import torch

    import functional_ckpt as fc
    from functional_ckpt._src.export.files import header_metadata

    root = tmp_path / "root"
    with fc.CheckpointManager(root, save=fc.every_steps(1)) as mgr:
        mgr.maybe_save({"w": torch.zeros(2)}, step=1)
    for kind in ("fifo", "link"):
        export = root / "exports" / f"step_00000000{5 if kind == 'fifo' else 6}"
        export.mkdir(parents=True)
        if kind == "fifo":
            os.mkfifo(export / "model.safetensors")
        else:
            os.symlink("/dev/zero", export / "model.safetensors")
        if kind == "link":  # a FIFO is read in the children below: it hung the reader
            with pytest.raises(fc.CheckpointError, match=r"model\.safetensors"):
                header_metadata(export)
    for argv in (
        ["-m", "functional_ckpt", "ls", str(root)],
        [
            "-c",
            "import sys, torch, functional_ckpt as fc\n"
            "from functional_ckpt.manager import Export\n"
            "export = Export(policy=fc.every_steps(1), keep=fc.keep_last(1))\n"
            "with fc.CheckpointManager(sys.argv[1], save=fc.every_steps(1), export=export) as m:\n"
            "    m.maybe_save({'model': {'w': torch.zeros(2)}}, step=7)\n",
            str(root),
        ],
    ):
        done = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=HANG,  # a guard against the hang this test is about, not a speed limit
        )
        assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "step_000000001"
        in subprocess.run(
            [sys.executable, "-m", "functional_ckpt", "ls", str(root)],
            capture_output=True,
            text=True,
            timeout=HANG,
        ).stdout
    )
    assert (root / "exports" / "step_000000007" / "model.safetensors").is_file()


# ------------------------------------------------------------------------ unpickling

#: Every call that unpickles, by module, and why its bytes are not a checkpoint's own.
UNPICKLES: dict[tuple[str, str], tuple[int, str]] = {
    ("_src/export/torch_save.py", "torch.load"): (1, "a torch.save file the user names"),
    ("_src/restore/stock_dcp.py", "torch.load"): (1, "a stock DCP checkpoint's tensors"),
    ("_src/restore/stock_dcp.py", "_PlainUnpickler"): (
        1,
        "a stock DCP checkpoint's values: every global refused, plain data only",
    ),
    ("_src/format/unpickler.py", "RestrictedUnpickler"): (1, "the restricted .metadata reader"),
}

_UNPICKLING = {"torch.load", "pickle.load", "pickle.loads", "pickle.Unpickler"}


def unpickling_calls(source: str) -> Counter[str]:
    """Calls in ``source`` that unpickle bytes (any ``*Unpickler`` made included)."""
    found: Counter[str] = Counter()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name in _UNPICKLING or name.endswith("Unpickler"):
                found[name if name in _UNPICKLING else name.rpartition(".")[2]] += 1
    return found


def test_no_module_unpickles_a_checkpoints_bytes_beyond_the_argued_ones() -> None:
    """A DCP reader, a restore or a tier that unpickled a checkpoint's stored bytes
    would hand its author code execution: only the listed calls unpickle."""
    found = {
        (str(p.relative_to(PACKAGE)), name): n
        for p in sorted(PACKAGE.rglob("*.py"))
        for name, n in unpickling_calls(p.read_text()).items()
    }
    assert found == {k: n for k, (n, _) in UNPICKLES.items()}
    for p in sorted(PACKAGE.rglob("*.py")):  # each torch.load builds no arbitrary class
        assert unsafe_loads(p.read_text()) == [], p


def unsafe_loads(source: str) -> list[str]:
    """``torch.load`` calls in ``source`` not passing ``weights_only=True``."""
    return [
        ast.unparse(node)
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and ast.unparse(node.func) == "torch.load"
        and not any(
            k.arg == "weights_only" and isinstance(k.value, ast.Constant) and k.value.value is True
            for k in node.keywords
        )
    ]


def test_the_unpickling_scan_sees_a_stored_value_loaded() -> None:
    src = "torch.load(io.BytesIO(data), weights_only=True)\npickle.loads(b)\nm._Mine(f).load()\n"
    assert unpickling_calls(src) == Counter({"torch.load": 1, "pickle.loads": 1})
    assert unpickling_calls("x = _MineUnpickler(f).load()\n") == Counter({"_MineUnpickler": 1})
    assert unsafe_loads(src) == []
    assert unsafe_loads("torch.load(f)\ntorch.load(f, weights_only=False)\n") == [
        "torch.load(f)",
        "torch.load(f, weights_only=False)",
    ]


#: (module path, call) -> how many, and why each reads a checkpoint's header (the
#: manager's record, its step) other than through ``storage/committed.header_named``.
HEADER_READS: dict[tuple[str, str], tuple[int, str]] = {
    ("_src/format/header.py", "record_of"): (1, "header_of itself"),
    ("_src/storage/committed.py", "header_of"): (1, "header_named itself"),
    ("_src/root/listing.py", "header_of"): (1, "a leftover's save time: no committed checkpoint"),
    ("_src/manager/fork.py", "header_of"): (1, "the one checkpoint fork is given by path"),
    ("_src/restore/contents.py", "header_of"): (1, "the one checkpoint fc.inspect is given"),
    ("_src/manager/manager.py", "record_of"): (1, "a summary read_info made, already checked"),
    ("_src/manager/provenance.py", "record_of"): (
        2,
        "the lineage and cut rules' step: header_named's",
    ),
    ("_src/cli/listing.py", "record_of"): (1, "an ok row's metadata: header_named read it"),
}


def header_reads(source: str) -> Counter[str]:
    """Each call of ``header_of`` or ``record_of`` in ``source``, however imported."""
    found: Counter[str] = Counter()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func).rpartition(".")[2]
            if name in ("header_of", "record_of"):
                found[name] += 1
    return found


def test_the_checkpoints_of_a_root_are_read_through_header_named() -> None:
    """A ``step_N`` folder whose checkpoint records another step is damage to every
    reader of a root or a remote (resume, ls, verify, prune, the upload choice, the
    newer-step guard): one that read the record some other way would take the folder
    for its name's step, keep it as the newest, upload it, or refuse a save for it."""
    found = {
        (p.relative_to(PACKAGE).as_posix(), name): n
        for p in sorted(PACKAGE.rglob("*.py"))
        for name, n in header_reads(p.read_text()).items()
    }
    assert found == {k: n for k, (n, _) in HEADER_READS.items()}


def test_the_header_scan_sees_a_record_read_around_it() -> None:
    src = (
        "h = header.header_of(m)\nr = record_of(h.metadata)\nf = header_of\nheader_named(m, 1, p)\n"
    )
    assert header_reads(src) == Counter({"header_of": 1, "record_of": 1})


def direct_warnings(source: str) -> int:
    """Each warning raised around ``log.warn`` (``warnings.warn``, ``warn_explicit``, or
    either imported from ``warnings``): a fallback the ``functional_ckpt`` logger never hears of."""
    n = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module == "warnings":
            n += sum(a.name in ("warn", "warn_explicit") for a in node.names)
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in (
            "warnings.warn",
            "warnings.warn_explicit",
        ):
            n += 1
    return n


def test_every_warning_is_raised_with_its_log_record() -> None:
    seen = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        n = direct_warnings(path.read_text())
        if n:
            seen[rel] = n
    assert seen == {"_src/log.py": 1}  # log.warn: the warning and its record


def test_the_warning_scan_sees_a_warning_raised_around_the_helper() -> None:
    src = (
        "import warnings\nfrom warnings import warn as w\n"
        "warnings.warn('x', UserWarning)\nwarn('y', UserWarning, stacklevel=2)\n"
    )
    assert direct_warnings(src) == 2
