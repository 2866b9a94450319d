"""One-shot GPU check of the code users run (``benchmarks/gpu_check.sh`` installs what the GPU
machine's Python lacks and calls this). Sections, in order; each writes its result or its error
to the JSON (rewritten after every section), so one failure never hides the others:

1. ``ops_check``: ``torch.library.opcheck`` of every op (compiled and Triton impls), forward +
   backward parity of ``depth_read`` and forward parity of the two-phase read vs the reference.
2. ``grad_parity``: ``block_read`` and ``merge_partial`` (with the fused RMSNorm), every output
   and every gradient vs ``custom_ops.reference``, fp32 and bf16, sliced and projected keys.
3. ``graph_parity``: read forward + backward, block read, merge captured in one CUDA graph each,
   inputs changed in place, replayed, compared with a fresh eager call (skipped on CPU). In its
   own process: a failed capture cannot leave this process's CUDA context unusable.
4. ``trainer``: ``python -m titan_lrattnres.train cpu_smoke`` for 3 steps + validation.
   Sections 3 and 4 are subprocesses started first: their ~20 s of start-up overlaps sections
   1-2, which time nothing.
   ``context_parallel``: ``benchmarks.gpu_cp``, CP=2 (torchtitan's CP, FlexAttention, NCCL)
   against one GPU from the same weights, loss and every gradient, three cases; needs 2 GPUs
   (on one it records "needs 2 GPUs, found 1"); its own 2 processes, started with sections 3-4
   and waited for before anything is timed (cap 120 s: FlexAttention's compiles, not measured).
5. ``memory``: ``torch.cuda.max_memory_allocated()`` of one real training step (forward,
   chunked loss, backward, clipping, Muon + AdamW step; ``benchmarks.memory.measure_real``) per
   variant (baseline, standard Block N=8 and Full, S-LR Block N=8 r=64, P-LR Block N=8 r=32) at
   the paper's shape on one GPU: ``paper_0p5b``, T=2048, local batch 4, bf16 parameters with
   fp32 masters, no AC, eager layers, one process (FSDP2 over a one-rank group: the
   benchmark's own path at FSDP size 1), beside ``python -m benchmarks.memory``'s prediction
   for the same case (fake tensors on the CPU, a subprocess started with sections 3-4);
   ``measured_over_predicted`` per variant.
6. ``op_bandwidth``: ``benchmarks.ops`` with the Triton backend, sliced keys r=64, d in {1024,
   4096} x S in {5, 9, 17, 49} (one site's read), and d=1024 x S in {4, 8} over a bank of 2
   queries (a layer's phase-1 read for its two sites, Block N=8 at L=24; fp32 out), 16k tokens,
   bf16: GB/s of the minimal bytes and their share of the copy bandwidth measured in the same
   run.
7. ``step_ratios``: ``benchmarks.overhead.measure``: the project's model at L=24 d=1024 T=2048
   (16 heads, the paper's vocabulary 100,277; bf16, FlexAttention, every layer compiled) per
   variant, forward + backward (no optimizer: the step of the CPU bars), ratio to the baseline
   within each round, median over rounds.
8. ``decode``: ``benchmarks.decode.measure`` at the paper's shape (``paper_0p5b``, random
   weights, fp32): prefill of 1x128 and 8x128 prompts, then 16 KV-cached greedy steps, per variant
   (baseline, standard, S-LR r=64 and P-LR r=32 Block N=8), 3 rounds, eager (the Triton depth
   reads) and, when the section runs alone, compiled (``CompiledForward``: the step captured in a
   CUDA graph, the reads fused by Inductor; first checked against eager through two caches,
   ``benchmarks.decode.compiled_agreement``), each batch size stored as it is done;
   ``GPU_CHECK_DECODE_VARIANTS`` / ``GPU_CHECK_DECODE_BATCHES`` choose a subset;
   ``decode_ratio`` / ``prefill_ratio``: over the same mode's baseline (median over rounds; the
   CPU bar is <= 1.05).
9. ``peers``: ``benchmarks.peers``: each peer's fused read and ours, forward and forward +
   backward, on the shapes each supports, with agreement vs our reference (skipped on CPU).
10. ``step_ratios_cuda_graphs``: section 7 with the whole step captured in a CUDA graph; last,
   since a failed capture may leave the CUDA context unusable.

Targets, stated in the JSON (``targets``) against the numbers of the same run: read forward >= 90 %
and forward + backward >= 75 % of the copy bandwidth (every op_bandwidth row); step overhead
<= 3 % sliced Block N=8 r=64 and <= 5 % projected Block N=8 r=32 (sections 7 and 10); ours faster
than every peer on every shape both support; decode and prefill of every routed variant <= 1.05x
the baseline's in each mode (section 8). Targets do not set the exit status; a section's
error and a failed parity do.

Sizing (whole script <= 6 min on an H200; ``gpu_check.sh`` gives Python the end of its 345 s and
kills it at 360 s): the GPU work itself is seconds (a 16k-token read moves 0.3-3 GB at ~4 TB/s: < 1
ms; a paper-shape step is ~10-50 ms), so sections are sized by compilation, each under a cap
(``CAPS``, a hard stop). ops_check: opcheck runs each op ~5 times through aot_dispatch and the
compiled impl is inductor-compiled per shape (cap 90 s: the first H200 run reached a cap of
60 s and the second took 56.5 s of it; the Triton impl goes first and results are kept as they
come; the 30 s more come out of peers, which takes what is left, so the total stays 345 s).
memory: the prediction is ~10 s of Python dispatch per variant on one CPU core (~50 s from the
start, beside sections 1-4); each GPU step
builds the model (~1 s), compiles its variant's Triton depth reads on first use (estimate 5-10 s)
and runs in ~0.1 s (cap 60 s; the variants done by then are reported). grad_parity: the Triton
backend only on GPU (the compiled one is covered on CPU by the tests; on CUDA its 8 inductor
compiles would cost ~1 min); 1,200 tokens, d=1000 (odd sizes): milliseconds. op_bandwidth: Triton
only (the compiled backend's inductor compiles cost ~1 min and carry no target), 20 timed calls per
shape between CUDA events (median of 20 calls of a 0.1-1 ms kernel: ~1 %), 10 shapes x a few Triton
compiles (cap 45 s). step_ratios: 3 variants, the baseline and the two with targets (standard Block
N=8 and Full have none and would add ~40 s of compile each); inductor compiling the layer graphs
dominates (estimate 30-40 s per variant on 16 cores); 20 rounds x 3 variants x <= 50 ms = 3 s of
timing; GPU steps vary by ~1 %, so the median of 20 per-round ratios is good to a few tenths of a
point (cap 150 s). decode: eager only in the full check (measured on an H200 machine: 4 variants
x 2 batches, warm-ups of 0.3-8 s each and 3 rounds, ~45 s; cap 150 s); the compiled mode's
whole-model graphs compile for minutes (measured there: 88 s for the baseline's prefill + decode
graphs at batch 1, 212 s for S-LR's), so only ``--sections decode`` alone runs it, given the
time by ``GPU_CHECK_SECONDS`` (~1,500 s for 4 variants x 2 batches). peers: they autotune on the
first call (liger none, flash-attn-res ~20 configs, fla-core 58, fast-attnres ~106 per rank), ~0.5 s
per config, left as shipped (pruning their configs would handicap them); rows run cheapest first,
r=64 before r=d, shape (d=1024, S=9: the paper's Block N=8 read) before (4096, 9) and (1024, 17),
until the deadline less section 10's cap; the rest are reported as skipped (``--sections peers``
alone gives them ~5 min). step_ratios_cuda_graphs re-uses section 7's compiled graphs (dynamo and
this run's inductor cache): capture + 10 rounds (cap 60 s). The dry run (``--dry-run``: CPU, tiny
shapes, eager layers) runs every section in ~30-60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import gpu_parity, meta, peers
from benchmarks import ops as op_bench

DEADLINE_S = 330.0
# Run in this order; "peers" gets what is left but the last section's cap.
CAPS = {"ops_check": 90, "grad_parity": 30, "graph_parity": 30, "trainer": 60,
        "context_parallel": 120, "memory": 60,
        "op_bandwidth": 45, "step_ratios": 150, "decode": 150, "peers": 330,
        "step_ratios_cuda_graphs": 60}  # fmt: skip
VARIANTS = ("baseline", "sliced8_r64", "projected8_r32")
DECODE_VARIANTS = ("baseline", "attnres8", "sliced8_r64", "projected8_r32")
DECODE_BOUND = 1.05
TARGETS = {"fwd_pct_copy": 90.0, "fwd_bwd_pct_copy": 75.0,
           "sliced8_r64": 3.0, "projected8_r32": 5.0}  # fmt: skip


class SectionTimeout(BaseException):  # not an Exception: per-case handlers must not swallow it
    pass


def _alarm(signum, frame):
    raise SectionTimeout


# ----------------------------------------------------------------------------------------------
# Sections


def start(name: str, cmd: list[str], tmp: Path, env: dict | None = None) -> dict:
    """A section's subprocess, started before the first section: sections 1-3 time nothing, so
    its start-up (~20 s of imports) overlaps them."""
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 (closed in finish)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return dict(proc=proc, cmd=cmd, log=log, t0=time.perf_counter())


def finish(res, started, timeout) -> list[str]:
    """Wait (at most ``timeout`` s), record exit status and seconds; the log's last lines."""
    proc = started["proc"]
    try:
        res["rc"] = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        proc.kill()
        res["rc"] = proc.wait()
        res["error"] = f"killed after {timeout:.0f} s"
    started["log"].close()
    res["seconds"] = time.perf_counter() - started["t0"]
    lines = Path(started["log"].name).read_text(errors="replace").splitlines()
    tail = [ln for ln in lines if not re.match(r"[WI]\d{4} ", ln)][-25:]  # no torch logs
    if res["rc"] != 0 and "error" not in res:
        res["error"] = f"exit status {res['rc']}: " + "\n".join(tail[-8:])
    return tail


