"""Depth-source schedule of LR-AttnRes (docs/method.md §3): block ends and the source sets.

Sublayers are numbered j = 1..M (M = 2L; odd j = attention, even j = MLP). Read site t in 0..M
produces the input of sublayer t+1; site M is the final read.

A Block schedule is given either by its block COUNT N (``num_blocks``: ends ``ceil(M·i/N)``, the
paper's) or by its block SIZE in layers k (``block_layers``: an end every 2k sublayers from the
start, the last block partial, as Kimi's models are described); the two coincide when k divides
L and N = L/k. Neither given = Full AttnRes (every sublayer its own source).
"""

from __future__ import annotations


def check_schedule(
    num_sublayers: int,
    num_blocks: int | None = None,
    block_layers: int | None = None,
    *,
    count_field: str = "num_blocks",
    count_given: bool | None = None,
) -> None:
    """Raise ``ValueError`` naming the field and its allowed range unless ``num_blocks`` (None =
    Full) or ``block_layers`` (None = not by size) is a schedule of ``num_sublayers`` sublayers:
    the one check of these fields (the functions below and the model config call it).

    ``count_field``: the count's name as the caller's users spell it (the model config's
    ``blocks``). ``count_given``: whether the count was given (default: it is not None); a caller
    whose count defaults to a number tells an explicit None (Full) from none given.
    """
    given = num_blocks is not None if count_given is None else count_given
    if given and block_layers is not None:
        raise ValueError(
            f"give blocks (a count, got {num_blocks!r}) or block_layers (a size in layers, got "
            f"{block_layers!r}), not both"
        )
    if block_layers is not None:
        _check_block_layers(num_sublayers, block_layers)
        return
    if not (isinstance(num_sublayers, int) and num_sublayers >= 1):
        raise ValueError(f"num_sublayers must be an int >= 1, got {num_sublayers!r}")
    if num_blocks is not None and not (
        isinstance(num_blocks, int) and 1 <= num_blocks <= num_sublayers
    ):
        raise ValueError(
            f"{count_field} must be None (Full) or an int in [1, {num_sublayers}] (= 2L), got "
            f"{num_blocks!r}"
        )


def _check_block_layers(num_sublayers: int, block_layers: int) -> None:
    if not (isinstance(num_sublayers, int) and num_sublayers >= 2 and num_sublayers % 2 == 0):
        raise ValueError(f"num_sublayers must be 2L >= 2, got {num_sublayers!r}")
    if not (isinstance(block_layers, int) and 1 <= block_layers <= num_sublayers // 2):
        raise ValueError(
            f"block_layers must be an int in [1, {num_sublayers // 2}] (= L), got {block_layers!r}"
        )


def block_ends(num_sublayers: int, num_blocks: int | None) -> list[int]:
    """Block ends ``E = {ceil(M·i/N) : i = 1..N}`` in SUBLAYER units; increasing, last = M.
    ``num_blocks`` None = Full (N = M)."""
    check_schedule(num_sublayers, num_blocks)
    n = num_sublayers if num_blocks is None else num_blocks
    # integer ceil avoids float rounding at large M
    return [-(-num_sublayers * i // n) for i in range(1, n + 1)]


def layer_block_ends(num_sublayers: int, block_layers: int) -> list[int]:
    """Block ends every ``2·block_layers`` sublayers, then ``M`` (the last block may be shorter)."""
    _check_block_layers(num_sublayers, block_layers)  # None too: here the size is the schedule
    size = 2 * block_layers
    return [*range(size, num_sublayers, size), num_sublayers]


def schedule_ends(
    num_sublayers: int, num_blocks: int | None = None, block_layers: int | None = None
) -> list[int]:
    """Block ends of a schedule given by ``num_blocks`` or by ``block_layers`` (not both);
    neither = Full (an end after every sublayer)."""
    check_schedule(num_sublayers, num_blocks, block_layers)
    if block_layers is not None:
        return layer_block_ends(num_sublayers, block_layers)
    return block_ends(num_sublayers, num_blocks)


def source_sets(
    num_sublayers: int, num_blocks: int | None = None, block_layers: int | None = None
) -> list[tuple[int, bool]]:
    """The walk of the source sets over read sites t = 0..M: ``(completed, partial)`` per site,
    ``S_t`` = the embedding, ``completed`` completed sources (blocks; Full: sublayer outputs)
    and, when ``partial``, the running sum of the incomplete block.

    After sublayer j the running sum takes its output, and at a block end it becomes the next
    completed source. The one walk of a schedule: :func:`site_sources` and
    :func:`source_counts` read it, and ``DepthRouter.step`` does the same with tensors (at the
    ends it precomputes from :func:`schedule_ends`; a test holds the two together).
    """
    ends = set(schedule_ends(num_sublayers, num_blocks, block_layers))
    walk, completed, partial = [(0, False)], 0, False
    for j in range(1, num_sublayers + 1):
        if j in ends:
            completed, partial = completed + 1, False
        else:
            partial = True
        walk.append((completed, partial))
    return walk


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
    completed, partial = source_sets(num_sublayers, num_blocks, block_layers)[t]
    kind = "output" if num_blocks is None and block_layers is None else "block"
    sources = [("embedding", 0), *((kind, n) for n in range(1, completed + 1))]
    if partial:
        sources.append(("partial", completed + 1))
    return sources


def source_counts(
    num_layers: int, num_blocks: int | None, *, block_layers: int | None = None
) -> list[int]:
    """``|S_t|`` for read sites t = 1..2L (``num_blocks`` and ``block_layers`` None = Full)."""
    walk = source_sets(2 * num_layers, num_blocks, block_layers)
    return [1 + completed + partial for completed, partial in walk[1:]]


__all__ = [
    "block_ends",
    "check_schedule",
    "layer_block_ends",
    "schedule_ends",
    "site_sources",
    "source_counts",
    "source_sets",
]
