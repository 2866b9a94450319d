"""Correctness sections of the GPU check: registration, forward and backward parity of every
depth-read op against ``custom_ops.reference``, and CUDA-graph capture + replay parity.

Errors are relative RMS errors (``|got - ref| / |ref|`` over the whole tensor) against the
per-dtype tolerances of ``benchmarks.ops.TOL``; the reference is the ``"reference"`` backend of the
public API, i.e. the eager ``custom_ops.reference`` maths.
"""

from __future__ import annotations

import torch

import custom_ops
from benchmarks import ops as op_bench
from custom_ops import reference

TOL = op_bench.TOL


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _backends(device) -> list[str]:
    """The GPU's own backend first: under a time cap, the compiled one (inductor compiles per
    shape, also tested on CPU) is the one left out."""
    return (["triton"] if device.type == "cuda" else []) + ["compiled"]


def _shape(dry: bool):
    """Leading dims, d, r, sources, read sites of one phase-1 read (a layer reads for 2; 3
    here, an odd count): odd sizes so masked tails are hit."""
    return ((2, 7), 40, 8, 3, 2) if dry else ((4, 300), 1000, 64, 9, 3)


def check_ops(device, dry, out: dict | None = None):
    """opcheck every op (both impls) and compare depth_read, forward + backward, and the
    two-phase read (block_read, then merge_partial), forward, with the reference on device.
    Results go into ``out`` as they come (a caller's time cap keeps what finished)."""
    out = {} if out is None else out
    out.update(opcheck={}, parity={})
    lead, d, r, s, c = _shape(dry)
    ops = torch.ops.lrattnres
    for impl in _backends(device):
        v = [torch.randn(*lead, d, device=device, requires_grad=True) for _ in range(s)]
        k = [torch.randn(*lead, r, device=device, requires_grad=True) for _ in range(s)]
        q = torch.randn(r, device=device, requires_grad=True)
        bank = torch.randn(c, r, device=device, requires_grad=True)
        o1 = torch.randn(*lead, d, device=device, requires_grad=True)
        l1 = torch.randn(*lead, device=device, requires_grad=True)
        cases = {
            "depth_read": (ops.depth_read.default, (v, k, q, 1e-6, impl)),
            "depth_read_sliced": (ops.depth_read_sliced.default, (v, q, 1e-6, impl)),
            "block_read": (ops.block_read.default, (v, k, bank, 1e-6, impl)),
            "block_read_sliced": (ops.block_read_sliced.default, (v, bank, 1e-6, impl)),
            "merge_partial": (ops.merge_partial.default, (o1, l1, v[0], None, q, 1e-6, True, impl)),
        }
        for name, (op, args) in cases.items():
            try:
                torch.library.opcheck(op, args)
                out["opcheck"][f"{name}/{impl}"] = "ok"
            except Exception as e:  # noqa: BLE001 (reported, not hidden)
                out["opcheck"][f"{name}/{impl}"] = f"FAIL: {e}"[:2000]
    tokens = lead[0] * lead[1]
    for backend in _backends(device):
        for dtype in (torch.float32, torch.bfloat16):
            for sliced in (True, False):
                v, k, q = op_bench.make_inputs(tokens, d, r, s, sliced, dtype, device)
                grad = torch.randn(tokens, d, device=device).to(dtype)
                err = op_bench.check(backend, v, k, q, grad)
                key = f"depth_read/{backend}/{str(dtype)[6:]}/{'sliced' if sliced else 'projected'}"
                out["parity"][key] = {"max_rel_err": err, "ok": err <= TOL[dtype]}
                kk = None if sliced else k
                o, lse = custom_ops.block_read(v[:-1], None if sliced else k[:-1], q[None],
                                               backend=backend)  # fmt: skip
                h = custom_ops.merge_partial(o[0], lse[0], v[-1], None if sliced else k[-1], q,
                                             backend=backend)  # fmt: skip
                ref_k = kk if kk is not None else reference.sliced_keys(v, r)
                err = _rel(h, reference.depth_read(v, ref_k, q))
                out["parity"][key.replace("depth_read", "two_phase")] = {
                    "max_rel_err": err, "ok": err <= TOL[dtype]}  # fmt: skip
    out["all_ok"] = all(x == "ok" for x in out["opcheck"].values()) and all(
        p["ok"] for p in out["parity"].values()
    )
    return out


# ----------------------------------------------------------------------------------------------
# Backward parity of block_read and merge_partial (every output and every gradient)