def trainer_start(tmp: Path) -> dict:
    """``cpu_smoke`` for 3 steps + validation (PYTHONPATH, hence the compat patches, inherited)."""
    cmd = [sys.executable, "-m", "titan_lrattnres.train", "cpu_smoke", "--training.steps", "3",
           "--validator.steps", "2", "--checkpoint.no-enable",
           "--dump_folder", str(tmp / "trainer")]  # fmt: skip
    return start("trainer", cmd, tmp, env={**os.environ, **_corpus_env()})


def _corpus_env() -> dict:
    """The Trainer refuses a corpus cached by another Python (a different stdlib): a clone
    copied to the GPU machine may hold one, so that Python gets a cache of its own."""
    try:
        from titan_lrattnres.components import data

        manifest = data.load_manifest()
    except Exception:  # noqa: BLE001 (the trainer section reports what fails)
        return {}
    here = platform.python_version()
    if manifest and manifest.get("python_version") != here:
        return {data.CACHE_ENV: str(data.cache_dir() / f"python-{here}")}
    return {}


def trainer_finish(res, started, timeout):
    res["cmd"] = " ".join(started["cmd"][1:])
    res["tail"] = finish(res, started, timeout)
    summary = Path(started["cmd"][-1]) / "summary.json"
    if summary.exists():
        res["summary"] = json.loads(summary.read_text())


