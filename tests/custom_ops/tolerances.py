"""Per-dtype tolerances for the depth-read ops: the ONE place they live.

Errors are relative RMS (as FLA compares): ``||actual - expected|| <= rel·||expected|| +
abs·sqrt(numel)``, so a gradient that is off by a factor or misses a term fails whatever its
scale. The absolute floor only matters for quantities that are (nearly) zero in exact
arithmetic (e.g. the key gradient when r = 1, where RMSNorm(k) = sign(k) up to eps); inputs are
O(1). Where a computation cancels by a known factor, ``conditioning`` scales the relative part
(``rank_one_cancellation``: the r = 1 key gradient at moderate |k|).
"""

from __future__ import annotations

import torch

# Reference and fast paths both accumulate in fp32; the spread is the final rounding to the
# output dtype plus fp32 reassociation (the online softmax vs the stacked softmax).
TOLERANCES = {  # dtype: (rel, abs)
    torch.float32: (2e-5, 2e-5),
    torch.float16: (3e-3, 1e-3),
    torch.bfloat16: (2e-2, 8e-3),
}
DTYPES = tuple(TOLERANCES)


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.detach().double(), expected.detach().double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def rank_one_cancellation(key: torch.Tensor | None, eps: float) -> torch.Tensor | float:
    """Per element of an r = 1 key, by how much its gradient's two terms exceed the gradient
    (1 for r > 1 or no key).

    RMSNorm(k) = k / sqrt(k² + eps) has the derivative eps / (k² + eps)^1.5, the difference of
    two terms (k² + eps) / eps times larger: any two fp32 evaluations agree to that many times
    fewer digits (|k| = 0.05: ~2,500x; measured 4e-4 relative between the C kernel and the
    composite, each as far from float64). Scaling the expected gradient by it gives the size of
    the terms, whose rounding is what the tolerance bounds."""
    if key is None or key.shape[-1] != 1:
        return 1.0
    k2 = key.detach().double().pow(2)
    return (k2 + eps) / eps


def assert_close(
    name: str,
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    conditioning: torch.Tensor | float = 1.0,
):
    """``conditioning``: per element, how much the computation amplifies rounding relative to
    the result (e.g. ``rank_one_cancellation``); the relative bound applies to ``expected``
    scaled by it."""
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} vs {expected.shape}"
    rel, abs_ = TOLERANCES[dtype]
    a, e = actual.detach().double(), expected.detach().double()
    scale = (e * conditioning).norm().item()
    diff, bound = (a - e).norm().item(), rel * scale + abs_ * e.numel() ** 0.5
    assert diff <= bound, (
        f"{name}: ||diff|| {diff:.3g} > {bound:.3g} "
        f"(relative RMS error {rel_rms(a, e):.3g}, {dtype})"
    )
