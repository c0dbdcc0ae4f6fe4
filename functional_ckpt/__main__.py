"""``python -m functional_ckpt``: the ``fckpt`` command line without the console script."""

from functional_ckpt.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
