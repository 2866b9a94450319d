"""Depth-source schedule of LR-AttnRes (SPEC §3): block ends and source counts.

Sublayers are numbered j = 1..M (M = 2L; odd j = attention, even j = MLP). Read site t in 0..M
produces the input of sublayer t+1; site M is the final read.

A Block schedule is given either by its block COUNT N (``num_blocks``: ends ``ceil(M·i/N)``, the
paper's) or by its block SIZE in layers k (``block_layers``: an end every 2k sublayers from the
start, the last block partial, as Kimi's models are described); the two coincide when k divides
L and N = L/k. Neither given = Full AttnRes (every sublayer its own source).
"""

from __future__ import annotations


def block_ends(num_sublayers: int, num_blocks: int) -> list[int]:
    """Block ends ``E = {ceil(M·i/N) : i = 1..N}`` in SUBLAYER units; increasing, last = M."""
    if num_sublayers < 1:
        raise ValueError(f"num_sublayers must be >= 1, got {num_sublayers}")
    if not 1 <= num_blocks <= num_sublayers:
        raise ValueError(f"num_blocks must be in [1, {num_sublayers}] (= 2L), got {num_blocks}")
    # integer ceil avoids float rounding at large M
    return [-(-num_sublayers * i // num_blocks) for i in range(1, num_blocks + 1)]


def layer_block_ends(num_sublayers: int, block_layers: int) -> list[int]:
    """Block ends every ``2·block_layers`` sublayers, then ``M`` (the last block may be shorter)."""
    if num_sublayers < 2 or num_sublayers % 2:
        raise ValueError(f"num_sublayers must be 2L >= 2, got {num_sublayers}")
    if not (isinstance(block_layers, int) and 1 <= block_layers <= num_sublayers // 2):
        raise ValueError(
            f"block_layers must be an int in [1, {num_sublayers // 2}] (= L), got {block_layers!r}"
        )
    size = 2 * block_layers
    return [*range(size, num_sublayers, size), num_sublayers]


def schedule_ends(
    num_sublayers: int, num_blocks: int | None = None, block_layers: int | None = None
) -> list[int]:
    """Block ends of a schedule given by ``num_blocks`` or by ``block_layers`` (not both);
    neither = Full (an end after every sublayer)."""
    if num_blocks is not None and block_layers is not None:
        raise ValueError(
            f"give blocks (a count, got {num_blocks}) or block_layers (a size in layers, got "
            f"{block_layers}), not both"
        )
    if block_layers is not None:
        return layer_block_ends(num_sublayers, block_layers)
    return block_ends(num_sublayers, num_sublayers if num_blocks is None else num_blocks)


def site_sources(
    t: int, num_sublayers: int, num_blocks: int | None, *, block_layers: int | None = None
) -> list[tuple[str, int]]:
    """The source set S_t of read site t, as symbolic names.

    Returns a list of ``(kind, index)``: ``("embedding", 0)``, ``("output", j)`` for Full,
    ``("block", n)`` for completed block n (1-based) and ``("partial", n)`` for the running sum of
    the incomplete block n. Order: embedding, then sources in depth order.
    """
    if not 0 <= t <= num_sublayers:
        raise ValueError(f"read site must be in [0, {num_sublayers}], got {t}")
    sources = [("embedding", 0)]
    if num_blocks is None and block_layers is None:
        return sources + [("output", j) for j in range(1, t + 1)]
    ends = schedule_ends(num_sublayers, num_blocks, block_layers)
    completed = sum(1 for e in ends if e <= t)
    sources += [("block", n) for n in range(1, completed + 1)]
    start = ends[completed - 1] if completed else 0
    if t > start:
        sources.append(("partial", completed + 1))
    return sources


def source_counts(
    num_layers: int, num_blocks: int | None, *, block_layers: int | None = None
) -> list[int]:
    """``|S_t|`` for read sites t = 1..2L (``num_blocks`` and ``block_layers`` None = Full)."""
    m = 2 * num_layers
    if num_blocks is None and block_layers is None:
        return [t + 1 for t in range(1, m + 1)]
    ends = set(schedule_ends(m, num_blocks, block_layers))
    counts, completed, partial = [], 0, False
    for t in range(1, m + 1):
        if t in ends:
            completed, partial = completed + 1, False
        else:
            partial = True
        counts.append(1 + completed + int(partial))
    return counts


__all__ = ["block_ends", "layer_block_ends", "schedule_ends", "site_sources", "source_counts"]
