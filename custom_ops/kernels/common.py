"""Host-side helpers shared by the kernels: 2-D views, pointer tables, block sizes."""

from __future__ import annotations

import os

import torch
import triton

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def rows(x: torch.Tensor) -> torch.Tensor:
    """``[..., w]`` as a ``[T, w]`` view with unit column stride (copies only if it must)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def source_table(values2d, keys2d, rank: int, device: torch.device) -> torch.Tensor:
    """int64 ``[4, S]``: value pointers, value row strides, key pointers, key row strides.

    Strides are in elements. ``keys2d=None`` means sliced keys: the key of source s starts at
    column ``d - rank`` of value s and shares its row stride.
    """
    vp = [v.data_ptr() for v in values2d]
    vs = [v.stride(0) for v in values2d]
    if keys2d is None:
        width, esize = values2d[0].shape[-1], values2d[0].element_size()
        kp = [p + (width - rank) * esize for p in vp]
        ks = vs
    else:
        kp = [k.data_ptr() for k in keys2d]
        ks = [k.stride(0) for k in keys2d]
    table = torch.tensor([vp, vs, kp, ks], dtype=torch.int64)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def pointer_table(tensors, device: torch.device) -> torch.Tensor:
    """int64 ``[S]`` of data pointers (gradient outputs, all contiguous)."""
    table = torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)
    if device.type == "cuda":
        return table.pin_memory().to(device, non_blocking=True)
    return table


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _floor2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def blocks(n_queries: int, d: int, rank: int, budget: int | None = None):
    """``(BLOCK_C, BLOCK_T, BLOCK_D, BLOCK_R, num_warps)`` for a token-block program.

    The fp32 accumulator is ``[BLOCK_C, BLOCK_T, BLOCK_D]``; ``budget`` caps its element count
    (registers on GPU; under the interpreter cost is per program, so tiles are large, but
    BLOCK_D stays small enough that tests exercise the loop over d tiles).
    """
    bc = pow2(n_queries)
    if INTERPRET:
        bd = min(pow2(d), 64)
        bt = _floor2(min(128, (budget or 16384) // (bc * bd)))
        return bc, bt, bd, min(pow2(rank), 64), 1
    budget = budget or 8192
    bd = min(pow2(d), 4096, max(128, 16384 // bc))
    bt = _floor2(min(64, budget // (bc * bd)))
    br = min(pow2(rank), _floor2(max(16, 4096 // (bc * bt))))
    return bc, bt, bd, br, 8 if bc * bt * bd >= 4096 else 4
