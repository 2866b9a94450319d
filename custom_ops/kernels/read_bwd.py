"""Backward of the depth read: recomputes the routing from the saved log-sum-exp.

A program owns BLOCK_T tokens and all C queries, and makes three passes over its S sources:

    keys:    ℓ_{c,s}, rstd_s (key loop over r tiles), α = e^{ℓ-lse}, Z = Σ_s α; (α, ℓ) and rstd
             go to a small fp32 scratch. Renormalised α̂ = α / Z (Z = 1 up to rounding: with
             α / Σα the gradients are as exact as the eager softmax's).
    values:  per d tile, the output's gradient dh_c is loaded once for all sources; per source
             dα_{c,s} += <dh_c, v_s> (into the scratch) and dv_s = Σ_c α̂_c dh_c is stored (the
             columns that hold no key); then D_c = Σ_s α̂ dα.
    keys:    per r tile, per source dℓ = α̂ (dα - D + dlse),
             dk_s = rstd (Σ_c dℓ_c q_c - k_s rstd Σ_c dℓ_c ℓ_c / r)   (RMSNorm backward),
             dq_c = Σ_tokens Σ_s dℓ_c rstd k_s (the program's partial, summed after);
             a sliced key's dk is added to its value's gradient there, dv of those columns too.

Bytes per token ≈ S·d (values, once) + c·d (dh, once: fp32 or the read's dtype) + S·d (their
gradients) + 2·S·r (keys, twice) + c·r (dh's key columns again, sliced) + O(S·c) fp32 scratch:
no source is read once per query or dh once per source. The dq partials add 2·c·r fp32 per
token block (written, then summed): at c = 6, d = 1024, one token per block, bf16 and S = 9 to 5,
5-7 % of those bytes at r = 64 but 80-110 % at r = d. A persistent kernel (a program per several
token blocks, one partial for all) would save them, but its loop took 80 -> 110-116 registers
(ptxas, sm_90, c = 6, d = 1024): 3 -> 2 resident programs per SM, in a kernel whose value loads
wait on latency. Which wins at r = d is a GPU measurement.
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
def _store_grad(PTR, g, mask):
    """``g`` (fp32) stored at ``PTR`` in its dtype (each element is written by one pass only:
    value columns, then a sliced key's)."""
    tl.store(PTR, g.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _read_bwd_kernel(
    VALS,  # bucket-padded tuple of [T, D] values, unit column stride, one dtype
    V_STRIDES,  # tuple of the values' row strides (elements)
    KEYS,  # tuple of [T, R] keys, unit column stride, one dtype; None if SLICED
    K_STRIDES,  # tuple of the keys' row strides; None if SLICED
    GVALS,  # tuple of [T, D] contiguous value grads (values' dtype, or fp32), written
    GKEYS,  # tuple of [T, R] contiguous key grads (keys' dtype, or fp32), written; None if SLICED
    Q,  # [NC, R] query bank, contiguous
    LSE,  # [NC, T] fp32 saved log-sum-exp
    DOUT,  # [NC, T, D] grad of the output, contiguous, any float dtype
    DLSE,  # [NC, T] fp32 grad of the lse (not read unless HAS_DLSE)
    SCRATCH,  # [S, 3, NC, T] fp32 (α, dα, ℓ): α and ℓ written by the first pass, dα by the second
    RSTD,  # [S, T] fp32 key rstd, written by the first pass
    DQ,  # [P, NC, R] fp32 per-program partial dq (P = number of programs), written
    S,
    T,
    D,
    R,
    NC,
    eps,
    SLICED: tl.constexpr,  # key = the value's last R columns; its grad goes into the value's
    HAS_DLSE: tl.constexpr,  # the lse has a gradient
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
    z = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)

    # keys: α, ℓ, rstd
    for s in range(S):
        _, _, k_ptr, k_stride = common.source(
            VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
        )
        logit, rstd = common.bank_logits(
            k_ptr, k_stride, Q, offs_t, mask_t, offs_c, mask_c, R, eps, BLOCK_C, BLOCK_T, BLOCK_R
        )
        alpha = tl.exp(logit - lse)
        z += alpha
        base = SCRATCH + s * 3 * NC * T
        tl.store(base + ct, alpha, mask=mask_ct)
        tl.store(base + 2 * NC * T + ct, logit, mask=mask_ct)
        tl.store(RSTD + s * T + offs_t, rstd, mask=mask_t)
    inv_z = tl.where(mask_ct, 1.0 / z, 0.0)
    # the next passes read scratch written by other threads of this program
    tl.debug_barrier()

    # values: dα (every column), dv (the columns that hold no key)
    value_end = D - R if SLICED else D
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        dh = _load_bank_tile(DOUT, ct, mask_ct, offs_d, mask_d, D)
        mask_dv = mask_t[:, None] & (offs_d < value_end)[None, :]
        for s in range(S):
            v_ptr, v_stride, _, _ = common.source(
                VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
            )
            v = common.load_tile(v_ptr, offs_t, v_stride, offs_d, mask_t, mask_d)
            base = SCRATCH + s * 3 * NC * T
            # this thread's own store of the last d tile (0 before the first)
            dalpha = tl.load(base + NC * T + ct, mask=mask_ct & (d0 > 0), other=0.0)
            tl.store(base + NC * T + ct, dalpha + tl.sum(dh * v[None, :, :], axis=2), mask=mask_ct)
            if d0 < value_end:
                alpha = tl.load(base + ct, mask=mask_ct, other=0.0) * inv_z
                gv_ptr = common.pick(GVALS, s) + offs_t[:, None] * D + offs_d[None, :]
                dv = tl.sum(alpha[:, :, None] * dh, axis=0)
                _store_grad(gv_ptr, dv, mask_dv)
    tl.debug_barrier()
    big_d = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for s in range(S):
        base = SCRATCH + s * 3 * NC * T
        alpha = tl.load(base + ct, mask=mask_ct, other=0.0)
        big_d += alpha * tl.load(base + NC * T + ct, mask=mask_ct, other=0.0)
    big_d = big_d * inv_z
    if HAS_DLSE:
        dlse = tl.load(DLSE + ct, mask=mask_ct, other=0.0)

    # keys: dℓ, dk (+ a sliced key's dv), dq
    dq_base = DQ + pid * NC * R
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < R
        mask_tr = mask_t[:, None] & mask_r[None, :]
        if SLICED:  # the value columns this key tile is
            dh = _load_bank_tile(DOUT, ct, mask_ct, (D - R) + offs_r, mask_r, D)
        dq = tl.zeros([BLOCK_C, BLOCK_R], tl.float32)
        for s in range(S):
            _, _, k_ptr, k_stride = common.source(
                VALS, V_STRIDES, KEYS, K_STRIDES, s, D, R, SLICED, V_ALIGN, K_ALIGN
            )
            base = SCRATCH + s * 3 * NC * T
            alpha = tl.load(base + ct, mask=mask_ct, other=0.0) * inv_z
            dalpha = tl.load(base + NC * T + ct, mask=mask_ct, other=0.0)
            logit = tl.load(base + 2 * NC * T + ct, mask=mask_ct, other=0.0)
            rstd = tl.load(RSTD + s * T + offs_t, mask=mask_t, other=0.0)
            dl = dalpha - big_d
            if HAS_DLSE:
                dl += dlse
            dlogit = alpha * dl
            # Σ_c dℓ_c ℓ_c · rstd / r: the k-proportional term of the RMSNorm backward
            g = tl.sum(dlogit * logit, axis=0) * rstd / R
            k = common.load_tile(k_ptr, offs_t, k_stride, offs_r, mask_t, mask_r)
            q = common.load_tile(Q, offs_c, R, offs_r, mask_c, mask_r)  # from cache
            dlq = tl.sum(dlogit[:, :, None] * q[:, None, :], axis=0)
            dk, kbar = common.key_grad(dlq, k, rstd, g)
            dq += tl.sum(dlogit[:, :, None] * kbar[None, :, :], axis=1)
            if SLICED:
                gv_ptr = common.pick(GVALS, s) + offs_t[:, None] * D + ((D - R) + offs_r)[None, :]
                dv = tl.sum(alpha[:, :, None] * dh, axis=0) + dk
                _store_grad(gv_ptr, dv, mask_tr)
            else:
                gk_ptr = common.pick(GKEYS, s) + offs_t[:, None] * R + offs_r[None, :]
                _store_grad(gk_ptr, dk, mask_tr)
        tl.store(
            dq_base + offs_c[:, None] * R + offs_r[None, :],
            dq,
            mask=mask_c[:, None] & mask_r[None, :],
        )


def read_bwd(values, keys, queries, lse, grad_out, grad_lse, eps: float, block_budget=None):
    """Triton backward of ``composite.read_bwd`` (same arguments and result layout).

    Gradients come back in the dtype of the tensor they belong to (values, keys), dq in fp32.
    """
    launch, grad_values, grad_keys, dq = read_bwd_launch(
        values, keys, queries, lse, grad_out, grad_lse, eps, block_budget
    )
    launch()
    if grad_keys is not None:  # mixed key dtypes: read in their promoted one
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
    dout = grad_out.reshape(nc, t, d).contiguous()
    lse2 = lse.reshape(nc, t).float().contiguous()
    dlse = lse2 if grad_lse is None else grad_lse.reshape(nc, t).float().contiguous()
    gv = [torch.empty((t, d), dtype=values[0].dtype, device=dev) for _ in range(n)]
    gk = None
    if keys is not None:
        gk = [torch.empty((t, rank), dtype=src.keys[0].dtype, device=dev) for _ in range(n)]
    bc, bt, bd, br, warps = common.blocks(nc, d, rank, block_budget, gpu, beside_acc=True)
    programs = triton.cdiv(t, bt)
    scratch = torch.empty((n, 3, nc, t), dtype=torch.float32, device=dev)
    rstd = torch.empty((n, t), dtype=torch.float32, device=dev)
    dq = torch.empty((programs, nc, rank), dtype=torch.float32, device=dev)
    launch = common.Launch(
        _read_bwd_kernel,
        (programs,),
        (src.values, src.value_strides, src.keys, src.key_strides, common.padded(gv, n2),
         None if gk is None else common.padded(gk, n2), queries.contiguous(), lse2, dout, dlse,
         scratch, rstd, dq, n, t, d, rank, nc, eps),
        dict(SLICED=keys is None, HAS_DLSE=grad_lse is not None, V_ALIGN=src.value_align,
             K_ALIGN=src.key_align, BLOCK_C=bc, BLOCK_T=bt, BLOCK_D=bd, BLOCK_R=br),
        warps,
    )  # fmt: skip
    grad_values = [g.view(*lead, d) for g in gv]
    grad_keys = None if gk is None else [g.view(*lead, rank) for g in gk]
    return launch, grad_values, grad_keys, dq
