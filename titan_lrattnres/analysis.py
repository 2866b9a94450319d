"""``python -m titan_lrattnres.analysis``: runs :mod:`titan_lrattnres.evaluation.analysis`."""

from titan_lrattnres.evaluation.analysis import main

if __name__ == "__main__":
    raise SystemExit(main())
