"""The fused CPU kernels (``custom_ops/cpu/depth_read.c``) of the working tree against another
revision's, side by side in one process.

    python -m benchmarks.cpu_kernels [--against REV] [--reps 40] [--json PATH]
    python -m benchmarks.cpu_kernels --model 24,1024,512 [--variants block8,...] [--steps 10]
        [--ops]

Both libraries are built with ``custom_ops.cpu.build`` (same compiler and flags). For each shape
(the model's: a layer's phase-1 read of S completed sources for its C = 2 sites, and a merge
with a partial, ``merge_partial``'s kernels) every kernel entry point is timed
on the same tensors, the two libraries alternating call by call, each call after a 32 MB copy
that evicts the caches (in a training step the read's data is cold), freed memory kept as the
CPU trainer keeps it (``titan_lrattnres.training.cpu.keep_freed_memory``: fresh outputs do not
page-fault). The report is the median of each and their ratio, with the largest relative
difference between the two libraries' results (the work timed is the same). This machine's
noise moves single calls by tens of percent; the alternation keeps it out of the ratio.

``--model LAYERS,DIM,SEQ`` times the project's own model instead (``benchmarks.overhead.build``:
layers compiled, fp32, one 1 x SEQ sequence, forward + backward; the reads on the registered
ops, ``@compiled``, unless a variant names its backend): one model per variant, its
steps alternating between the two libraries (the compiled layers are shared, only the phase-1
read's C code differs), so the ratio is what the kernel change does to a training step. With
``--ops`` every step runs under ``torch.profiler`` and each depth op's self time in the step is
reported too: a change of a few ms a step is lost in the step's noise, not in its ops' times.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.meta import environment, write
from custom_ops import cpu

# name: (keys, S sources, C sites, tokens, d, r[, logit sd]); "standard" is r = d with the value
# as key. Queries ~ N(0, sd^2 / r): logits of sd ~ 1 (default), or a routing that has learnt to
# prefer some sources (sd 32: weights below 2^-126, the kernels' flush). A layer reads for its
# two sites (C = 2); L=24 Block N=8's widest phase-1 read is the last layers' (S = 8: the
# embedding and 7 blocks)
SHAPES = {
    "L24 sliced": ("sliced", 8, 2, 512, 1024, 64),
    "L24 projected": ("projected", 8, 2, 512, 1024, 32),
    "L24 standard": ("standard", 8, 2, 512, 1024, 1024),
    "L24 standard peaked": ("standard", 8, 2, 512, 1024, 1024, 32.0),
    "L24 sliced S=4": ("sliced", 4, 2, 512, 1024, 64),
    "L24 Full sliced S=47": ("sliced", 47, 2, 512, 1024, 64),  # Full's widest: the last layer's
    "L12 sliced": ("sliced", 8, 2, 1024, 512, 64),
    "cpu_small sliced": ("sliced", 4, 2, 2048, 128, 32),  # make train's model, its widest read
    "cpu_small projected": ("projected", 4, 2, 2048, 128, 32),
    "cpu_small standard": ("standard", 4, 2, 2048, 128, 128),
}
KERNELS = ("read_fwd", "read_bwd", "merge_fwd", "merge_bwd")
_REPO = Path(__file__).resolve().parents[1]


@contextlib.contextmanager
def _using(lib):
    """``custom_ops.cpu``'s entry points on ``lib`` instead of the package's own library."""
    saved = cpu.library
    cpu.library = lambda: lib
    try:
        yield
    finally:
        cpu.library = saved


def _source_at(rev: str, folder: Path) -> Path:
    path = folder / f"depth_read-{rev.replace('/', '_')}.c"
    proc = subprocess.run(
        ["git", "show", f"{rev}:custom_ops/cpu/depth_read.c"],
        capture_output=True, text=True, cwd=_REPO,
    )  # fmt: skip
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or ["git failed"])[0]
        raise ValueError(f"no custom_ops/cpu/depth_read.c at {rev!r} ({why})")
    path.write_text(proc.stdout)
    return path


def _calls(keys: str, S: int, C: int, T: int, d: int, r: int, logit_sd: float = 1.0, seed: int = 0):
    """The four entry points as closures over one set of inputs."""
    g = torch.Generator().manual_seed(seed)
    vals = [torch.randn(T, d, generator=g) for _ in range(S)]
    ks = {"sliced": None, "standard": vals}.get(keys)
    if keys == "projected":
        ks = [torch.randn(T, r, generator=g) for _ in range(S)]
    q = torch.randn(C, r, generator=g) * (logit_sd / r**0.5)
    out, lse = cpu.read_fwd(vals, ks, q, 1e-6)
    dout, dlse = torch.randn(C, T, d, generator=g), torch.randn(C, T, generator=g)
    o1, l1, pv = out[0].clone(), lse[0].clone(), torch.randn(T, d, generator=g)
    pk = {"sliced": None, "standard": pv}.get(keys)
    if keys == "projected":
        pk = torch.randn(T, r, generator=g)
    h, _ = cpu.merge_fwd(o1, l1, pv, pk, q[0], 1e-6, False)
    gh = torch.randn(T, d, generator=g)
    return {
        "read_fwd": lambda: cpu.read_fwd(vals, ks, q, 1e-6),
        "read_bwd": lambda: cpu.read_bwd(vals, ks, q, lse, dout, dlse, 1e-6),
        "merge_fwd": lambda: cpu.merge_fwd(o1, l1, pv, pk, q[0], 1e-6, False),
        "merge_bwd": lambda: cpu.merge_bwd(o1, l1, pv, pk, q[0], h, gh, None, 1e-6),
    }


def _flat(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for x in result if x is not None for t in _flat(x)]


def _rel_diff(a, b) -> float:
    worst = 0.0
    for x, y in zip(_flat(a), _flat(b), strict=True):
        if y.numel() == 0:  # the merge's norm when not asked for
            continue
        scale = y.double().abs().max().clamp_min(1e-30)
        worst = max(worst, ((x.double() - y.double()).abs().max() / scale).item())
    return worst


def _alternate(libs: dict, reps: int, timed) -> tuple[float, float]:
    """Medians of ``timed(name)`` (seconds) for the two libraries, called ``reps`` times each in
    alternating order (ABBA...), the library named ``name`` in use for the call."""
    times = {name: [] for name in libs}
    order = list(libs.items())
    for rep in range(reps):
        for name, lib in order if rep % 2 else order[::-1]:
            with _using(lib):
                times[name].append(timed(name))
    return tuple(statistics.median(t) for t in times.values())


def compare(libs: dict, reps: int) -> list[dict]:
    """Rows of ``{shape, kernel, <lib> ms..., ratio, rel_diff}``; ratio = second / first."""
    (a_name, a_lib), (b_name, b_lib) = libs.items()
    flush = torch.empty(8 * 2**20)
    sink = torch.empty_like(flush)

    def once(fn):
        sink.copy_(flush)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    rows = []
    for shape, spec in SHAPES.items():
        with _using(a_lib):
            calls = _calls(*spec)
        for kernel in KERNELS:
            fn = calls[kernel]
            with _using(a_lib):
                ref = fn()
            with _using(b_lib):
                diff = _rel_diff(fn(), ref)
            _alternate(libs, 2, lambda _lib, fn=fn: once(fn))  # warm-up
            ta, tb = (t * 1e3 for t in _alternate(libs, reps, lambda _lib, fn=fn: once(fn)))
            rows.append(
                {"shape": shape, "kernel": kernel, a_name: ta, b_name: tb, "ratio": tb / ta,
                 "rel_diff": diff}
            )  # fmt: skip
            print(
                f"  {shape:15s} {kernel:9s} {ta:7.2f} -> {tb:7.2f} ms ({tb / ta:.2f}x, "
                f"results differ by {diff:.1e})",
                flush=True,
            )
    return rows


DEPTH_OPS = ("block_read", "read_backward", "merge_partial")  # in the names of the depth ops


def _depth_op_ms(prof) -> dict[str, float]:
    """Self CPU time (ms) of each depth-read op in a profiled step, forward and backward: the
    registered ops (``lrattnres::block_read*``, ``lrattnres::read_backward``) and their autograd
    nodes."""
    return {
        e.key: e.self_cpu_time_total / 1e3
        for e in prof.key_averages()
        if any(n in e.key for n in DEPTH_OPS) and "evaluate_function" not in e.key
    }


def _profiled(step, ops: dict) -> float:
    """One step under ``torch.profiler`` (CPU): its time (s); each depth op's self ms appended
    to ``ops[op]``, their sum to ``ops["depth ops"]``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        elapsed = time.perf_counter() - t0
    found = _depth_op_ms(prof)
    for name, ms in found.items():
        ops.setdefault(name, []).append(ms)
    ops.setdefault("depth ops", []).append(sum(found.values()))
    return elapsed


