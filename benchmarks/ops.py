"""Depth-read op benchmark: time, bytes moved by the minimal model, achieved bandwidth.

    python -m benchmarks.ops [--json PATH] [--device cpu|cuda] [--dry-run]

Each shape is a one-site read (``custom_ops.depth_read``, c = 1: decoding) or a phase-1 read
over a bank of c queries (``custom_ops.block_read``, c > 1, fp32 out: each layer of the model
reads the sources completed before it for its two sites, c = 2, in training). Minimal-bytes
model per token: forward S·d·size + c·d·out_size (read S values, write the c outputs),
backward 2S·d·size + c·d·out_size (read S values and the outputs' gradients, write S value
grads); keys are not counted. An op whose forward or any gradient disagrees with the eager
reference is reported and NOT timed.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import custom_ops
from benchmarks.meta import environment, write

TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}  # relative RMS


def _sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timeit(fn, device, repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn()`` over ``repeat`` runs."""
    for _ in range(warmup):
        fn()
    if torch.device(device).type == "cuda":
        # CUDA events around each call, one synchronisation at the end: a host synchronise per
        # call adds ~10-20 us of wake-up latency, 15 % of a 100 us read at 4 TB/s.
        ev = [[torch.cuda.Event(enable_timing=True) for _ in range(2)] for _ in range(repeat)]
        for start, end in ev:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in ev) / 1e3
    times = []
    for _ in range(repeat):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device, repeat: int = 10, nbytes: int | None = None) -> float:
    """GB/s of a big device-to-device tensor copy (read + write): 1 GiB on GPU, 256 MiB on CPU
    (past every cache either way)."""
    if nbytes is None:
        nbytes = 1 << 30 if torch.device(device).type == "cuda" else 1 << 28
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    y = torch.empty_like(x)
    t = timeit(lambda: y.copy_(x), device, repeat)
    return 2 * nbytes / t / 1e9


def make_inputs(tokens, d, r, sources, sliced, dtype, device, seed=0, queries=1):
    """Values, keys (None: sliced) and the query: ``[r]``, or a bank ``[queries, r]``."""
    # Drawn on the device: the GPU shapes reach 13 GB of fp32 draws, ~10 s on one CPU core.
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    vals = [randn(tokens, d).to(dtype) for _ in range(sources)]
    keys = None if sliced else [randn(tokens, r).to(dtype) for _ in range(sources)]
    query = randn(r) if queries == 1 else randn(queries, r)
    for t in [*vals, *(keys or []), query]:
        t.requires_grad_(True)
    return vals, keys, query


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _fwd_bwd(fn, inputs, grad):
    out = fn()
    grads = torch.autograd.grad(out, inputs, grad)
    return out, grads


def read(vals, keys, query, backend):
    """The read a shape times: one site's (``query [r]``) or a bank's output (``[c, r]``)."""
    if query.dim() == 1:
        return custom_ops.depth_read(vals, keys, query, backend=backend)
    return custom_ops.block_read(vals, keys, query, backend=backend)[0]


def check(backend, vals, keys, query, grad) -> float:
    """Largest relative RMS error of out and every gradient vs the reference backend."""
    inputs = [*vals, *(keys or []), query]
    ref = _fwd_bwd(lambda: read(vals, keys, query, "reference"), inputs, grad)
    got = _fwd_bwd(lambda: read(vals, keys, query, backend), inputs, grad)
    errs = [_rel(got[0], ref[0])] + [_rel(a, b) for a, b in zip(got[1], ref[1], strict=True)]
    return max(errs)


