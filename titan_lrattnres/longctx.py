"""``python -m titan_lrattnres.longctx``: runs :mod:`titan_lrattnres.evaluation.longctx`."""

from titan_lrattnres.evaluation.longctx import main

if __name__ == "__main__":
    raise SystemExit(main())
