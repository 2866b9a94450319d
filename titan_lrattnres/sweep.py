"""``python -m titan_lrattnres.sweep``: runs :mod:`titan_lrattnres.evaluation.sweep`."""

from titan_lrattnres.evaluation.sweep import main

if __name__ == "__main__":
    raise SystemExit(main())