def compare_model(
    libs: dict, shape, variants, steps: int, compile_: bool = True, ops: bool = False
) -> list[dict]:
    """Rows of ``{variant, <lib> s..., ratio, loss_rel_diff}`` for whole training steps
    (``compile_=False``: eager layers, for tests). ``ops``: every step profiled, and the rows
    add ``ops: {op: {<lib>: median self ms}}`` for the depth ops, in place in the step (their
    data as the step leaves it in the caches, which a kernel call alone does not reproduce)."""
    from benchmarks.overhead import Step, _timed, build

    a_name, b_name = libs
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].flatten().contiguous()
    rows = []
    for name in variants:
        # the C kernels run only behind the registered ops (the CPU default reads in aten ops)
        on_ops = name if "@" in name else f"{name}@compiled"
        model = build(on_ops, shape, "cpu", torch.float32, compile_)
        step = Step(model, tokens, targets, False, False)
        loss = {}
        for lib_name, lib in libs.items():  # warm-up; no optimizer: the weights stay put
            with _using(lib):
                step()
                loss[lib_name] = step().item()
        per_op = {lib_name: {} for lib_name in libs}
        if ops:

            def timed(lib, step=step, per_op=per_op):
                return _profiled(step, per_op[lib])
        else:

            def timed(_lib, step=step):
                return _timed(step, "cpu")

        ta, tb = _alternate(libs, steps, timed)
        diff = abs(loss[b_name] - loss[a_name]) / abs(loss[a_name])
        row = {"variant": name, a_name: ta, b_name: tb, "ratio": tb / ta, "loss_rel_diff": diff}
        print(
            f"  {name:15s} step {ta:6.3f} -> {tb:6.3f} s ({tb / ta:.3f}x, losses differ by "
            f"{diff:.1e})",
            flush=True,
        )
        if ops:
            row["ops"] = {
                op: {n: statistics.median(per_op[n].get(op, [0.0])) for n in libs}
                for op in per_op[a_name]
            }
            for op, ms in row["ops"].items():
                ratio = ms[b_name] / ms[a_name] if ms[a_name] else float("nan")
                print(f"    {op:38s} {ms[a_name]:7.2f} -> {ms[b_name]:7.2f} ms ({ratio:.3f}x)")
        rows.append(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--against", default="HEAD", help="git revision to compare with (HEAD)")
    p.add_argument("--reps", type=int, default=40, help="calls of each library per kernel")
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument("--model", default=None, metavar="L,D,T", help="time the model's steps")
    p.add_argument("--variants", default="block8,sliced8_r64,projected8_r32")
    p.add_argument("--steps", type=int, default=10, help="steps of each library per variant")
    p.add_argument(
        "--ops", action="store_true", help="with --model: each depth op's self time in the step"
    )
    a = p.parse_args(argv)
    if a.reps < 1 or a.steps < 1:
        p.error("--reps and --steps must be >= 1")
    if a.ops and a.model is None:
        p.error("--ops times the model's depth ops: give --model LAYERS,DIM,SEQ")
    shape = None
    if a.model is not None:
        from benchmarks.overhead import Shape, parse_variant

        try:
            layers, dim, seq = (int(x) for x in a.model.split(","))
            for name in a.variants.split(","):
                parse_variant(name)
        except ValueError as e:
            p.error(f"--model wants LAYERS,DIM,SEQ and known --variants ({e})")
        shape = Shape(layers, dim, seq, heads=max(1, dim // 64))
    with tempfile.TemporaryDirectory() as tmp:
        try:
            source = _source_at(a.against, Path(tmp))
        except ValueError as e:
            print(f"cpu_kernels: {e}", file=sys.stderr)
            return 2
        libs = {a.against: cpu.build(source), "tree": cpu.library()}
    if any(lib is None for lib in libs.values()):
        print("cpu_kernels: a library did not build (see the warning)", file=sys.stderr)
        return 2
    from titan_lrattnres.training.cpu import keep_freed_memory

    keep_freed_memory()  # what the CPU trainer runs with (no page faults on fresh outputs)
    if shape is not None:
        print(f"cpu_kernels: {a.against} -> working tree, {shape}, {a.steps} steps each")
        rows = compare_model(libs, shape, a.variants.split(","), a.steps, ops=a.ops)
    else:
        print(
            f"cpu_kernels: {a.against} -> working tree, {a.reps} alternating calls each, "
            f"{torch.get_num_threads()} threads"
        )
        rows = compare(libs, a.reps)
    if a.json:
        meta = {"against": a.against, "reps": a.reps, **environment(), "shapes": SHAPES,
                "model": a.model, "variants": a.variants, "steps": a.steps,
                "ops": a.ops}  # fmt: skip
        write(a.json, {"config": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
