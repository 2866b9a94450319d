"""Peers side by side: each peer's fused depth read, timed in the same run as ours, with its
agreement with our reference measured on the same inputs.

One read site: S sources ``[T, d]`` (bf16), one query. Every peer computes
``h = sum_s softmax_s(<q, RMSNorm(k_s)>) v_s`` with parameter-free (unit-gain) RMSNorm keys; they
differ in which keys and layouts they take. Ours for each is ``custom_ops.depth_read(values, None,
q)``, i.e. ``lrattnres::depth_read_sliced``: keys = the last r dims of each value, read in place.

- fla-core 0.6.0: ``fla.ops.attnres.fused_attnres(q [d], residuals, rms_weight [d], rms_eps,
  scale=1)``; keys RMSNorm(v)·w (standard AttnRes, r = d); a list of ``[..., d]`` (any float
  dtype; sources as a padded tuple of kernel arguments). Ours: ``depth_read_sliced`` with r = d,
  w = 1. Also timed with its opt-in Gluon backend (``FLA_ATTNRES_GLUON=1``, SM80+).
- liger-kernel 0.8.5: ``liger_kernel.ops.attn_res.LigerAttnResFunction.apply(V [S, ..., d],
  w_query [d], w_norm [d], eps)``; keys RMSNorm(v)·w; ONE stacked tensor (a list is stacked
  first: a copy; timed here on a prepared stack). Ours: ``depth_read_sliced``, r = d.
- flash-attn-res 0.1.12: ``flash_attn_res.ops.phase_1.phase_1_batched_attention_triton_op(V [S,
  B, T, d], Q [c, d], eps)`` -> (out [c, B, T, d] bf16, lse [c, B, T]); keys RMSNorm(v); stacked,
  bf16, d a power of two. Ours: ``block_read_sliced`` with r = d (here c = 1, so
  ``depth_read_sliced``); its phase 2 (``phase_2_online_softmax_merge_triton_op``) is our
  ``merge_partial`` with sliced keys, r = d.
- fast-attnres 2.1.0: ``attnres.attnres(values, q [r] bf16, eps=2**-23)``; keys RMSNorm(last r
  dims of v) (S-LR, any r <= d; r = d is standard AttnRes); a list or ``[S, ..., d]``; bf16
  only. Ours: ``depth_read_sliced``, same r and eps; its ``attnres_multi`` (bank of <= 16
  queries, bf16 out, no lse) is our ``block_read_sliced``.

No peer takes separate (projected) keys: our ``depth_read`` with keys has no counterpart.
Gradients compared: the output, every value's and the query's (fla/liger also return the RMSNorm
weight's, which has no counterpart). Eps is ours (``finfo(fp32).eps``) everywhere; the query is
drawn fp32 with bf16-exact values so a bf16-only peer sees the same query.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import time

import torch

import custom_ops
from benchmarks.ops import TOL, timeit
from custom_ops import reference

EPS = reference.DEFAULT_EPS
# In the order they run: cheapest first (liger compiles 2 kernels, flash-attn-res autotunes ~20
# configs, fla-core 58, fast-attnres ~106 per rank, fla's opt-in Gluon backend last).
DISTS = {"liger": "liger-kernel", "flash_attn_res": "flash-attn-res", "fla": "fla-core",
         "fast_attnres": "fast-attnres", "fla_gluon": "fla-core"}  # fmt: skip


def _fla(gluon: bool):
    mod = importlib.import_module("fla.ops.attnres")
    if gluon:
        importlib.import_module("fla.ops.attnres.backends.gluon")  # ImportError = unavailable

    def build(vals, q):
        w = torch.ones(q.shape[0], device=q.device)

        def call():
            old = os.environ.get("FLA_ATTNRES_GLUON")
            os.environ["FLA_ATTNRES_GLUON"] = "1" if gluon else "0"  # read per call by FLA
            try:
                return mod.fused_attnres(q, vals, w, rms_eps=EPS)
            finally:
                if old is None:
                    del os.environ["FLA_ATTNRES_GLUON"]
                else:
                    os.environ["FLA_ATTNRES_GLUON"] = old

        return [*vals, q], call, lambda g: (g[:-1], g[-1])

    return build


def _liger():
    mod = importlib.import_module("liger_kernel.ops.attn_res")

    def build(vals, q):
        stacked = torch.stack([v.detach() for v in vals]).requires_grad_(True)  # its layout
        w = torch.ones(q.shape[0], device=q.device)  # fp32: bf16 would round the keys
        return ([stacked, q], lambda: mod.LigerAttnResFunction.apply(stacked, q, w, EPS),
                lambda g: (list(g[0].unbind(0)), g[1]))  # fmt: skip

    return build


def _flash_attn_res():
    mod = importlib.import_module("flash_attn_res.ops.phase_1")

    def build(vals, q):
        stacked = torch.stack([v.detach() for v in vals]).unsqueeze(1).requires_grad_(True)
        bank = q.detach()[None].clone().requires_grad_(True)  # [c=1, d]
        fn = mod.phase_1_batched_attention_triton_op
        return ([stacked, bank], lambda: fn(stacked, bank, EPS)[0][0, 0],
                lambda g: (list(g[0][:, 0].unbind(0)), g[1][0]))  # fmt: skip

    return build


def _fast_attnres():
    mod = importlib.import_module("attnres")

    def build(vals, q):
        qb = q.detach().to(torch.bfloat16).requires_grad_(True)  # bf16-exact: same query
        return [*vals, qb], lambda: mod.attnres(vals, qb, eps=EPS), lambda g: (g[:-1], g[-1])

    return build


def _ours():
    def build(vals, q):
        return ([*vals, q], lambda: custom_ops.depth_read(vals, None, q, backend="auto"),
                lambda g: (g[:-1], g[-1]))  # fmt: skip

    return build


LOADERS = {"ours": _ours, "liger": _liger, "flash_attn_res": _flash_attn_res,
           "fla": lambda: _fla(False), "fast_attnres": _fast_attnres,
           "fla_gluon": lambda: _fla(True)}  # fmt: skip


def supports(name: str, d: int, r: int, dtype) -> str | None:
    """Why ``name`` cannot run this case, or None."""
    if name in ("fla", "fla_gluon", "liger", "flash_attn_res") and r != d:
        return "standard AttnRes only (keys = the whole value, r = d)"
    if name in ("flash_attn_res", "fast_attnres") and dtype != torch.bfloat16:
        return "bf16 only"
    if name == "flash_attn_res" and d & (d - 1):
        return "d must be a power of two"
    return None


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _reference(vals, q, r, grad):
    vf = [v.detach().float().requires_grad_(True) for v in vals]
    qf = q.detach().float().requires_grad_(True)
    out = reference.depth_read(vf, reference.sliced_keys(vf, r), qf)
    grads = torch.autograd.grad(out, [*vf, qf], grad.float())
    return out.detach(), list(grads[:-1]), grads[-1]


def _agreement(build, vals, q, grad, ref) -> dict:
    inputs, call, unpack = build(vals, q)
    out = call()
    d_vals, d_q = unpack(torch.autograd.grad(out, inputs, grad))
    errs = {"out": _rel(out, ref[0]),
            "d_values": max(_rel(a, b) for a, b in zip(d_vals, ref[1], strict=True)),
            "d_query": _rel(d_q.reshape(-1), ref[2])}  # fmt: skip
    return errs


def _times(build, vals, q, grad, device, repeat) -> tuple[float, float]:
    inputs, call, _ = build(vals, q)

    def fwd():
        with torch.no_grad():
            call()

    def fwd_bwd():
        torch.autograd.grad(call(), inputs, grad)

    # warm-up 3: the first call compiles (and autotunes: minutes for some peers, see gpu_check)
    return timeit(fwd, device, repeat, warmup=3), timeit(fwd_bwd, device, repeat, warmup=3)


def run(res: dict, device, dry: bool, deadline: float, repeat: int = 20) -> None:
    """Fill ``res`` row by row (a timeout keeps the rows done). ``deadline``: perf_counter time
    after which no new row starts."""
    shapes = [(64, 64, 3)] if dry else [(16384, 1024, 9), (16384, 4096, 9), (16384, 1024, 17)]
    # the S-LR rank of the paper first (r = 64: ours and fast-attnres), then r = d (standard
    # AttnRes: every peer)
    ranks = {d: ([16, d] if dry else [64, d]) for _, d, _ in shapes}
    dtype = torch.bfloat16
    res["shapes"] = [dict(tokens=t, d=d, S=s, dtype="bfloat16") for t, d, s in shapes]
    res["versions"], builders = {}, {"ours": _ours()}
    if device.type != "cuda":
        res["note"] = "peers skipped (their kernels need CUDA tensors); ours timed alone"
    for name, dist in DISTS.items():
        if device.type != "cuda":
            res["versions"][name] = "skipped: the peers' kernels need CUDA tensors (CPU run)"
            continue
        try:
            res["versions"][name] = importlib.metadata.version(dist)
            builders[name] = LOADERS[name]()
        except Exception as e:  # noqa: BLE001 (a missing or broken peer is reported, not fatal)
            res["versions"][name] = f"unavailable: {type(e).__name__}: {e}"[:500]
    rows = res["rows"] = []
    gen = torch.Generator(device=device).manual_seed(0)
    for tokens, d, s in shapes:
        vals = [torch.randn(tokens, d, generator=gen, device=device).to(dtype).requires_grad_(True)
                for _ in range(s)]  # fmt: skip
        grad = torch.randn(tokens, d, generator=gen, device=device).to(dtype)
        for r in ranks[d]:
            q = torch.randn(r, generator=gen, device=device).to(dtype).float().requires_grad_(True)
            ref = _reference(vals, q, r, grad)
            ours = None
            for name, build in builders.items():
                row = dict(tokens=tokens, d=d, S=s, r=r, impl=name)
                why = supports(name, d, r, dtype)
                if why or time.perf_counter() > deadline:
                    row["skipped"] = why or "time budget of the section spent"
                    rows.append(row)
                    continue
                try:
                    row["rel_err"] = _agreement(build, vals, q, grad, ref)
                    worst = max(row["rel_err"].values())
                    row["agrees"] = worst <= TOL[dtype]
                    if not row["agrees"]:  # as ops.py: an op that disagrees is not timed
                        row["skipped"] = f"disagrees with the reference: rel err {worst:.3g}"
                    else:
                        tf, tfb = _times(build, vals, q, grad, device, repeat)
                        row.update(fwd_ms=tf * 1e3, fwd_bwd_ms=tfb * 1e3)
                except Exception as e:  # noqa: BLE001 (one peer's failure hides nothing else)
                    row["error"] = f"{type(e).__name__}: {e}"[:1000]
                if name == "ours":
                    ours = row
                elif ours and "fwd_ms" in ours and "fwd_ms" in row:
                    row["ours_over_theirs_fwd"] = ours["fwd_ms"] / row["fwd_ms"]
                    row["ours_over_theirs_fwd_bwd"] = ours["fwd_bwd_ms"] / row["fwd_bwd_ms"]
                rows.append(row)
        del vals, grad
        if device.type == "cuda":
            torch.cuda.empty_cache()
    ratios = [r for r in rows if "ours_over_theirs_fwd" in r]
    res["ours_faster_everywhere"] = bool(ratios) and all(
        r["ours_over_theirs_fwd"] < 1 and r["ours_over_theirs_fwd_bwd"] < 1 for r in ratios
    )


def table(res: dict) -> str:
    lines = [f"{'T':>6} {'d':>5} {'S':>3} {'r':>5} {'impl':<15}{'fwd ms':>9}{'f+b ms':>9}"
             f"{'ours/their fwd':>16}{'ours/their f+b':>16}{'max rel err':>13}  note"]  # fmt: skip
    for row in res.get("rows", []):
        err = max(row["rel_err"].values()) if "rel_err" in row else float("nan")
        cells = [f"{row.get(k, float('nan')):>{w}.3f}" for k, w in
                 (("fwd_ms", 9), ("fwd_bwd_ms", 9), ("ours_over_theirs_fwd", 16),
                  ("ours_over_theirs_fwd_bwd", 16))]  # fmt: skip
        note = row.get("skipped") or row.get("error") or ""
        lines.append(f"{row['tokens']:>6} {row['d']:>5} {row['S']:>3} {row['r']:>5} "
                     f"{row['impl']:<15}{''.join(cells)}{err:>13.2e}  {note[:80]}")  # fmt: skip
    return "\n".join(lines)
