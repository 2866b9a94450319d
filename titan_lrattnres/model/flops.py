"""The paper's added-FLOPs accounting (docs/method.md §5), per token, forward.

core  = L · (8 d² + 6 d h)                 no attention scores, embedding or LM head
read  = 2 (d + r) · Σ_{t=1..M} |S_t|       2r logit dot + 2d weighted sum
proj  = 2 r · (L (d + h) + d)              projected only: W^K rows + embedding key
added % = 100 · (read + proj) / core       standard AttnRes: r = d
"""

from __future__ import annotations

from custom_ops.schedule import source_counts

VARIANTS = ("baseline", "attnres", "sliced", "projected")


def core_flops(num_layers: int, dim: int, hidden: int) -> int:
    return num_layers * (8 * dim * dim + 6 * dim * hidden)


def routing_flops(
    variant: str,
    num_layers: int,
    dim: int,
    hidden: int,
    rank: int | None,
    blocks: int | None,
    *,
    block_layers: int | None = None,
) -> int:
    """Forward FLOPs per token the depth routing adds over the baseline (read + projection)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    if variant == "baseline":
        return 0
    r = dim if variant == "attnres" else rank
    if r is None:
        raise ValueError(f"variant {variant!r} needs a rank")
    read = 2 * (dim + r) * sum(source_counts(num_layers, blocks, block_layers=block_layers))
    proj = 2 * r * (num_layers * (dim + hidden) + dim) if variant == "projected" else 0
    return read + proj


def added_flops_percent(
    variant: str,
    *,
    num_layers: int,
    dim: int,
    hidden: int,
    rank: int | None = None,
    blocks: int | None = None,
    block_layers: int | None = None,
) -> float:
    """Added FLOPs % over the core (docs/method.md §5). ``blocks=None`` is Full; ``rank`` is
    ignored for ``attnres`` (r = d) and ``baseline``."""
    extra = routing_flops(variant, num_layers, dim, hidden, rank, blocks, block_layers=block_layers)
    return 100.0 * extra / core_flops(num_layers, dim, hidden)
