"""``python -m functional_ckpt._src.cli.demo``: the children's entry point, else ``fckpt demo``."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["train"]:
        from functional_ckpt._src.cli.demo.job import child_main

        return child_main(args[1:])
    from functional_ckpt._src.cli.main import main as cli_main

    return cli_main(["demo", *args])


if __name__ == "__main__":
    raise SystemExit(main())