def graph_start(tmp: Path, dry: bool) -> dict:
    """graph_parity in its own process: a failed capture cannot harm the timing sections."""
    out = tmp / "graph_parity.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_parity", str(out)]
    return dict(start("graph_parity", cmd + (["--dry-run"] if dry else []), tmp), out=out)


def cp_start(tmp: Path, dry: bool) -> dict:
    """context_parallel (``benchmarks.gpu_cp``: CP=2 against one GPU; 2 processes, 2 GPUs, or
    it records that it needs them); the dry run: one case on the CPU."""
    out = tmp / "context_parallel.json"
    cmd = [sys.executable, "-m", "benchmarks.gpu_cp", "--out", str(out)]
    cmd += ["--dry-run", "--cases", "sliced_block"] if dry else []
    return dict(start("context_parallel", cmd, tmp), out=out)


def json_finish(res, started, timeout):
    """A subprocess section that writes its own JSON (``started["out"]``): merged into ``res``."""
    tail = finish(res, started, timeout)
    out = started["out"]
    if out.exists():
        res.update(json.loads(out.read_text()))
    elif "error" not in res:
        res["error"] = "no result written: " + "\n".join(tail[-8:])


def _memory_cases(dry: bool) -> list:
    """``benchmarks.memory`` cases of the memory section (the dry run: debug flavor, fp32)."""
    from benchmarks import memory

    shape = (dict(flavor="debug", seq=64, batch=2, dtype="fp32", implementation="foreach")
             if dry else dict(flavor="paper_0p5b", seq=2048, batch=4, dtype="bf16"))  # fmt: skip
    return [(n, memory.named_case(n, ac="none", fsdp=1, **shape)) for n in memory.DEFAULT_VARIANTS]


