"""``python -m titan_lrattnres.convert``: runs :mod:`titan_lrattnres.components.convert`."""

from titan_lrattnres.components.convert import main

if __name__ == "__main__":
    raise SystemExit(main())
