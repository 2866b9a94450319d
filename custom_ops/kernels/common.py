"""Helpers shared by the kernels: 2-D views (``custom_ops.layout.rows``), sources as kernel
arguments, block sizes, launch descriptions (host side) and the ``@triton.jit`` pieces the kernels
share (inlined by Triton)."""

from __future__ import annotations

import functools
import os
from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from custom_ops.layout import rows
from custom_ops.reference import NORM_DOWN, NORM_HUGE_SUMSQ

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def bucket(n: int) -> int:
    """Padded source count: one compile serves every S in (bucket / 2, bucket], at least 8."""
    return max(8, pow2(n))


def padded(items, n: int) -> tuple:
    """``items`` padded to ``n`` with ``items[0]`` (never read: the kernels loop to S only)."""
    return (*items, *(items[0],) * (n - len(items)))


def alignment(dtype: torch.dtype, *ints: int) -> int:
    """Largest power of two ``A <= 16 bytes / element size`` dividing every int (in elements).

    The kernels rewrite each row stride and width as ``aligned(x, A)`` so Triton can prove that
    a row of ``A`` elements starts 16-byte aligned (128-bit loads); see ``aligned``.
    """
    a = 16 // dtype.itemsize
    while a > 1 and any(x % a for x in ints):
        a //= 2
    return a


def key_dtype(keys) -> torch.dtype:
    """One element type for all keys (the kernels select among them): the promoted type, so
    converting any key to it is exact (bf16 + fp16 -> fp32)."""
    return functools.reduce(torch.promote_types, (k.dtype for k in keys))


class Sources(NamedTuple):
    """The S sources as kernel arguments, padded to ``bucket(S)`` (the tensors keep any copy
    made by ``rows`` alive for as long as the launch holds them).

    values: ``[T, d]`` each, unit column stride; keys: ``[T, r]`` each in one dtype, or None for
    sliced keys (the last r columns of each value); strides in elements.
    """

    values: tuple
    value_strides: tuple
    keys: tuple | None
    key_strides: tuple | None
    value_align: int  # divides d and every value row stride
    key_align: int  # divides r and every key row stride (sliced: the values' strides and d)


def sources(values, keys, rank: int) -> Sources:
    """``Sources`` of S values ``[..., d]`` and keys ``[..., r]`` (None: sliced keys)."""
    v2 = [rows(v) for v in values]
    n, d = bucket(len(v2)), v2[0].shape[-1]
    vs = [v.stride(0) for v in v2]
    v_align = alignment(v2[0].dtype, d, *vs)
    if keys is None:
        k_align = alignment(v2[0].dtype, rank, d, *vs)
        return Sources(padded(v2, n), padded(vs, n), None, None, v_align, k_align)
    dtype = key_dtype(keys)
    k2 = [rows(k).to(dtype) for k in keys]
    ks = [k.stride(0) for k in k2]
    k_align = alignment(dtype, rank, *ks)
    return Sources(padded(v2, n), padded(vs, n), padded(k2, n), padded(ks, n), v_align, k_align)


def pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def _floor2(n: int) -> int:
    return 1 << (max(int(n), 1).bit_length() - 1)


def blocks(
    n_queries: int,
    d: int,
    rank: int,
    budget: int | None = None,
    gpu: bool | None = None,
    beside_acc: bool = False,
):
    """``(BLOCK_C, BLOCK_T, BLOCK_D, BLOCK_R, num_warps)`` for a token-block program.

    The fp32 accumulator is ``[BLOCK_C, BLOCK_T, BLOCK_D]``; ``budget`` caps its element count
    (registers on GPU; under the interpreter cost is per program, so tiles are large, but
    BLOCK_D stays small enough that tests exercise the loop over d tiles). ``gpu`` picks the
    GPU (True) or interpreter (False) branch; None follows ``TRITON_INTERPRET``. ``beside_acc``:
    the key step's ``[BLOCK_C, BLOCK_T, BLOCK_R]`` product is live beside other tiles (the
    forward's accumulator; in the backward, dh's key columns and the dq partial), so on GPU it
    gets half the budget.
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
    # ptxas -v, forward, bf16 d = r = 1024, c = 1: BLOCK_R 1024 -> 80 regs + 8 B spill, 512 -> 64;
    # backward, bf16 d = r = 64, c = 1 (64 tokens): BLOCK_R 64 -> 128 regs + 8 B spill, 32 -> 105.
    key_budget = 2048 if beside_acc else 4096
    br = min(pow2(rank), _floor2(max(16, key_budget // (bc * bt))))
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
def pick(TUP, s):
    """``TUP[s]`` for a runtime ``s`` (a tuple takes only constant indices): a select chain over
    the whole tuple. Triton's alignment analysis gives a select the least divisibility of its
    operands, so every element's launch-time 16-byte specialisation survives the pick."""
    x = TUP[0]
    for i in tl.static_range(1, len(TUP)):
        x = tl.where(s == i, TUP[i], x)
    return x


@triton.jit
def aligned(x, A: tl.constexpr):
    """``x`` (a multiple of ``A``, checked by the launcher) in a form whose divisibility Triton's
    analysis can prove. Ints are specialised only for divisibility by 16, and ``tl.multiple_of``
    on a scalar was dropped (measured: d = 1000 bf16 stayed scalar), so ``x // A * A``."""
    return x // A * A