def memory_start(tmp: Path, dry: bool) -> dict:
    """The memory section's prediction (fake tensors, CPU), started with sections 3-4."""
    _, case = _memory_cases(dry)[0]
    cmd = [sys.executable, "-m", "benchmarks.memory", "--flavor", case.flavor,
           "--seq", str(case.seq), "--batch", str(case.batch), "--dtype", case.dtype,
           "--implementation", case.implementation, "--ac", "none", "--fsdp", "1",
           "--variants", ",".join(n for n, _ in _memory_cases(dry)),
           "--json", str(tmp / "memory_prediction.json")]  # fmt: skip
    return start("memory", cmd, tmp)


def memory_section(res, started, device, timeout):
    """Each variant's real step (measured peak), then the prediction, the ratio per variant."""
    from benchmarks import memory

    end = time.perf_counter() + timeout
    dry = device.type != "cuda"
    cases = _memory_cases(dry)
    shape = {k: v for k, v in asdict(cases[0][1]).items()
             if k not in ("variant", "blocks", "block_layers", "rank")}  # fmt: skip
    res["config"] = dict(shape, variants=[n for n, _ in cases],
                         prediction=" ".join(started["cmd"][1:]))  # fmt: skip
    unit, div = ("MiB", 2**20) if dry else ("GiB", 2**30)
    rows = res["rows"] = {}
    for name, case in cases:  # stored one by one: a cap leaves the variants done
        real = memory.measure_real(case, str(device))
        rows[name] = {k: real[k] for k in ("measured_peak", "measured_by", "seconds")}
        rows[name].update(tracker_real_peak=real["peak"], tracker_real_at_peak=real["at_peak"])
        print(f"[memory] {name}: {real['measured_peak'] / div:.2f} {unit} measured "
              f"({real['seconds']:.1f} s)", flush=True)  # fmt: skip
    pred = res["prediction"] = {}
    tail = finish(pred, started, end - time.perf_counter())
    out = Path(started["cmd"][-1])
    if "error" in pred or not out.exists():
        raise RuntimeError("prediction failed: " + pred.get("error", "\n".join(tail[-8:])))
    for r in json.loads(out.read_text())["rows"]:
        row = rows[r["name"]]
        row.update(predicted_peak=r["peak"], predicted_at_peak=r["at_peak"],
                   predicted_optimizer=r["optimizer"])  # fmt: skip
        row["measured_over_predicted"] = row["measured_peak"] / r["peak"]
        row["tracker_real_over_predicted"] = row["tracker_real_peak"] / r["peak"]
    res["measured_over_predicted"] = {
        n: round(r["measured_over_predicted"], 4) for n, r in rows.items()
    }
    lines = [f"{'variant':<16}{'predicted ' + unit:>16}{'measured ' + unit:>16}{'ratio':>8}"]
    for n, r in rows.items():
        lines.append(f"{n:<16}{r['predicted_peak'] / div:>16.2f}{r['measured_peak'] / div:>16.2f}"
                     f"{r['measured_over_predicted']:>8.3f}")  # fmt: skip
    res["table"] = "\n".join(lines)


