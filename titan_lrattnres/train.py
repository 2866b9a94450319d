"""``python -m titan_lrattnres.train``: runs :mod:`titan_lrattnres.training.train`."""

from titan_lrattnres.training.train import main

if __name__ == "__main__":
    raise SystemExit(main())
