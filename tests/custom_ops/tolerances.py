"""Per-dtype tolerances for the depth-read ops: the ONE place they live.

Errors are relative RMS (as FLA compares): ``||actual - expected|| <= rel·||expected|| +
abs·sqrt(numel)``, so a gradient that is off by a factor or misses a term fails whatever its
scale. The absolute floor only matters for quantities that are exactly zero in exact arithmetic
(e.g. the key gradient when r = 1, where RMSNorm(k) = sign(k)); inputs are O(1).
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


def assert_close(name: str, actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype):
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} vs {expected.shape}"
    rel, abs_ = TOLERANCES[dtype]
    a, e = actual.detach().double(), expected.detach().double()
    diff, bound = (a - e).norm().item(), rel * e.norm().item() + abs_ * e.numel() ** 0.5
    assert diff <= bound, (
        f"{name}: ||diff|| {diff:.3g} > {bound:.3g} "
        f"(relative RMS error {rel_rms(a, e):.3g}, {dtype})"
    )
