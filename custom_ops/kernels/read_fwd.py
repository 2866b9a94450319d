"""Forward depth read over a query bank: one fused pass, each source read once per d tile.

For a block of BLOCK_T tokens and a tile of BLOCK_D value columns, a program walks the S sources:

    k̄_s = k_s · rsqrt(mean(k_s²) + eps)        (key loop over r tiles, fp32)
    ℓ_{c,s} = <q_c, k̄_s>                        for every query c of the bank
    online softmax: m ← max(m, ℓ), acc ← acc·e^{m_old-m} + e^{ℓ-m} v_s, z likewise

then writes ``out = acc / z`` and (d tile 0 only) ``lse = m + log z``. All arithmetic is fp32;
acc holds Σ e^{ℓ-m}·v·2^-8 (z <= S <= 256 sources of |v| up to 2^128 cannot overflow it).
When d fits one tile (d <= 4096 on GPU) each source is read from memory exactly once; the sliced
key is the value's own tail, re-read from cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.kernels import common

ACC_DOWN = tl.constexpr(2.0**-8)  # exact; keeps Σ_s e^{ℓ_s-m} v_s below fp32's max


@triton.jit
def _read_fwd_kernel(
    VALS,  # bucket-padded tuple of [T, D] values, unit column stride, one dtype
    V_STRIDES,  # tuple of the values' row strides (elements)
    KEYS,  # tuple of [T, R] keys, unit column stride, one dtype; None if SLICED
    K_STRIDES,  # tuple of the keys' row strides; None if SLICED
    Q,  # [NC, R] query bank, contiguous, any float dtype
    OUT,  # [NC, T, D] output, contiguous
    LSE,  # [NC, T] fp32 log-sum-exp, contiguous
    S,
    T,
    D,
    R,
    NC,
    eps,
    SLICED: tl.constexpr,  # the key of a source is its value's last R columns
    V_ALIGN: tl.constexpr,  # divides D and every value row stride
    K_ALIGN: tl.constexpr,  # divides R and every key row stride
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    D = common.aligned(D, V_ALIGN)
    R = common.aligned(R, K_ALIGN)
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    offs_t = (pid_t * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_c = tl.arange(0, BLOCK_C)
    mask_t, mask_d, mask_c = offs_t < T, offs_d < D, offs_c < NC

    m = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    z = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    acc = tl.zeros([BLOCK_C, BLOCK_T, BLOCK_D], tl.float32)
    for s in range(S):
        v_ptr, v_stride, k_ptr, k_stride = common.source(
            VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
        )
        logit, _ = common.bank_logits(
            k_ptr, k_stride, Q, offs_t, mask_t, offs_c, mask_c, R, eps, BLOCK_C, BLOCK_T, BLOCK_R
        )
        m_new = tl.maximum(m, logit)
        scale = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        v = common.load_tile(v_ptr, offs_t, v_stride, offs_d, mask_t, mask_d)
        acc = acc * scale[:, :, None] + (p * ACC_DOWN)[:, :, None] * v[None, :, :]
        z = z * scale + p
        m = m_new

    out = acc / (z * ACC_DOWN)[:, :, None]
    ct = offs_c[:, None] * T + offs_t[None, :]
    mask_ct = mask_c[:, None] & mask_t[None, :]
    tl.store(
        OUT + ct[:, :, None] * D + offs_d[None, None, :],
        out.to(OUT.dtype.element_ty),
        mask=mask_ct[:, :, None] & mask_d[None, None, :],
    )
    if pid_d == 0:
        tl.store(LSE + ct, m + tl.log(z), mask=mask_ct)


def read_fwd(values, keys, queries, eps: float, out_dtype=None, block_budget=None):
    """Triton forward of ``composite.read_fwd``.

    values: S tensors ``[..., d]``; keys: S tensors ``[..., r]`` or None (sliced);
    queries ``[C, r]``. Returns ``(out [C, ..., d], lse [C, ...] fp32)``, out in ``out_dtype``
    (default fp32).
    """
    launch, out, lse = read_fwd_launch(values, keys, queries, eps, out_dtype, block_budget)
    launch()
    return out, lse


def read_fwd_launch(values, keys, queries, eps: float, out_dtype=None, block_budget=None, gpu=None):
    """``(common.Launch, out, lse)``: what ``read_fwd`` launches, with its (unwritten) results.
    ``gpu`` is passed to ``common.blocks``."""
    lead, d = values[0].shape[:-1], values[0].shape[-1]
    nc, rank = queries.shape
    src = common.sources(values, keys, rank)
    t = src.values[0].shape[0]
    q = queries.contiguous()
    out = torch.empty((nc, t, d), dtype=out_dtype or torch.float32, device=q.device)
    lse = torch.empty((nc, t), dtype=torch.float32, device=q.device)
    bc, bt, bd, br, warps = common.blocks(nc, d, rank, block_budget, gpu, beside_acc=True)
    launch = common.Launch(
        _read_fwd_kernel,
        (triton.cdiv(t, bt), triton.cdiv(d, bd)),
        (src.values, src.value_strides, src.keys, src.key_strides, q, out, lse,
         len(values), t, d, rank, nc, eps),
        dict(SLICED=keys is None, V_ALIGN=src.value_align, K_ALIGN=src.key_align,
             BLOCK_C=bc, BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=br),
        warps,
    )  # fmt: skip
    return launch, out.view(nc, *lead, d), lse.view(nc, *lead)
