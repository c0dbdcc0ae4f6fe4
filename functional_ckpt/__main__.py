"""``python -m functional_ckpt``: the ``fckpt`` command line without the console script."""

from functional_ckpt.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
