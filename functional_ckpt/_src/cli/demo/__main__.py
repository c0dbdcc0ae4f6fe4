"""``python -m functional_ckpt._src.cli.demo train DIR ...``: a child; else ``fckpt demo``."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    if sys.argv[1:2] == ["train"]:
        from functional_ckpt._src.cli.demo.job import child_main

        raise SystemExit(child_main(sys.argv[2:]))
    from functional_ckpt._src.cli.main import main

    raise SystemExit(main(["demo", *sys.argv[1:]]))
