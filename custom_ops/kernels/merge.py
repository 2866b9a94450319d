"""Phase-2 merge (docs/method.md §7) of a phase-1 read with the live partial source; backward.

Per token: ``ℓ = <q, RMSNorm(k_p)>``, ``w1 = σ(lse1 - ℓ)``, ``w2 = σ(ℓ - lse1)`` (the online-softmax
rule with ``lse1 = log Z1``), ``h = w1·out1 + w2·v_p`` rounded to v_p's dtype, and optionally the
parameter-free ``RMSNorm(h)`` of the rounded h (fixed eps = finfo(fp32).eps, see api.merge_partial).
A program owns BLOCK_T tokens and loops over d tiles; with the norm, h is re-read from cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.kernels import common
from custom_ops.reference import DEFAULT_EPS


@triton.jit
def _partial_logit(
    PK, pk_stride, Q, offs_t, mask_t, R, eps, BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr
):
    """``(ℓ, rstd)`` of the partial key: ``common.bank_logits`` for one query (a ``[BLOCK_T]``
    dot product, no query-bank axis)."""
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    sumsq_down = tl.zeros([BLOCK_T], tl.float32)
    dot = tl.zeros([BLOCK_T], tl.float32)  # of k·DOWN
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        k = common.load_tile(PK, offs_t, pk_stride, offs_r, mask_t, mask_r)
        q = tl.load(Q + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        kd, sumsq, sumsq_down = common.key_sums(k, sumsq, sumsq_down)
        dot += tl.sum(kd * q[None, :], axis=1)
    scale, rstd = common.logit_scales(sumsq, sumsq_down, R, eps)
    return dot * scale, rstd


@triton.jit
def _merge_weights(LSE1, offs_t, mask_t, logit):
    """``(w1, w2)``: the two-way softmax of ``(lse1, ℓ)``."""
    lse1 = tl.load(LSE1 + offs_t, mask=mask_t, other=0.0)
    m = tl.maximum(lse1, logit)
    w1, w2 = tl.exp(lse1 - m), tl.exp(logit - m)
    return w1 / (w1 + w2), w2 / (w1 + w2)


@triton.jit
def _grad_h(DH, H, DN, offs_t, mask_t, offs_d, mask_d, D, inv, down, my, HAS_NORM: tl.constexpr):
    """fp32 tile of the total grad of h: ``dh`` (+ the RMSNorm backward
    ``rstd·(gy - y·mean(gy·y))`` with ``y = (h·down)·inv``, ``rstd = down·inv``,
    ``my = mean(gy·y)``; see ``common.norm_scales``)."""
    dh = common.load_tile(DH, offs_t, D, offs_d, mask_t, mask_d)
    if HAS_NORM:
        h = common.load_tile(H, offs_t, D, offs_d, mask_t, mask_d)
        gy = common.load_tile(DN, offs_t, D, offs_d, mask_t, mask_d)
        y = (h * down[:, None]) * inv[:, None]
        dh += (down * inv)[:, None] * (gy - y * my[:, None])
    return dh


@triton.jit
def _key_grad(dlogit, rstd, g, k, Q, DQ, offs_r, mask_r):
    """``common.key_grad`` of one key tile ``k [BLOCK_T, BLOCK_R]`` (columns ``offs_r``); stores
    its partial dq."""
    q = tl.load(Q + offs_r, mask=mask_r, other=0.0).to(tl.float32)
    dk, kbar = common.key_grad(dlogit[:, None] * q[None, :], k, rstd, g)
    tl.store(DQ + offs_r, tl.sum(dlogit[:, None] * kbar, axis=0), mask=mask_r)
    return dk


@triton.jit
def _merge_fwd_kernel(
    OUT1,  # [T, D] phase-1 output, contiguous, any float dtype
    LSE1,  # [T] fp32 phase-1 log-sum-exp
    PV,  # [T, D] partial value, row stride pv_stride
    PK,  # [T, R] partial key, row stride pk_stride (for sliced keys: PV's tail view)
    Q,  # [R] query
    H,  # [T, D] output h in PV's dtype, contiguous
    NORM,  # [T, D] output RMSNorm(h), contiguous (unused unless EMIT_NORM)
    pv_stride,
    pk_stride,
    T,
    D,
    R,
    eps,
    norm_eps,
    EMIT_NORM: tl.constexpr,
    V_ALIGN: tl.constexpr,  # divides D and pv_stride
    K_ALIGN: tl.constexpr,  # divides R and pk_stride
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    D, pv_stride = common.aligned(D, V_ALIGN), common.aligned(pv_stride, V_ALIGN)
    R, pk_stride = common.aligned(R, K_ALIGN), common.aligned(pk_stride, K_ALIGN)
    offs_t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < T
    logit, _ = _partial_logit(PK, pk_stride, Q, offs_t, mask_t, R, eps, BLOCK_T, BLOCK_R)
    w1, w2 = _merge_weights(LSE1, offs_t, mask_t, logit)
    sumsq = tl.zeros([BLOCK_T], tl.float32)
    sumsq_down = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        o1 = common.load_tile(OUT1, offs_t, D, offs_d, mask_t, mask_d)
        v = common.load_tile(PV, offs_t, pv_stride, offs_d, mask_t, mask_d)
        h = (w1[:, None] * o1 + w2[:, None] * v).to(H.dtype.element_ty)
        mask = mask_t[:, None] & mask_d[None, :]
        tl.store(H + offs_t[:, None] * D + offs_d[None, :], h, mask=mask)
        if EMIT_NORM:
            hf = h.to(tl.float32)
            hd = hf * common.DOWN
            sumsq += tl.sum(hf * hf, axis=1)
            sumsq_down += tl.sum(hd * hd, axis=1)
    if EMIT_NORM:
        tl.debug_barrier()
        inv, down = common.norm_scales(sumsq, sumsq_down, D, norm_eps)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            h = common.load_tile(H, offs_t, D, offs_d, mask_t, mask_d)
            y = (h * down[:, None]) * inv[:, None]
            mask = mask_t[:, None] & mask_d[None, :]
            tl.store(
                NORM + offs_t[:, None] * D + offs_d[None, :], y.to(NORM.dtype.element_ty), mask=mask
            )


@triton.jit
def _merge_bwd_kernel(
    OUT1,  # [T, D] phase-1 output, contiguous
    LSE1,  # [T] fp32
    PV,  # [T, D] partial value, row stride pv_stride
    PK,  # [T, R] partial key, row stride pk_stride (PV's tail view if SLICED)
    Q,  # [R] query
    H,  # [T, D] saved output h, contiguous
    DH,  # [T, D] grad of h, contiguous
    DN,  # [T, D] grad of RMSNorm(h), contiguous (unused unless HAS_NORM)
    DOUT1,  # [T, D] out: grad of out1 (OUT1's dtype)
    DLSE1,  # [T] out: grad of lse1 (fp32)
    DPV,  # [T, D] out: grad of the partial value (+ key grad in the tail if SLICED)
    DPK,  # [T, R] out: grad of the partial key (unused if SLICED)
    DQ,  # [P, R] fp32 out: per-program partial dq, zero-initialised
    pv_stride,
    pk_stride,
    T,
    D,
    R,
    eps,
    norm_eps,
    HAS_NORM: tl.constexpr,
    SLICED: tl.constexpr,
    V_ALIGN: tl.constexpr,  # divides D and pv_stride
    K_ALIGN: tl.constexpr,  # divides R and pk_stride
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    D, pv_stride = common.aligned(D, V_ALIGN), common.aligned(pv_stride, V_ALIGN)
    R, pk_stride = common.aligned(R, K_ALIGN), common.aligned(pk_stride, K_ALIGN)
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    mask_t = offs_t < T
    logit, rstd = _partial_logit(PK, pk_stride, Q, offs_t, mask_t, R, eps, BLOCK_T, BLOCK_R)
    w1, w2 = _merge_weights(LSE1, offs_t, mask_t, logit)
    inv = tl.zeros([BLOCK_T], tl.float32)
    down = tl.zeros([BLOCK_T], tl.float32)
    my = tl.zeros([BLOCK_T], tl.float32)
    if HAS_NORM:
        sumsq = tl.zeros([BLOCK_T], tl.float32)
        sumsq_down = tl.zeros([BLOCK_T], tl.float32)
        gyh = tl.zeros([BLOCK_T], tl.float32)  # Σ gy·h
        gyh_down = tl.zeros([BLOCK_T], tl.float32)  # Σ gy·h·DOWN
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            h = common.load_tile(H, offs_t, D, offs_d, mask_t, mask_d)
            gy = common.load_tile(DN, offs_t, D, offs_d, mask_t, mask_d)
            hd = h * common.DOWN
            sumsq += tl.sum(h * h, axis=1)
            sumsq_down += tl.sum(hd * hd, axis=1)
            gyh += tl.sum(gy * h, axis=1)
            gyh_down += tl.sum(gy * hd, axis=1)
        inv, down = common.norm_scales(sumsq, sumsq_down, D, norm_eps)
        my = tl.where(down == 1.0, gyh, gyh_down) * inv / D  # mean(gy·y)
    dw1 = tl.zeros([BLOCK_T], tl.float32)
    dw2 = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        dh = _grad_h(DH, H, DN, offs_t, mask_t, offs_d, mask_d, D, inv, down, my, HAS_NORM)
        o1 = common.load_tile(OUT1, offs_t, D, offs_d, mask_t, mask_d)
        v = common.load_tile(PV, offs_t, pv_stride, offs_d, mask_t, mask_d)
        dw1 += tl.sum(dh * o1, axis=1)
        dw2 += tl.sum(dh * v, axis=1)
    # w1·(dw1 - D) with D = w1·dw1 + w2·dw2 is w1·w2·(dw1 - dw2) only if w1 + w2 == 1: for a
    # small share that difference loses every digit (a 1e-33 partial-key gradient came out 0,
    # a bf16 lse1 gradient 30x off); the product form keeps them (as the C kernel does)
    dlogit = w1 * w2 * (dw2 - dw1)
    tl.store(DLSE1 + offs_t, -dlogit, mask=mask_t)
    g = dlogit * logit * rstd / R
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        mask = mask_t[:, None] & mask_d[None, :]
        dh = _grad_h(DH, H, DN, offs_t, mask_t, offs_d, mask_d, D, inv, down, my, HAS_NORM)
        tl.store(
            DOUT1 + offs_t[:, None] * D + offs_d[None, :],
            (w1[:, None] * dh).to(DOUT1.dtype.element_ty),
            mask=mask,
        )
        dv = w2[:, None] * dh
        if SLICED:
            offs_j = offs_d - (D - R)
            mask_j = mask_d & (offs_j >= 0)
            k = common.load_tile(PV, offs_t, pv_stride, offs_d, mask_t, mask_j)
            dk = _key_grad(dlogit, rstd, g, k, Q, DQ + pid * R, offs_j, mask_j)
            dv += tl.where(mask_j[None, :], dk, 0.0)
        tl.store(
            DPV + offs_t[:, None] * D + offs_d[None, :], dv.to(DPV.dtype.element_ty), mask=mask
        )
    if not SLICED:
        for r0 in range(0, R, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            mask_r = offs_r < R
            mask = mask_t[:, None] & mask_r[None, :]
            k = common.load_tile(PK, offs_t, pk_stride, offs_r, mask_t, mask_r)
            dk = _key_grad(dlogit, rstd, g, k, Q, DQ + pid * R, offs_r, mask_r)
            tl.store(
                DPK + offs_t[:, None] * R + offs_r[None, :], dk.to(DPK.dtype.element_ty), mask=mask
            )


def _views(out1, lse1, partial_value, partial_key, rank):
    """2-D operands and ``(V_ALIGN, K_ALIGN)``; copies made here are launch arguments, so they
    live until the kernel has read them."""
    d = partial_value.shape[-1]
    pv = common.rows(partial_value)
    pk = pv[:, d - rank :] if partial_key is None else common.rows(partial_key)
    o1 = out1.reshape(-1, d).contiguous()
    aligns = (
        common.alignment(pv.dtype, d, pv.stride(0)),
        common.alignment(pk.dtype, rank, pk.stride(0)),
    )
    return o1, lse1.reshape(-1).float().contiguous(), pv, pk, aligns


def merge_fwd(out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool):
    """Triton forward of ``composite.merge_fwd`` (same arguments and results)."""
    launch, h, norm = merge_fwd_launch(
        out1, lse1, partial_value, partial_key, query, eps, emit_norm
    )
    launch()
    return h, norm


def merge_fwd_launch(
    out1, lse1, partial_value, partial_key, query, eps: float, emit_norm: bool, gpu=None
):
    """``(common.Launch, h, norm)``: what ``merge_fwd`` launches, with its (unwritten) results."""
    rank, shape, d = query.shape[-1], partial_value.shape, partial_value.shape[-1]
    o1, l1, pv, pk, (v_align, k_align) = _views(out1, lse1, partial_value, partial_key, rank)
    t = pv.shape[0]
    h = torch.empty((t, d), dtype=pv.dtype, device=pv.device)
    norm = torch.empty_like(h) if emit_norm else h.new_empty(0)
    _, bt, bd, br, warps = common.blocks(1, d, rank, gpu=gpu)
    launch = common.Launch(
        _merge_fwd_kernel,
        (triton.cdiv(t, bt),),
        (o1, l1, pv, pk, query.contiguous(), h, norm if emit_norm else h,
         pv.stride(0), pk.stride(0), t, d, rank, eps, DEFAULT_EPS),
        dict(EMIT_NORM=emit_norm, V_ALIGN=v_align, K_ALIGN=k_align,
             BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=br),
        warps,
    )  # fmt: skip
    return launch, h.view(shape), (norm.view(shape) if emit_norm else norm)


def merge_bwd(out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float):
    """Triton backward of ``composite.merge_bwd``; gradients in their tensors' dtypes (dq fp32)."""
    launch, *grads, dq = merge_bwd_launch(
        out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps
    )
    launch()
    return (*grads, dq.sum(0))