def _leaf(*shape, dtype, device, gen, scale=1.0):
    x = torch.randn(*shape, generator=gen, device=device) * scale
    return x.to(dtype).requires_grad_(True)


def _block_case(backend, sliced, dtype, device, dry, gen):
    """``(named inputs, fn)``: one block read of c sites over s sources."""
    lead, d, r, s, c = _shape(dry)
    vals = [_leaf(*lead, d, dtype=dtype, device=device, gen=gen) for _ in range(s)]
    keys = None if sliced else [_leaf(*lead, r, dtype=dtype, device=device, gen=gen) for _ in vals]
    bank = _leaf(c, r, dtype=torch.float32, device=device, gen=gen)
    named = {"values": vals, "keys": keys or [], "queries": [bank]}
    return (
        named,
        ("out", "lse"),
        lambda b=backend: custom_ops.block_read(vals, keys, bank, backend=b),
    )


def _merge_case(backend, sliced, dtype, device, dry, gen):
    """``(named inputs, fn)``: ``merge_partial`` (a phase-1 read merged with a partial) with
    its fused RMSNorm of the result."""
    lead, d, r, s, _ = _shape(dry)
    out1 = _leaf(*lead, d, dtype=torch.float32, device=device, gen=gen)
    # log-sum-exps of a read over s sources: around log(s), spread like logits
    lse1 = _leaf(*lead, dtype=torch.float32, device=device, gen=gen)
    with torch.no_grad():
        lse1.add_(torch.log(torch.tensor(float(s))))
    pv = _leaf(*lead, d, dtype=dtype, device=device, gen=gen)
    pk = None if sliced else _leaf(*lead, r, dtype=dtype, device=device, gen=gen)
    q = _leaf(r, dtype=torch.float32, device=device, gen=gen)
    named = {"out1": [out1], "lse1": [lse1], "partial_value": [pv],
             "partial_key": [pk] if pk is not None else [], "query": [q]}  # fmt: skip

    def fn(b=backend):
        return custom_ops.merge_partial(out1, lse1, pv, pk, q, emit_norm=True, backend=b)

    return named, ("h", "norm"), fn


def _fwd_bwd(fn, inputs, cotangents):
    outs = fn()
    grads = torch.autograd.grad(outs, inputs, cotangents)
    return [o.detach() for o in outs], list(grads)


def _errors(named, out_names, fn, backend, gen) -> dict:
    """Relative RMS error of every output and (max over each group of) every input gradient."""
    inputs = [t for group in named.values() for t in group]
    outs = fn("reference")
    cot = [torch.randn(o.shape, generator=gen, device=o.device).to(o.dtype) for o in outs]
    ref_out, ref_grads = _fwd_bwd(lambda: fn("reference"), inputs, cot)
    got_out, got_grads = _fwd_bwd(lambda: fn(backend), inputs, cot)
    errs = {n: _rel(a, b) for n, a, b in zip(out_names, got_out, ref_out, strict=True)}
    i = 0
    for name, group in named.items():
        if group:
            errs[f"d_{name}"] = max(
                _rel(got_grads[j], ref_grads[j]) for j in range(i, i + len(group))
            )
        i += len(group)
    return errs


def grad_parity(device, dry):
    """block_read and merge_partial forward + backward against the reference, every gradient
    (values, keys, queries; out1, lse1, partial value and key, query), fp32 and bf16."""
    out, ok = {}, True
    gen = torch.Generator(device=device).manual_seed(0)
    # GPU: the Triton backend (the compiled one is covered on CPU by the tests; on CUDA each of
    # its 8 cases here would be one more inductor compile, ~1 min in all)
    for backend in ["triton"] if device.type == "cuda" else ["compiled"]:
        for dtype in (torch.float32, torch.bfloat16):
            for sliced in (True, False):
                for op, make in (("block_read", _block_case), ("merge_partial", _merge_case)):
                    key = f"{op}/{backend}/{str(dtype)[6:]}/{'sliced' if sliced else 'projected'}"
                    named, out_names, fn = make(backend, sliced, dtype, device, dry, gen)
                    errs = _errors(named, out_names, fn, backend, gen)
                    worst = max(errs.values())
                    out[key] = {"rel_err": errs, "max_rel_err": worst, "ok": worst <= TOL[dtype]}
                    ok &= out[key]["ok"]
    out["all_ok"] = ok
    return out


# ----------------------------------------------------------------------------------------------
# CUDA-graph capture + replay parity


