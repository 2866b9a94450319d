"""Backward of the depth read: recomputes the routing from the saved log-sum-exp.

A program owns BLOCK_T tokens (all d, looping over d tiles) and walks the sources twice:

    pass 1, per source:  ℓ_{c,s}, rstd_s (key loop), α = e^{ℓ-lse}, dα_{c,s} = <dh_c, v_s>,
                         Dc += α dα, Zc += α.  (α, dα, ℓ, rstd) go to a small fp32 scratch.
    renormalise:         α ← α / Z, D ← D / Z (Z = 1 up to rounding; see pass 2)
    pass 2, per source:  dℓ = α (dα - D + dlse)
                         dv_s = Σ_c α_c dh_c                 (+ dk in the tail if sliced)
                         dk_s = rstd (Σ_c dℓ_c q_c - k_s rstd Σ_c dℓ_c ℓ_c / r)  (RMSNorm bwd)
                         dq_c += Σ_tokens dℓ_c rstd k_s     (per-program partial, summed after)

Sources are read twice in total (values once in pass 1, keys again in pass 2), no fp32 copy of
any source is stored. Bytes per token ≈ (2S+1)·d·size + 2·S·r·size + O(S) fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from custom_ops.kernels import common


@triton.jit
def _load_bank_tile(PTR, ct, mask_ct, offs_d, mask_d, D):
    """fp32 ``[BLOCK_C, BLOCK_T, BLOCK_D]`` tile of a contiguous ``[NC, T, D]`` tensor."""
    return tl.load(
        PTR + ct[:, :, None] * D + offs_d[None, None, :],
        mask=mask_ct[:, :, None] & mask_d[None, None, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _key_grad(dlogit, k, rstd, g, Q, dq_base, offs_c, mask_c, offs_r, mask_r, R):
    """``common.key_grad`` of one key tile ``k [BLOCK_T, BLOCK_R]`` (key columns ``offs_r``):
    returns dk and adds Σ_tokens dℓ_c k̄ to the program's partial dq."""
    q = common.load_tile(Q, offs_c, R, offs_r, mask_c, mask_r)
    dk, kbar = common.key_grad(tl.sum(dlogit[:, :, None] * q[:, None, :], axis=0), k, rstd, g)
    dq = tl.sum(dlogit[:, :, None] * kbar[None, :, :], axis=1)
    dq_ptrs = dq_base + offs_c[:, None] * R + offs_r[None, :]
    mask_cr = mask_c[:, None] & mask_r[None, :]
    tl.store(dq_ptrs, tl.load(dq_ptrs, mask=mask_cr, other=0.0) + dq, mask=mask_cr)
    return dk