def merge_bwd_launch(
    out1, lse1, partial_value, partial_key, query, h, grad_h, grad_norm, eps: float, gpu=None
):
    """``(common.Launch, d_out1, d_lse1, d_pv, d_pk, dq partials [P, r])``: what ``merge_bwd``
    launches, with its (unwritten) results."""
    rank, d = query.shape[-1], partial_value.shape[-1]
    o1, l1, pv, pk, (v_align, k_align) = _views(out1, lse1, partial_value, partial_key, rank)
    t, dev = pv.shape[0], pv.device
    has_norm = grad_norm is not None and grad_norm.numel() > 0
    dh = torch.zeros_like(o1) if grad_h is None else grad_h.reshape(t, d).contiguous()
    dn = grad_norm.reshape(t, d).contiguous() if has_norm else dh
    d_out1 = torch.empty((t, d), dtype=out1.dtype, device=dev)
    d_lse1 = torch.empty((t,), dtype=torch.float32, device=dev)
    d_pv = torch.empty((t, d), dtype=pv.dtype, device=dev)
    d_pk = None if partial_key is None else torch.empty((t, rank), dtype=pk.dtype, device=dev)
    # Up to five [T, D] tiles live at once (dh, h, dy, out1, v): half the read's tile on the same
    # threads (blocks gives 2048-element tiles half the warps). ptxas -v, d = 1024, all dtypes,
    # r and modes: [4, 1024] x 8 warps up to 170 regs (fp32 sliced + norm: 8 B spill), [2, 1024]
    # x 4 warps 64 regs + 4-8 B spill (bf16 keys), [2, 1024] x 8 warps <= 75 regs, no spill.
    _, bt, bd, br, warps = common.blocks(1, d, rank, 2048, gpu=gpu)
    warps *= 2
    programs = triton.cdiv(t, bt)
    dq = torch.empty((programs, rank), dtype=torch.float32, device=dev)  # each column stored once
    launch = common.Launch(
        _merge_bwd_kernel,
        (programs,),
        (o1, l1, pv, pk, query.contiguous(), h.reshape(t, d).contiguous(), dh, dn,
         d_out1, d_lse1, d_pv, d_pv if d_pk is None else d_pk, dq,
         pv.stride(0), pk.stride(0), t, d, rank, eps, DEFAULT_EPS),
        dict(HAS_NORM=has_norm, SLICED=partial_key is None, V_ALIGN=v_align, K_ALIGN=k_align,
             BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=br),
        warps,
    )  # fmt: skip
    shape = partial_value.shape
    d_pk = None if d_pk is None else d_pk.view(*shape[:-1], rank)
    return launch, d_out1.view(shape), d_lse1.view(shape[:-1]), d_pv.view(shape), d_pk, dq
