"""What the fused kernels (C and Triton) read: the row layout; torch only, shared by both."""

from __future__ import annotations

import torch


def rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., w]`` as a ``[T, w]`` view with unit column stride (copies only if it must; a
    width-1 column is read through its row stride alone and never copied).

    A copy must be passed to the kernel itself (as the launchers and ``custom_ops.cpu`` do), or
    be kept alive until the call returns, never just its address, or it is freed before the
    kernel reads it.
    """
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 or x2.shape[-1] == 1 else x2.contiguous()