@triton.jit
def _read_bwd_kernel(
    VALS,  # bucket-padded tuple of [T, D] values, unit column stride, one dtype
    V_STRIDES,  # tuple of the values' row strides (elements)
    KEYS,  # tuple of [T, R] keys, unit column stride, one dtype; None if SLICED
    K_STRIDES,  # tuple of the keys' row strides; None if SLICED
    GVALS,  # tuple of [T, D] contiguous value grads (values' dtype), written
    GKEYS,  # tuple of [T, R] contiguous key grads (keys' dtype), written; None if SLICED
    Q,  # [NC, R] query bank, contiguous
    LSE,  # [NC, T] fp32 saved log-sum-exp
    DOUT,  # [NC, T, D] grad of the output, contiguous, any float dtype
    DLSE,  # [NC, T] fp32 grad of the lse
    SCRATCH,  # [S, 3, NC, T] fp32 (α, dα, ℓ) written in pass 1, read in pass 2
    RSTD,  # [S, T] fp32 key rstd, written in pass 1
    DQ,  # [P, NC, R] fp32 zero-initialised per-program partial dq (P = number of programs)
    S,
    T,
    D,
    R,
    NC,
    eps,
    SLICED: tl.constexpr,  # key = the value's last R columns; its grad goes into the value's
    V_ALIGN: tl.constexpr,  # divides D and every value row stride
    K_ALIGN: tl.constexpr,  # divides R and every key row stride
    BLOCK_C: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    D = common.aligned(D, V_ALIGN)
    R = common.aligned(R, K_ALIGN)
    pid = tl.program_id(0)
    offs_t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_c = tl.arange(0, BLOCK_C)
    mask_t, mask_c = offs_t < T, offs_c < NC
    ct = offs_c[:, None] * T + offs_t[None, :]
    mask_ct = mask_c[:, None] & mask_t[None, :]
    lse = tl.load(LSE + ct, mask=mask_ct, other=0.0)
    big_d = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    z = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)

    for s in range(S):
        v_ptr, v_stride, k_ptr, k_stride = common.source(
            VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
        )
        logit, rstd = common.bank_logits(
            k_ptr, k_stride, Q, offs_t, mask_t, offs_c, mask_c, R, eps, BLOCK_C, BLOCK_T, BLOCK_R
        )
        alpha = tl.exp(logit - lse)
        dalpha = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            v = common.load_tile(v_ptr, offs_t, v_stride, offs_d, mask_t, mask_d)
            dh = _load_bank_tile(DOUT, ct, mask_ct, offs_d, mask_d, D)
            dalpha += tl.sum(dh * v[None, :, :], axis=2)
        big_d += alpha * dalpha
        z += alpha
        base = SCRATCH + s * 3 * NC * T
        tl.store(base + ct, alpha, mask=mask_ct)
        tl.store(base + NC * T + ct, dalpha, mask=mask_ct)
        tl.store(base + 2 * NC * T + ct, logit, mask=mask_ct)
        tl.store(RSTD + s * T + offs_t, rstd, mask=mask_t)

    # pass 2 reads scratch written by other threads of this program
    tl.debug_barrier()
    # Renormalise: e^{ℓ-lse} sums to 1 only up to rounding, and in dα - D that error is
    # amplified for a dominant source; with α/Σα the result is as exact as the eager softmax.
    inv_z = tl.where(mask_ct, 1.0 / z, 0.0)
    big_d = big_d * inv_z
    dlse = tl.load(DLSE + ct, mask=mask_ct, other=0.0)
    dq_base = DQ + pid * NC * R
    for s in range(S):
        base = SCRATCH + s * 3 * NC * T
        alpha = tl.load(base + ct, mask=mask_ct, other=0.0) * inv_z
        dalpha = tl.load(base + NC * T + ct, mask=mask_ct, other=0.0)
        logit = tl.load(base + 2 * NC * T + ct, mask=mask_ct, other=0.0)
        rstd = tl.load(RSTD + s * T + offs_t, mask=mask_t, other=0.0)
        dlogit = alpha * (dalpha - big_d + dlse)
        # Σ_c dℓ_c ℓ_c · rstd / r: the k-proportional term of the RMSNorm backward
        g = tl.sum(dlogit * logit, axis=0) * rstd / R
        gv_ptr = common.pick(GVALS, s)
        v_ptr, v_stride, k_ptr, k_stride = common.source(
            VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
        )
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            mask_td = mask_t[:, None] & mask_d[None, :]
            dh = _load_bank_tile(DOUT, ct, mask_ct, offs_d, mask_d, D)
            dv = tl.sum(alpha[:, :, None] * dh, axis=0)
            if SLICED:
                offs_j = offs_d - (D - R)
                mask_j = mask_d & (offs_j >= 0)
                k = common.load_tile(v_ptr, offs_t, v_stride, offs_d, mask_t, mask_j)
                dk = _key_grad(dlogit, k, rstd, g, Q, dq_base, offs_c, mask_c, offs_j, mask_j, R)
                dv += tl.where(mask_j[None, :], dk, 0.0)
            tl.store(
                gv_ptr + offs_t[:, None] * D + offs_d[None, :],
                dv.to(gv_ptr.dtype.element_ty),
                mask=mask_td,
            )
        if not SLICED:
            gk_ptr = common.pick(GKEYS, s)
            for r0 in range(0, R, BLOCK_R):
                offs_r = r0 + tl.arange(0, BLOCK_R)
                mask_r = offs_r < R
                mask_tr = mask_t[:, None] & mask_r[None, :]
                k = common.load_tile(k_ptr, offs_t, k_stride, offs_r, mask_t, mask_r)
                dk = _key_grad(dlogit, k, rstd, g, Q, dq_base, offs_c, mask_c, offs_r, mask_r, R)
                tl.store(
                    gk_ptr + offs_t[:, None] * R + offs_r[None, :],
                    dk.to(gk_ptr.dtype.element_ty),
                    mask=mask_tr,
                )


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float, block_budget=None):
    """Triton backward of ``composite.read_bwd`` (same arguments and result layout).

    Gradients come back in the dtype of the tensor they belong to (values, keys), dq in fp32.
    """
    launch, grad_values, grad_keys, dq = read_bwd_launch(
        values, keys, queries, lse, grad_out, grad_lse, eps, block_budget
    )
    launch()
    if grad_keys is not None:  # mixed key dtypes were read in their promoted dtype
        grad_keys = [g.to(k.dtype) for g, k in zip(grad_keys, keys, strict=True)]
    return grad_values, grad_keys, dq.sum(0)


