"""Helpers shared by the kernels: 2-D views, pointer tables, block sizes, launch descriptions
(host side) and the ``@triton.jit`` pieces the kernels share (inlined by Triton)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

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


def blocks(n_queries: int, d: int, rank: int, budget: int | None = None, gpu: bool | None = None):
    """``(BLOCK_C, BLOCK_T, BLOCK_D, BLOCK_R, num_warps)`` for a token-block program.

    The fp32 accumulator is ``[BLOCK_C, BLOCK_T, BLOCK_D]``; ``budget`` caps its element count
    (registers on GPU; under the interpreter cost is per program, so tiles are large, but
    BLOCK_D stays small enough that tests exercise the loop over d tiles). ``gpu`` picks the
    GPU (True) or interpreter (False) branch; None follows ``TRITON_INTERPRET``.
    """
    bc = pow2(n_queries)
    if not (gpu if gpu is not None else not INTERPRET):
        bd = min(pow2(d), 64)
        bt = _floor2(min(128, (budget or 16384) // (bc * bd)))
        return bc, bt, bd, min(pow2(rank), 64), 1
    # budget 4096 fp32 elements = 16 per thread at 8 warps. Measured with ptxas -v for sm_90a
    # (tests/custom_ops/test_kernels_sm90.py, bf16, d=1024, r=64): the former 8192 / BLOCK_D up
    # to 16384 // BLOCK_C spilled (fwd 4x2x1024: 80 regs, 16 B spill stores; bwd 8x1x1024 at
    # d=1000: 255 regs, 228 B; bwd 32x1x512: 255 regs, 148 B, 3.2 KB at d=1000).
    budget = budget or 4096
    bd = min(pow2(d), 4096, max(128, budget // bc))
    bt = _floor2(min(64, budget // (bc * bd)))
    br = min(pow2(rank), _floor2(max(16, 4096 // (bc * bt))))
    return bc, bt, bd, br, 8 if bc * bt * bd >= 4096 else 4


class Launch(NamedTuple):
    """One kernel launch as the launcher would issue it: ``kernel[grid](*args, **constexprs,
    num_warps=num_warps)``. Computable without launching (ahead-of-time compile tests)."""

    kernel: Any
    grid: tuple
    args: tuple
    constexprs: dict
    num_warps: int

    def __call__(self):
        self.kernel[self.grid](*self.args, **self.constexprs, num_warps=self.num_warps)


# --------------------------------------------------------------------------- @triton.jit pieces


@triton.jit
def load_tile(PTR, rows, row_stride, cols, mask_rows, mask_cols):
    """fp32 ``[len(rows), len(cols)]`` tile of ``PTR[rows * row_stride + cols]``, 0 outside."""
    return tl.load(
        PTR + rows[:, None] * row_stride + cols[None, :],
        mask=mask_rows[:, None] & mask_cols[None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def source(TABLE, S, s, V0, K0):
    """Source ``s`` of an int64 ``[4, S]`` ``source_table``: (value ptr, value row stride,
    key ptr, key row stride), pointers typed like ``V0`` / ``K0``."""
    v_ptr = tl.load(TABLE + s).to(tl.pointer_type(V0.dtype.element_ty))
    v_stride = tl.load(TABLE + S + s)
    k_ptr = tl.load(TABLE + 2 * S + s).to(tl.pointer_type(K0.dtype.element_ty))
    k_stride = tl.load(TABLE + 3 * S + s)
    return v_ptr, v_stride, k_ptr, k_stride


@triton.jit
def bank_logits(
    k_ptr,
    k_stride,
    Q,
    offs_t,
    mask_t,
    offs_c,
    mask_c,
    R,
    eps,
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """``(ℓ [BLOCK_C, BLOCK_T], rstd [BLOCK_T])``: ``ℓ_c = <q_c, k · rstd>`` with the key's
    RMSNorm ``rstd = rsqrt(mean(k²) + eps)``, one loop over r tiles, all fp32."""
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    dot = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        k = load_tile(k_ptr, offs_t, k_stride, offs_r, mask_t, mask_r)
        q = load_tile(Q, offs_c, R, offs_r, mask_c, mask_r)
        sumsq += tl.sum(k * k, axis=1)
        dot += tl.sum(q[:, None, :] * k[None, :, :], axis=2)
    rstd = tl.rsqrt(sumsq / R + eps)
    return dot * rstd[None, :], rstd