def bench_shape(tokens, d, r, sources, sliced, dtype, device, backends, repeat, queries=1):
    vals, keys, query = make_inputs(tokens, d, r, sources, sliced, dtype, device, queries=queries)
    inputs = [*vals, *(keys or []), query]
    out_dtype = dtype if queries == 1 else torch.float32  # a bank's out is fp32
    grad = torch.randn(*query.shape[:-1], tokens, d, device=device).to(out_dtype)
    size, out_size = dtype.itemsize, out_dtype.itemsize
    fwd_bytes = (sources * size + queries * out_size) * d * tokens
    bwd_bytes = (2 * sources * size + queries * out_size) * d * tokens
    rows = []
    for backend in backends:
        row = dict(tokens=tokens, d=d, r=r, S=sources, c=queries,
                   keys="sliced" if sliced else "projected",
                   dtype=str(dtype).removeprefix("torch."), backend=backend)  # fmt: skip
        err = check(backend, vals, keys, query, grad)
        row["max_rel_err"] = err
        if not err <= TOL[dtype]:
            row["skipped"] = f"correctness check failed: relative RMS error {err:.3g}"
            print(f"SKIP {backend} {row}: {row['skipped']}")
            rows.append(row)
            continue

        def fwd(backend=backend):
            with torch.no_grad():
                read(vals, keys, query, backend)

        def fwd_bwd(backend=backend):
            torch.autograd.grad(read(vals, keys, query, backend), inputs, grad)

        tf, tfb = timeit(fwd, device, repeat), timeit(fwd_bwd, device, repeat)
        row.update(fwd_ms=tf * 1e3, fwd_bwd_ms=tfb * 1e3, fwd_gbps=fwd_bytes / tf / 1e9,
                   fwd_bwd_gbps=(fwd_bytes + bwd_bytes) / tfb / 1e9,
                   bwd_gbps=bwd_bytes / (tfb - tf) / 1e9 if tfb > tf else float("nan"))  # fmt: skip
        rows.append(row)
    ref = {r["backend"]: r for r in rows if "fwd_ms" in r}
    for row in rows:
        if "fwd_ms" in row and "reference" in ref:
            row["fwd_speedup_vs_reference"] = ref["reference"]["fwd_ms"] / row["fwd_ms"]
            row["fwd_bwd_speedup_vs_reference"] = ref["reference"]["fwd_bwd_ms"] / row["fwd_bwd_ms"]
    return rows


def run(device, shapes, dtype, repeat, backends=None):
    """``shapes``: ``(tokens, d, r, S, sliced[, c])``, c = 1 when left out."""
    device = torch.device(device)
    if backends is None:
        backends = ["reference", "compiled"] + (["triton"] if device.type == "cuda" else [])
    result = {"device": str(device), **environment(device), "rows": []}
    result["copy_gbps"] = copy_bandwidth(device)
    for shape in shapes:
        result["rows"] += bench_shape(*shape[:5], dtype, device, backends, repeat, *shape[5:])
    if "copy_gbps" in result:
        for row in result["rows"]:
            if "fwd_gbps" in row:
                row["fwd_pct_copy"] = 100 * row["fwd_gbps"] / result["copy_gbps"]
                row["fwd_bwd_pct_copy"] = 100 * row["fwd_bwd_gbps"] / result["copy_gbps"]
                row["bwd_pct_copy"] = 100 * row["bwd_gbps"] / result["copy_gbps"]
    return result


def print_table(result):
    cols = ["backend", "keys", "d", "r", "S", "c", "tokens", "fwd_ms", "fwd_bwd_ms", "fwd_gbps",
            "bwd_gbps", "fwd_pct_copy", "fwd_bwd_pct_copy", "bwd_pct_copy",
            "fwd_speedup_vs_reference", "fwd_bwd_speedup_vs_reference", "max_rel_err"]  # fmt: skip
    cols = [c for c in cols if any(c in row for row in result["rows"])]
    print(f"device={result['device']} torch={result['torch']}", end="")
    print(f" copy={result['copy_gbps']:.0f} GB/s" if "copy_gbps" in result else "")
    print(" | ".join(cols))
    for row in result["rows"]:
        cells = []
        for c in cols:
            v = row.get(c, "-")
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print(" | ".join(cells))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--repeat", type=int, default=None, help="calls per median (5 GPU, 21 CPU)")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    if not cuda:  # the CPU trainer's allocator setting (a fresh buffer is not page-faulted in)
        from titan_lrattnres.training.cpu import keep_freed_memory

        keep_freed_memory()
    repeat = args.repeat or (5 if cuda else 21)
    if args.dry_run:
        shapes = [(64, 96, 8, 3, True), (64, 96, 8, 3, False), (64, 96, 8, 3, True, 2)]
    elif cuda:
        shapes = [(16384, d, 64, s, True) for d in (1024, 4096) for s in (5, 9, 17, 49)]
        shapes += [(16384, 1024, 64, s, True, 2) for s in (4, 8)]  # a layer's, Block N=8
    else:
        shapes = [(2048, 1024, 64, s, sl) for s in (5, 9) for sl in (True, False)]
        shapes += [(2048, 1024, 64, 8, True, 2)]
    dtype = torch.bfloat16 if cuda else torch.float32
    result = run(args.device, shapes, dtype, repeat)
    print_table(result)
    if args.json:
        write(args.json, result)
    return result


if __name__ == "__main__":
    main()
