"""Bytes per pipeline hop, naive vs with the cross-stage source cache
(titan_lrattnres.parallel.pipeline).

    python -m benchmarks.pipeline_hops [--layers 24 --dim 1024 --blocks 8 --rank 64
        --variant sliced] [--json PATH]

Counted from the stage plans the training uses (not timed): per token and per optimizer step of
one microbatch, the bytes every stage boundary sends forward (bf16 values, fp32 projected keys;
the backward sends the same amounts back), for 4 and 8 pipeline ranks with one stage per rank
(1F1B) and two (Interleaved1F1B, loop placement), the sublayers split evenly. "naive" ships the
whole depth state at every hop; "cached" ships only what the receiving rank does not already
hold; "h only" is what a plain residual stream sends.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks.meta import environment, write
from titan_lrattnres.parallel.pipeline_plan import hop_table


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.pipeline_hops", description=__doc__)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--blocks", type=int, default=8)
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--variant", default="sliced", choices=("attnres", "sliced", "projected"))
    p.add_argument("--json")
    a = p.parse_args(argv)
    tables = [
        hop_table(a.layers, a.dim, a.blocks, a.rank, a.variant, stages, per_rank)
        for stages in (4, 8)
        for per_rank in (1, 2)
    ]
    print(
        f"{a.variant} Block N={a.blocks}, L={a.layers}, d={a.dim}: bytes per token sent forward "
        "over all hops (bf16 values, fp32 keys)"
    )
    print("| ranks | stages/rank | hops | h only | naive | cached | cached / naive |")
    print("|---|---|---|---|---|---|---|")
    for t in tables:
        n, c = t["total"]["naive"], t["total"]["cached"]
        print(
            f"| {t['stages']} | {t['per_rank']} | {len(t['hops'])} | {t['h_only']:,} | {n:,} | "
            f"{c:,} | {c / n:.2f} |"
        )
    if a.json:
        write(a.json, {"args": vars(a), **environment(), "tables": tables})
    return 0


if __name__ == "__main__":
    sys.exit(main())
