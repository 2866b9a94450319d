"""``python -m titan_lrattnres.data``: runs :mod:`titan_lrattnres.components.data`."""

from titan_lrattnres.components.data import main

if __name__ == "__main__":
    raise SystemExit(main())
