"""``python -m titan_lrattnres.sweep``: runs :mod:`titan_lrattnres.evaluation.sweep`, or with
``--budget`` :mod:`titan_lrattnres.evaluation.budget` (the comparison at a matched budget)."""

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--budget" in argv:
        from titan_lrattnres.evaluation.budget import main as budget

        return budget([a for a in argv if a != "--budget"])
    from titan_lrattnres.evaluation.sweep import main as sweep

    return sweep(argv)


if __name__ == "__main__":
    raise SystemExit(main())