def read_bwd_launch(
    values, keys, queries, lse, grad_out, grad_lse, eps: float, block_budget=None, gpu=None
):
    """``(common.Launch, grad_values, grad_keys, dq partials [P, C, r])``: what ``read_bwd``
    launches, with its (unwritten) results; grad_keys are in ``common.key_dtype(keys)``.
    ``gpu`` is passed to ``common.blocks``."""
    lead, d = values[0].shape[:-1], values[0].shape[-1]
    nc, rank = queries.shape
    dev = queries.device
    src = common.sources(values, keys, rank)
    t, n, n2 = src.values[0].shape[0], len(values), len(src.values)
    if grad_out is None:
        grad_out = torch.zeros((nc, t, d), dtype=torch.float32, device=dev)
    if grad_lse is None:
        grad_lse = torch.zeros((nc, t), dtype=torch.float32, device=dev)
    dout = grad_out.reshape(nc, t, d).contiguous()
    dlse = grad_lse.reshape(nc, t).float().contiguous()
    lse2 = lse.reshape(nc, t).float().contiguous()
    gv = [torch.empty((t, d), dtype=values[0].dtype, device=dev) for _ in range(n)]
    gk = None
    if keys is not None:
        gk = [torch.empty((t, rank), dtype=src.keys[0].dtype, device=dev) for _ in range(n)]
    bc, bt, bd, br, warps = common.blocks(nc, d, rank, block_budget, gpu)
    programs = triton.cdiv(t, bt)
    scratch = torch.empty((n, 3, nc, t), dtype=torch.float32, device=dev)
    rstd = torch.empty((n, t), dtype=torch.float32, device=dev)
    dq = torch.zeros((programs, nc, rank), dtype=torch.float32, device=dev)
    launch = common.Launch(
        _read_bwd_kernel,
        (programs,),
        (src.values, src.value_strides, src.keys, src.key_strides, common.padded(gv, n2),
         None if gk is None else common.padded(gk, n2), queries.contiguous(), lse2, dout, dlse,
         scratch, rstd, dq, n, t, d, rank, nc, eps),
        dict(SLICED=keys is None, V_ALIGN=src.value_align, K_ALIGN=src.key_align,
             BLOCK_C=bc, BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=br),
        warps,
    )  # fmt: skip
    grad_values = [g.view(*lead, d) for g in gv]
    grad_keys = None if gk is None else [g.view(*lead, rank) for g in gk]
    return launch, grad_values, grad_keys, dq
