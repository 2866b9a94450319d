"""``python -m benchmarks.tiny_paper NAME [--section.field VALUE ...]``: a paper config
(``train_configs.paper_grid``: the paper's recipe with Muon, selective activation
checkpointing, every layer compiled) at the ``debug`` flavor and T=64, through the real Trainer
(``titan_lrattnres.train``), as the training-speed run's CPU dry run trains it.

Only the flavor and the sequence length change (``paper_grid.make_config`` is wrapped in this
process); everything else is the paper config's own, and the command-line overrides apply on
top as ``python -m titan_lrattnres.train`` takes them.
"""

from __future__ import annotations

import sys

FLAVOR = "cpu_small"
SEQ_LEN = 64


def main(argv: list[str] | None = None) -> int:
    import train_configs.paper_grid as grid

    make_config = grid.make_config

    def tiny(**kwargs):
        kwargs.update(flavor=FLAVOR, seq_len=SEQ_LEN)
        return make_config(**kwargs)

    grid.make_config = tiny  # paper_config looks it up when called
    from titan_lrattnres import train

    return train.main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    raise SystemExit(main())