def _graph_cases(device, dtype, gen):
    """name -> (static leaf inputs, cotangents, call(inputs) -> outputs), sized like the paper
    model's reads (d=1024, 4096 tokens, 9 sources, r=64; a layer's phase 1 for its 2 sites)."""
    t, d, s, r, c = 4096, 1024, 9, 64, 2

    def leaves(shape, n, dt=dtype):
        return [_leaf(*shape, dtype=dt, device=device, gen=gen) for _ in range(n)]

    def zeros(*shape, dt=dtype):
        return torch.zeros(*shape, device=device, dtype=dt)

    q32 = torch.float32
    return {
        "depth_read/sliced": (
            [*leaves((t, d), s), *leaves((r,), 1, q32)], [zeros(t, d)],
            lambda x: (custom_ops.depth_read(x[:s], None, x[s], backend="triton"),),
        ),
        "depth_read/projected": (
            [*leaves((t, d), s), *leaves((t, r), s), *leaves((r,), 1, q32)], [zeros(t, d)],
            lambda x: (custom_ops.depth_read(x[:s], x[s:2 * s], x[-1], backend="triton"),),
        ),
        "block_read/projected": (
            [*leaves((t, d), s - 1), *leaves((t, r), s - 1), *leaves((c, r), 1, q32)],
            [zeros(c, t, d, dt=q32), zeros(c, t, dt=q32)],
            lambda x: custom_ops.block_read(x[: s - 1], x[s - 1 : -1], x[-1], backend="triton"),
        ),
        "merge_partial/projected": (
            [*leaves((t, d), 1, q32), *leaves((t,), 1, q32), *leaves((t, d), 1),
             *leaves((t, r), 1), *leaves((r,), 1, q32)],
            [zeros(t, d), zeros(t, d)],
            lambda x: custom_ops.merge_partial(*x, emit_norm=True, backend="triton"),
        ),
    }  # fmt: skip


def _step(call, inputs, cot):
    outs = call(inputs)
    return [*outs, *torch.autograd.grad(outs, inputs, cot)]


def _refill(tensors, gen):
    with torch.no_grad():
        for x in tensors:
            x.copy_(torch.randn(x.shape, generator=gen, device=x.device))


def graph_parity(device, dry):
    """Capture forward + backward of each op in one CUDA graph, change every input (and the
    cotangents) in place, replay, and compare with a fresh eager call on the new inputs. An eager
    call on other tensors runs between capture and replay, so a per-call host buffer (a pointer
    table) that it reuses would show. Replayed outputs must also differ from the captured ones."""
    if device.type != "cuda":
        return {"skipped": "CUDA graphs need a CUDA device (dry run / no GPU)"}
    out, ok = {}, True
    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        for name, (inputs, cot, call) in _graph_cases(device, dtype, gen).items():
            key = f"{name}/{str(dtype)[6:]}"
            try:
                _refill(cot, gen)
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up (kernel compile, allocator) off-capture
                    for _ in range(2):
                        _step(call, inputs, cot)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static = _step(call, inputs, cot)
                graph.replay()
                before = [x.detach().clone() for x in static]
                others = [x.detach().clone().requires_grad_(True) for x in inputs]
                _step(call, others, cot)
                del others
                _refill([*inputs, *cot], gen)
                graph.replay()
                torch.cuda.synchronize()
                fresh = _step(call, inputs, cot)
                errs = [_rel(a, b) for a, b in zip(static, fresh, strict=True)]
                moved = min(_rel(a, b) for a, b in zip(static, before, strict=True))
                good = max(errs) <= TOL[dtype] and moved > 1e-2
                out[key] = {"max_rel_err_vs_eager": max(errs), "bitwise": max(errs) == 0.0,
                            "min_change_after_refill": moved, "ok": good}  # fmt: skip
            except Exception as e:  # noqa: BLE001 (one case's failure must not hide the others)
                good = False
                out[key] = {"error": f"{type(e).__name__}: {e}"[:2000], "ok": False}
            ok &= good
    out["all_ok"] = ok
    return out


if __name__ == "__main__":
    # gpu_check runs graph_parity in its own process: a failed capture cannot then leave the
    # CUDA context of the timing sections in a bad state.
    import json
    import sys

    dev = torch.device(
        "cuda" if torch.cuda.is_available() and "--dry-run" not in sys.argv else "cpu"
    )
    with open(sys.argv[1], "w") as f:
        json.dump(graph_parity(dev, "--dry-run" in sys.argv), f, indent=1)
