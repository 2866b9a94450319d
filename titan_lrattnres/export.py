"""``python -m titan_lrattnres.export``: runs :mod:`titan_lrattnres.evaluation.export`."""

from titan_lrattnres.evaluation.export import main

if __name__ == "__main__":
    raise SystemExit(main())