@triton.jit
def source(
    VALS,
    V_STRIDES,
    KEYS,
    K_STRIDES,
    s,
    D,
    R,
    SLICED: tl.constexpr,
    V_ALIGN: tl.constexpr,
    K_ALIGN: tl.constexpr,
):
    """Source ``s`` of ``Sources``: (value ptr, value row stride, key ptr, key row stride).

    ``D`` and ``R`` must already be ``aligned`` (the sliced key starts at column ``D - R``)."""
    v_ptr = pick(VALS, s)
    v_stride = aligned(pick(V_STRIDES, s), V_ALIGN)
    if SLICED:
        k_ptr = v_ptr + (D - R)
        k_stride = v_stride
    else:
        k_ptr = pick(KEYS, s)
        k_stride = aligned(pick(K_STRIDES, s), K_ALIGN)
    return v_ptr, v_stride, k_ptr, k_stride


# The RMSNorms' overflow policy (keys, and h in the merge; ``reference.key_rmsnorm``): besides
# Σx², the kernels sum the squares of x·DOWN, exact in fp32's normal range. A row whose plain
# sum reaches HUGE_SUMSQ (entries from ~2^57; bf16 and fp32 reach 2^128, whose square
# overflows) takes the scaled sum, without eps (< 2^-90 of its mean square): same norm.
DOWN = tl.constexpr(NORM_DOWN)  # (2^128·2^-72)² · 4096 columns < 2^127
UP = tl.constexpr(1.0 / NORM_DOWN)
HUGE_SUMSQ = tl.constexpr(NORM_HUGE_SUMSQ)


@triton.jit
def norm_scales(sumsq, sumsq_down, n, eps):
    """``(inv, down)`` of rows with ``sumsq = Σx²`` and ``sumsq_down = Σ(x·DOWN)²`` over n
    columns: ``RMSNorm(x) = (x·down)·inv``, ``rstd = down·inv``; down is 1 or DOWN."""
    big = sumsq >= HUGE_SUMSQ  # inf included; NaN is not, and stays NaN
    # sumsq_down >= 2^-24 where it is used; the floor only keeps the unused branch finite
    inv = tl.where(big, tl.rsqrt(tl.maximum(sumsq_down / n, 1e-30)), tl.rsqrt(sumsq / n + eps))
    return inv, tl.where(big, DOWN, 1.0)


@triton.jit
def key_sums(k, sumsq, sumsq_down):
    """One r tile ``k [BLOCK_T, BLOCK_R]`` of key rows added to their sums (see ``norm_scales``):
    returns ``(k·DOWN, sumsq + Σk², sumsq_down + Σ(k·DOWN)²)``; a logit is taken on k·DOWN."""
    kd = k * DOWN
    return kd, sumsq + tl.sum(k * k, axis=1), sumsq_down + tl.sum(kd * kd, axis=1)


@triton.jit
def logit_scales(sumsq, sumsq_down, n, eps):
    """``(scale, rstd)`` of key rows from their ``key_sums`` over n columns: the logit is
    ``<q, k·DOWN>·scale`` (``scale = rstd·2^72 <= 2^84``: no underflow), ``rstd`` k's RMSNorm
    scale (from 2^-128 to 2^11.5, may be subnormal)."""
    inv, down = norm_scales(sumsq, sumsq_down, n, eps)
    return inv * (down * UP), inv * down


@triton.jit
def key_grad(dlq, k, rstd, g):
    """``(dk, k̄)`` of one key tile ``k [BLOCK_T, BLOCK_R]`` through its RMSNorm and the logits
    ``ℓ_c = <q_c, k̄>``: ``dk = rstd·Σ_c dℓ_c q_c - k̄·g``, with ``dlq = Σ_c dℓ_c q_c`` (the tile's
    columns) and ``g = Σ_c dℓ_c ℓ_c · rstd / r`` per row; query c's gradient is ``Σ_t dℓ_c k̄``."""
    kbar = k * rstd[:, None]
    # k̄·g, not k·(rstd·g): rstd² underflows for |k| from ~2^63
    return rstd[:, None] * dlq - kbar * g[:, None], kbar


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
    RMSNorm ``rstd = rsqrt(mean(k²) + eps)``, one loop over r tiles, all fp32.

    Any finite key: the squares are summed as in ``norm_scales`` and the dot products taken on
    k·DOWN (exact, or below fp32's normal range an absolute error < 2^-60 in a logit), so no
    |k| up to 2^128 overflows (``key_sums``, ``logit_scales``)."""
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    sumsq_down = tl.zeros([BLOCK_T], tl.float32)
    dot = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)  # of k·DOWN
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        k = load_tile(k_ptr, offs_t, k_stride, offs_r, mask_t, mask_r)
        q = load_tile(Q, offs_c, R, offs_r, mask_c, mask_r)
        kd, sumsq, sumsq_down = key_sums(k, sumsq, sumsq_down)
        dot += tl.sum(q[:, None, :] * kd[None, :, :], axis=2)
    scale, rstd = logit_scales(sumsq, sumsq_down, R, eps)
    return dot * scale[None, :], rstd