def op_bandwidth(res, device, dry):
    if dry:
        shapes = [(64, 96, 8, 3, True), (64, 96, 8, 3, True, 2)]
        backends = ["reference", "compiled"]
    else:
        shapes = [(16384, d, 64, s, True) for d in (1024, 4096) for s in (5, 9, 17, 49)]
        shapes += [(16384, 1024, 64, s, True, 2) for s in (4, 8)]  # a layer's phase 1
        backends = ["triton"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res.update(op_bench.run(device, shapes, dtype, repeat=3 if dry else 20, backends=backends))


def step_ratios(res, device, dry, cuda_graphs):
    if cuda_graphs and device.type != "cuda":
        res["skipped"] = "CUDA graphs need a CUDA device (dry run / no GPU)"
        return
    from benchmarks import overhead

    if dry:  # eager layers: inductor on 2 CPU cores would take minutes (compile is tested)
        shape, rounds, compile_ = overhead.Shape(4, 64, 32, heads=4, vocab=256), 2, False
    else:
        shape = overhead.Shape(24, 1024, 2048, heads=16, vocab=100277)
        rounds, compile_ = (10 if cuda_graphs else 20), True
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res["config"] = dict(vars(shape), hidden=shape.hidden_dim, dtype=str(dtype)[6:],
                         rounds=rounds, compile=compile_, cuda_graphs=cuda_graphs,
                         optimizer=False, variants=VARIANTS)  # fmt: skip
    tag = "[step_ratios_cuda_graphs]" if cuda_graphs else "[step_ratios]"
    res["result"] = overhead.measure(
        shape, device=device, dtype=dtype, variants=VARIANTS, rounds=rounds, warmup=3,
        optimizer=False, cuda_graphs=cuda_graphs, compile_=compile_,
        progress=lambda m: print(tag, m, flush=True),
    )  # fmt: skip
    res["overhead_pct"] = {v: res["result"][v]["median_overhead_pct"] for v in VARIANTS[1:]}
    res["overhead_ci95_pct"] = {v: res["result"][v]["ci95_overhead_pct"] for v in VARIANTS[1:]}
    res["table"] = overhead.table(res["result"])


def decode(res, device, dry, compiled: bool):
    """Eager, then (``compiled``: the section run alone) compiled, each batch size in turn, each
    stored as it is done (a cap keeps what finished). The compiled mode's whole-model graphs
    take minutes to compile at this shape (measured on an H200 machine: the baseline's prefill
    + decode graphs 88 s, S-LR's 212 s), more than the full check can give them."""
    from benchmarks import decode as decode_bench

    if dry:  # the compiled mode's CPU compiles (~20 s per graph) stay out of the dry run
        config = dict(flavor="debug", prompt=16, new=4, batches=(1, 2), rounds=2, modes=("eager",))
        variants = ("baseline", "attnres2", "sliced2_r32", "projected2_r32")
    else:  # GPU_CHECK_DECODE_VARIANTS / _BATCHES: a subset, to fit the compiles in less time
        batches = os.environ.get("GPU_CHECK_DECODE_BATCHES", "1,8")
        config = dict(flavor="paper_0p5b", prompt=128, new=16, rounds=3,
                      batches=tuple(int(b) for b in batches.split(",")),
                      modes=("eager", "compiled") if compiled else ("eager",))  # fmt: skip
        variants = os.environ.get("GPU_CHECK_DECODE_VARIANTS", ",".join(DECODE_VARIANTS))
        variants = tuple(v for v in variants.split(",") if v)
    if compiled and not dry:  # first: the compiled step (a CUDA graph) computes what eager does
        check = res["compiled_agreement"] = decode_bench.compiled_agreement(
            "debug", "projected2_r32", device
        )
        res["all_ok"] = check["tokens_equal"] and check["worst"] <= 1e-4
        print(f"[decode] compiled vs eager: {check}", flush=True)
    res["config"] = dict(config, variants=variants, dtype="float32")
    result = res["result"] = {}
    ratios = res["decode_ratio"], res["prefill_ratio"] = {}, {}

    def done(mode, batch, rows):
        result.setdefault(mode, {})[batch] = rows
        for key, into in zip(("decode_ratio", "prefill_ratio"), ratios, strict=True):
            into[f"{mode} B={batch}"] = {n: round(r[key], 3) for n, r in rows.items()}
        res["table"] = decode_bench.table(result)

    flavor = config.pop("flavor")
    decode_bench.measure(
        flavor, variants=variants, device=device, on_result=done,
        progress=lambda m: print("[decode]", m, flush=True), **config,
    )  # fmt: skip


# ----------------------------------------------------------------------------------------------
# Targets


def targets(result, judged: bool = True) -> list[dict]:
    """Every target beside the number of this run that it is judged on (``ok`` None: not judged,
    e.g. tiny CPU shapes of a dry run)."""
    out = []
    rows = [r for r in result.get("op_bandwidth", {}).get("rows", []) if "fwd_pct_copy" in r]
    for key in ("fwd_pct_copy", "fwd_bwd_pct_copy"):
        if rows:
            worst = min(rows, key=lambda r: r[key])
            out.append(dict(target=f"read {key.removesuffix('_pct_copy')} >= {TARGETS[key]:.0f} % "
                            "of copy bandwidth (worst shape)", measured=round(worst[key], 1),
                            where=f"d={worst['d']} S={worst['S']}",
                            ok=worst[key] >= TARGETS[key]))  # fmt: skip
    for section in ("step_ratios", "step_ratios_cuda_graphs"):
        pct = result.get(section, {}).get("overhead_pct", {})
        for variant in VARIANTS[1:]:
            bound = TARGETS[variant]
            if variant in pct:
                out.append(dict(target=f"{variant} step overhead <= {bound:.0f} % ({section})",
                                measured=round(pct[variant], 2),
                                ok=pct[variant] <= bound))  # fmt: skip
    for mode, by_batch in result.get("decode", {}).get("result", {}).items():
        for b, per_variant in by_batch.items():
            for variant, r in per_variant.items():
                if variant == "baseline":
                    continue
                worst = max(r["decode_ratio"], r["prefill_ratio"])
                out.append(dict(target=f"{variant} decode and prefill <= {DECODE_BOUND}x the "
                                f"baseline's ({mode}, B={b})", measured=round(worst, 3),
                                ok=worst <= DECODE_BOUND))  # fmt: skip
    rows = [r for r in result.get("peers", {}).get("rows", []) if "ours_over_theirs_fwd" in r]
    for row in rows:
        worst = max(row["ours_over_theirs_fwd"], row["ours_over_theirs_fwd_bwd"])
        out.append(dict(target=f"faster than {row['impl']} (ours/theirs < 1)",
                        measured=round(worst, 3), where=f"d={row['d']} S={row['S']} r={row['r']}",
                        ok=worst < 1))  # fmt: skip
    if not judged:
        for t in out:
            t["ok"] = None
    return out


# ----------------------------------------------------------------------------------------------


def _versions() -> dict:
    out = meta.versions()
    for dist in ("triton", "torchtitan", *dict.fromkeys(peers.DISTS.values())):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    compat = sys.modules.get("sitecustomize")
    out["torch_compat_patches"] = getattr(compat, "APPLIED", None)  # None: not on PYTHONPATH
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json_path", nargs="?", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, end to end")
    p.add_argument("--sections", default=",".join(CAPS), help="comma-separated subset")
    args = p.parse_args(argv)
    dry = args.dry_run
    wanted = [s for s in args.sections.split(",") if s]
    unknown = [s for s in wanted if s not in CAPS]
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(CAPS)}")
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device here: use --dry-run (tiny shapes on CPU)")
    device = torch.device("cpu" if dry else "cuda")
    # The dry run's name says so: its numbers are CPU numbers of tiny shapes, no GPU result.
    default = "gpu_check_dry_run_cpu.json" if dry else "gpu_check.json"
    path = Path(args.json_path or Path("benchmarks/results") / default)
    t_start = time.perf_counter()
    # gpu_check.sh passes the wall-clock end of its budget (pip and imports already spent)
    end = float(os.environ.get("GPU_CHECK_END", time.time() + DEADLINE_S))
    deadline = t_start + end - time.time()
    result = {"device": str(device), "dry_run": dry, **meta.environment(device),
              "versions": _versions(), "caps_s": CAPS}  # fmt: skip
    if dry:
        result["note"] = (
            "CPU dry run with tiny shapes: checks that every section runs; no GPU figure"
        )
    tmp = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    bg = {}
    if "trainer" in wanted:
        bg["trainer"] = trainer_start(tmp)
    if "graph_parity" in wanted:
        bg["graph_parity"] = graph_start(tmp, dry)
    if "context_parallel" in wanted:
        bg["context_parallel"] = cp_start(tmp, dry)
    if "memory" in wanted:
        bg["memory"] = memory_start(tmp, dry)

    def wait_for(name):  # 2 s inside the section's cap, so the wait ends before the alarm
        return min(CAPS[name], deadline - time.perf_counter()) - 2

    # peers leave the CUDA-graph step section its cap: it comes last, as a failed capture of a
    # whole step could leave this process's CUDA context unusable
    reserve = CAPS["step_ratios_cuda_graphs"] if "step_ratios_cuda_graphs" in wanted else 0
    sections = {
        "ops_check": lambda res: gpu_parity.check_ops(device, dry, out=res),
        "grad_parity": lambda res: res.update(gpu_parity.grad_parity(device, dry)),
        "graph_parity": lambda res: json_finish(res, bg["graph_parity"], wait_for("graph_parity")),
        "context_parallel": lambda res: json_finish(
            res, bg["context_parallel"], wait_for("context_parallel")
        ),
        "trainer": lambda res: trainer_finish(res, bg["trainer"], wait_for("trainer")),
        "memory": lambda res: memory_section(res, bg["memory"], device, wait_for("memory")),
        "op_bandwidth": lambda res: op_bandwidth(res, device, dry),
        "step_ratios": lambda res: step_ratios(res, device, dry, cuda_graphs=False),
        "decode": lambda res: decode(res, device, dry, compiled=wanted == ["decode"]),
        "peers": lambda res: peers.run(
            res, device, dry, deadline - reserve - 15, repeat=3 if dry else 20
        ),
        "step_ratios_cuda_graphs": lambda res: step_ratios(res, device, dry, cuda_graphs=True),
    }
    signal.signal(signal.SIGALRM, _alarm)
    try:
        run_sections(sections, wanted, result, deadline, reserve, t_start, path)
    finally:  # a subprocess skipped for time must not outlive the check
        for started in bg.values():
            if started["proc"].poll() is None:
                started["proc"].kill()
    report(result, wanted)

    failed = [n for n in wanted if "error" in result[n]]
    failed += [n for n in ("ops_check", "grad_parity", "graph_parity", "context_parallel", "decode")
               if n in wanted and result[n].get("all_ok") is False]  # fmt: skip
    print(f"[gpu_check] wrote {path}; {result['total_seconds']:.0f} s")
    print(f"[gpu_check] {'OK' if not failed else 'FAILED: ' + ', '.join(dict.fromkeys(failed))}")
    return 0 if not failed else 1


