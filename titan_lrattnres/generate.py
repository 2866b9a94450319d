"""``python -m titan_lrattnres.generate``: runs :mod:`titan_lrattnres.evaluation.generate`."""

from titan_lrattnres.evaluation.generate import main

if __name__ == "__main__":
    raise SystemExit(main())
