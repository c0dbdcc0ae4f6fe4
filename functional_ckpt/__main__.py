"""``python -m functional_ckpt``: the ``fckpt`` command line without the console script."""

from functional_ckpt._src.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