def run_sections(sections, wanted, result, deadline, reserve, t_start, path):
    """Each section in turn under its cap; the JSON is rewritten after every one."""
    for name in (n for n in sections if n in wanted):
        res = result[name] = {}
        left = deadline - time.perf_counter() - (reserve if name == "peers" else 0)
        cap = left if len(wanted) == 1 else min(CAPS[name], left)  # alone: the whole budget
        t0 = time.perf_counter()
        if left < 5:
            res["skipped"] = f"time budget: {left:.0f} s left of {deadline - t_start:.0f} s"
        else:
            signal.setitimer(signal.ITIMER_REAL, cap)
            try:
                sections[name](res)
            except SectionTimeout:
                res["error"] = f"stopped at its cap of {cap:.0f} s"
            except Exception:  # noqa: BLE001 (recorded; the other sections still run)
                res["error"] = traceback.format_exc()[-4000:]
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        result[name + "_seconds"] = time.perf_counter() - t0
        print(f"[gpu_check] {name}: {result[name + '_seconds']:.1f}s", flush=True)
        result["targets"] = targets(result, judged=not result["dry_run"])
        result["total_seconds"] = time.perf_counter() - t_start
        path.write_text(json.dumps(result, indent=1, default=str))


def report(result, wanted):
    """The tables a reader needs, then the targets against this run's numbers."""
    if "rows" in result.get("op_bandwidth", {}):
        op_bench.print_table(result["op_bandwidth"])
    for name in ("step_ratios", "step_ratios_cuda_graphs"):
        if "table" in result.get(name, {}):
            print(f"{name}: {result[name]['config']}\n{result[name]['table']}")
    if "table" in result.get("memory", {}):
        print(f"memory: peak of one training step, {result['memory']['config']}\n"
              f"{result['memory']['table']}")  # fmt: skip
    if "table" in result.get("decode", {}):
        print(f"decode: {result['decode']['config']}\n{result['decode']['table']}")
    if "rows" in result.get("peers", {}):
        print(peers.table(result["peers"]))
    for name in wanted:
        r = result[name]
        state = r.get("error") or r.get("skipped") or ("ok" if r.get("all_ok", True) else "FAIL")
        state = f"{state}; {r['note']}" if "note" in r else state
        print(f"[gpu_check] {name:<24} {str(state).strip().splitlines()[-1][:150]}")
    for t in result["targets"]:
        where = f" at {t['where']}" if "where" in t else ""
        verdict = {True: "met ", False: "MISS", None: "n/a "}[t["ok"]]
        print(f"[target] {verdict} {t['target']}: {t['measured']}{where}")


if __name__ == "__main__":
    raise SystemExit(main())
