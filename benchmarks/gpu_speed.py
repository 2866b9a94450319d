"""The GPU run that measures training speed as users train (``benchmarks/gpu_check.sh --speed``;
docs/gpu-check.md). One plan, in this order (what decides the most first):

1. ``gate``: the routed model's loss and every parameter's gradient with the Triton depth reads
   against the same model with the eager reference reads (``<variant>@reference``), fp32, SDPA,
   eager layers, at a small shape (L=4 d=256 T=256 B=2): standard, S-LR and P-LR Block N=8.
2. ``step_ratios``, its first case: the paper's (local batch 4, T=2048, bf16, selective AC, no
   CUDA graphs) at the paper's shape (L=24 d=1024, 16 heads, vocabulary 100,277, FlexAttention,
   every ``model.layers`` entry compiled as torchtitan compiles it): torchtitan's decoder, the
   baseline and S-LR Block N=8 r=64 (``VARIANTS``), with one profiled step per variant
   (``profile``: GPU time by kernel class, ``benchmarks.step_profile``, and each routed
   variant's difference to torchtitan's decoder).
3. ``trainer``: the real Trainer, ``paper_sliced_block8_r64`` (``TRAINER``; ``GPU_SPEED_TRAINER``
   adds ``paper_baseline`` in a later call) on the embedded corpus, local batch 4 x 2048, no
   gradient accumulation: torchtitan's logged tokens/s and MFU (medians after the fifth step).
   Each run has a timeout and its output is streamed.
4. ``step_ratios``, any other cases asked for (``GPU_SPEED_CASES``; ``REST`` lists them): batch
   1, then the CUDA-graph cases last (a failed capture can spoil the CUDA context), every
   capture in one shared graph pool; the CUDA cache emptied and dynamo reset between cases.

A routed model compiles one graph per layer plan (24 at the paper's shape), so one nine-minute
call holds one routed variant; docs/gpu-check.md gives the later calls.

Figures survive anything: the JSON is rewritten (a temporary file, then ``os.replace``: valid
JSON at every moment) after every variant of every case, every Trainer run and every section,
and SIGTERM (``gpu_check.sh``'s deadline) records ``stopped`` before exiting. A variant that
fails (an exception, out of memory, a failed compile or capture) is recorded with its error and
the others go on. Each variant is built just before it is timed and freed after; only the
reference (``torchtitan``, torchtitan's own decoder of the same shape) stays built through its
case, and each variant's steps alternate with the reference's (the ratio is taken within each
round, so drifts cancel). A case starts only when the time left covers its estimate from what
the first case measured (compile seconds per variant, step times scaled by the batch);
otherwise it is recorded as skipped with the reason.

The plan's estimate is printed first: the layer graphs its models compile (a routed Block or
Full model at L layers compiles L: ``DepthPlan.graphs``; torchtitan's decoder and the baseline
one) times the seconds per graph the last GPU run of this script stored under
``benchmarks/results/gpu_*/`` (``compile_s`` / ``graphs``), else ``COMPILE_GRAPH_S``; plus the
gate, the Trainer runs and the start-up (``ESTIMATE_S``).

``--dry-run``: the same plan on the CPU at a tiny shape (L=4 d=64 T=32, eager layers, the gate
against itself: no Triton on the CPU) and the paper configs through the Trainer at the
``cpu_small`` flavor (``benchmarks.tiny_paper``). ``--fail-variant NAME`` (or
``GPU_SPEED_FAIL_VARIANT``) makes that variant fail on purpose, to show the others stay.

Targets (``targets`` in the JSON, against this run's numbers): at the first case, standard Block,
S-LR and P-LR Block N=8 within +5 % of torchtitan's decoder and Full within +15 %; the same with
CUDA graphs; the routed Trainer's tokens/s within 5 % of the baseline's.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks import gpu_report, meta, overhead
from benchmarks.step_profile import profile_step, profile_table
from titan_lrattnres.model.depth import DepthPlan

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("torchtitan", "baseline", "sliced8_r64")  # the first case's
# The default plan fits 525 s by the estimate printed at the start: a routed model compiles one
# graph per layer (24), so one call holds one routed variant; the rest: later calls
# (docs/gpu-check.md), e.g. GPU_SPEED_VARIANTS=torchtitan,projected8_r32,block8
CASES = "4:selective"
REST = "1:none,4:selective:graphs,1:none:graphs"
LATER_VARIANTS = ("torchtitan", "baseline", "sliced8_r64")  # after case 1
BOUNDS = {"full": 15.0}  # % over torchtitan's decoder; every other routed variant: 5 %
TRAINER = ("paper_sliced_block8_r64",)  # paper_baseline's run: a later call (GPU_SPEED_TRAINER)
TRAINER_MODELS = {"paper_sliced_block8_r64": "sliced8_r64"}  # the routed Trainer runs' models
GATE_VARIANTS = ("block8", "sliced8_r64", "projected8_r32")
GATE_BOUNDS = {"loss_rel": 1e-4, "grad_rel": 1e-3}  # fp32: Triton vs the aten reference
# Estimate constants (seconds), used where the repository holds no GPU measurement
# one layer graph (fwd + bwd) compiled at the paper's shape: an assumption until a GPU run of
# this script stores its compile_s / graphs (on the 2-core CPU: 6.7 s a graph)
COMPILE_GRAPH_S = 8.0
ESTIMATE_S = dict(startup=25.0, gate=30.0, trainer_start=30.0, trainer_step=0.5, step=0.1,
                  capture=5.0)  # fmt: skip
TRAINER_TIMEOUT_S = 300.0  # per Trainer run (a routed model compiles 24 layer graphs)
MARGIN_S = 10.0  # kept free at the end: the last JSON write, the report


def parse_cases(text: str) -> list[tuple[int, str, bool]]:
    """``"4:selective,1:none:graphs"`` -> ``[(4, "selective", False), (1, "none", True)]``."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if (
            len(parts) not in (2, 3)
            or not parts[0].isdigit()
            or parts[1] not in overhead.AC_MODES
            or parts[2:] not in ([], ["graphs"])
        ):
            raise ValueError(f"bad case {item!r}: BATCH:{'|'.join(overhead.AC_MODES)}[:graphs]")
        cases.append((int(parts[0]), parts[1], parts[2:] == ["graphs"]))
    return cases


def case_name(batch: int, ac: str, graphs: bool) -> str:
    return f"B={batch} AC={ac}" + (" CUDA graphs" if graphs else "")


def order_cases(cases):
    """Graph cases last (stable otherwise)."""
    return [c for c in cases if not c[2]] + [c for c in cases if c[2]]


# ----------------------------------------------------------------------------------------------
# The JSON, valid at every moment


class Recorder:
    """The result dict and its file: ``save()`` writes a temporary file beside it and replaces
    the file with it (``os.replace`` is atomic), so a reader, a SIGTERM or a crash never sees a
    half-written JSON."""

    def __init__(self, path: Path, result: dict):
        self.path, self.result = path, result
        path.parent.mkdir(parents=True, exist_ok=True)

    def save(self) -> None:
        text = json.dumps(self.result, indent=1, default=str)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_CHILDREN: list[subprocess.Popen] = []  # the running Trainer, ended on SIGTERM


def on_sigterm(rec: Recorder):
    def handler(signum, frame):
        for proc in _CHILDREN:
            if proc.poll() is None:
                _kill(proc)
        rec.result["stopped"] = f"signal {signal.Signals(signum).name} at {time.time():.0f}"
        rec.save()
        print(f"[gpu_speed] stopped by {signal.Signals(signum).name}; {rec.path} kept", flush=True)
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


# ----------------------------------------------------------------------------------------------
# The plan and its estimate


class Plan:
    def __init__(self, dry: bool, cases_text: str | None = None, variants: str | None = None):
        self.dry = dry
        if dry:
            self.shape = overhead.Shape(4, 64, 32, heads=4, vocab=256)
            self.gate_shape = overhead.Shape(2, 64, 32, heads=4, batch=2, vocab=256)
            self.gate_variants = ("attnres2", "sliced2_r32", "projected2_r32")
            default_cases = "2:selective"  # the GPU plan's case at a batch the CPU can afford
            # the GPU plan's variants, at N=2 (the tiny model has 8 sublayers)
            self.variants = self.later = ("torchtitan", "baseline", "sliced2_r32")
            self.rounds, self.warmup, self.compile = 2, 1, False
            self.trainer = TRAINER
            self.trainer_steps = 3
        else:
            self.shape = overhead.Shape(24, 1024, 2048, heads=16, vocab=100277)
            self.gate_shape = overhead.Shape(4, 256, 256, heads=4, batch=2, vocab=4096)
            self.gate_variants = GATE_VARIANTS
            default_cases = CASES
            self.variants, self.later = VARIANTS, LATER_VARIANTS
            self.rounds, self.warmup, self.compile = 10, 2, True
            self.trainer = TRAINER
            self.trainer_steps = int(os.environ.get("GPU_SPEED_STEPS", "20"))
        trainer = os.environ.get("GPU_SPEED_TRAINER")
        if trainer:
            self.trainer = tuple(t for t in trainer.split(",") if t)
        cases_text = cases_text or os.environ.get("GPU_SPEED_CASES") or default_cases
        self.cases = order_cases(parse_cases(cases_text))
        chosen = variants or os.environ.get("GPU_SPEED_VARIANTS")
        if chosen:  # the same variants in every case
            self.variants = self.later = tuple(v for v in chosen.split(",") if v)
        for v in self.variants + self.later:
            overhead.parse_variant(v)

    def case_variants(self, i: int) -> tuple[str, ...]:
        return self.variants if i == 0 else self.later

    def config(self) -> dict:
        s = self.shape
        return dict(layers=s.layers, dim=s.dim, seq=s.seq, heads=s.heads, vocab=s.vocab,
                    hidden=s.hidden_dim, rounds=self.rounds, warmup=self.warmup,
                    compile=self.compile,
                    cases=[case_name(*c) for c in self.cases],
                    variants={case_name(*c): list(self.case_variants(i))
                              for i, c in enumerate(self.cases)})  # fmt: skip


def layer_graphs(name: str, shape: overhead.Shape) -> int:
    """Compiled graphs of variant ``name``'s model: one per distinct layer plan (the decoder's
    and the baseline's layers share one; Block and Full: one per layer, ``DepthPlan.graphs``),
    and P-LR's embedding key one more."""
    variant, blocks, rank = overhead.parse_variant(name)
    if variant in ("torchtitan", "baseline"):
        return 1
    plan = DepthPlan(variant=variant, dim=shape.dim, rank=rank or shape.dim,
                     num_sublayers=2 * shape.layers, blocks=blocks)  # fmt: skip
    return plan.graphs + plan.projected


def stored_compile_seconds(root: Path = ROOT / "benchmarks" / "results") -> tuple[float, str]:
    """Seconds to compile one layer graph on the GPU (fwd + bwd), the largest a stored run of
    this script measured (a variant's ``compile_s`` over its ``graphs``), and where it came from;
    ``COMPILE_GRAPH_S`` when the repository holds none."""
    jsons = sorted(root.glob("gpu_*/**/gpu_speed*.json"), key=lambda p: p.stat().st_mtime)
    for path in reversed(jsons):
        try:
            cases = json.loads(path.read_text())["step_ratios"]["cases"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        per_graph = [
            v["compile_s"] / v["graphs"]
            for case in cases.values()
            for v in (case.get("variants") or {}).values()
            if isinstance(v, dict) and v.get("compile_s") and v.get("graphs")
        ]
        if per_graph:
            return max(per_graph), str(path.relative_to(ROOT))
    return COMPILE_GRAPH_S, f"no GPU run stored: COMPILE_GRAPH_S = {COMPILE_GRAPH_S:.0f} s a graph"


def compile_guess(name: str, per_graph: float, shape: overhead.Shape) -> float:
    return layer_graphs(name, shape) * per_graph


def estimate(plan: Plan, sections: list[str], per_graph: float) -> dict:
    """Seconds per part of the plan, from its compiled graphs and ``per_graph`` seconds each."""
    e = ESTIMATE_S
    parts = {"startup": e["startup"]}
    if "gate" in sections:
        parts["gate"] = e["gate"]
    compiles = 0
    trainer_s = sum(
        min(TRAINER_TIMEOUT_S, e["trainer_start"] + plan.trainer_steps * e["trainer_step"]
            + compile_guess(TRAINER_MODELS.get(t, "baseline"), per_graph, plan.shape))
        for t in plan.trainer
    )  # fmt: skip
    for i, (batch, _, graphs) in enumerate(plan.cases if "step_ratios" in sections else []):
        names = plan.case_variants(i)
        compiles += sum(layer_graphs(n, plan.shape) for n in names)
        steps = (plan.warmup + plan.rounds) * 2 * e["step"] * batch / 4
        parts[case_name(*plan.cases[i])] = sum(
            compile_guess(n, per_graph, plan.shape) + steps + (e["capture"] if graphs else 0)
            for n in names
        )
        if i == 0 and "trainer" in sections:  # the Trainer runs after the first case
            parts["trainer"] = trainer_s
    if "trainer" in sections and "trainer" not in parts:
        parts["trainer"] = trainer_s
    return {"compiles": compiles, "parts_s": {k: round(v, 1) for k, v in parts.items()},
            "total_s": round(sum(parts.values()), 1)}  # fmt: skip


# ----------------------------------------------------------------------------------------------
# The correctness gate


def gate(res, device, plan: Plan, rec: Recorder):
    """Loss and every gradient of the routed model, Triton reads against the reference reads."""
    shape = plan.gate_shape
    candidate = "reference" if device.type == "cpu" else "triton"
    res["config"] = dict(vars(shape), dtype="float32", attn="sdpa", candidate=candidate,
                         against="reference", bounds=GATE_BOUNDS)  # fmt: skip
    if device.type == "cpu":
        res["note"] = "dry run: no Triton on the CPU, the reference against itself (the path only)"
    g = torch.Generator().manual_seed(2)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1], data[:, 1:].flatten()

    def run(name):
        model = overhead.build(name, shape, device, torch.float32, compile_=False, attn="sdpa")
        loss = F.cross_entropy(model(tokens).flatten(0, 1).float(), targets)
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}  # fmt: skip
        return loss.item(), grads

    res["variants"] = {}
    ok = True
    for v in plan.gate_variants:
        t0 = time.perf_counter()
        try:
            ref_loss, ref = run(f"{v}@reference")
            loss, got = run(f"{v}@{candidate}")
            worst = max(
                (((got[n] - ref[n]).norm() / ref[n].norm().clamp_min(1e-30)).item(), n)
                for n in ref
                if n in got
            )
            row = dict(loss=loss, loss_ref=ref_loss, loss_rel=abs(loss - ref_loss) / abs(ref_loss),
                       grad_rel_worst=worst[0], grad_worst_param=worst[1],
                       params=len(ref), missing=sorted(set(ref) ^ set(got)))  # fmt: skip
            row["ok"] = (row["loss_rel"] <= GATE_BOUNDS["loss_rel"] and not row["missing"]
                         and row["grad_rel_worst"] <= GATE_BOUNDS["grad_rel"])  # fmt: skip
        except Exception:  # noqa: BLE001 (recorded; the other variants still run)
            row = {"ok": False, "error": traceback.format_exc()[-3000:]}
        row["seconds"] = time.perf_counter() - t0
        ok &= row["ok"]
        res["variants"][v] = row
        print(f"[gate] {v}: {'ok' if row['ok'] else 'FAIL'} loss rel {row.get('loss_rel')}, "
              f"worst grad rel {row.get('grad_rel_worst')} ({row.get('grad_worst_param')})",
              flush=True)  # fmt: skip
        rec.save()
    res["all_ok"] = ok


# ----------------------------------------------------------------------------------------------
# Step ratios: one case at a time, one variant at a time


def _free(*objs) -> None:
    del objs
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _peak_reset(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return None


def _peak(device):
    return torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def _ratios(times, ref_times) -> dict:
    pct = [100 * (t / r - 1) for t, r in zip(times, ref_times, strict=True)]
    return {"overhead_vs_torchtitan_pct": pct,
            "median_overhead_vs_torchtitan_pct": statistics.median(pct),
            "ci95_overhead_vs_torchtitan_pct": list(overhead.median_interval(pct))}  # fmt: skip


def run_case(case, plan, batch, ac, graphs, names, device, dtype, pool, fail, profile, rec,
             deadline, per_variant_s):  # fmt: skip
    """The reference (torchtitan's decoder, when among ``names``) built first and kept; then
    each variant built, warmed, timed in rounds alternating with the reference, profiled (the
    first case), recorded, freed. The JSON is saved after each variant."""
    shape = overhead.Shape(plan.shape.layers, plan.shape.dim, plan.shape.seq, plan.shape.heads,
                           batch, plan.shape.vocab)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, shape.vocab, (batch, shape.seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].flatten().contiguous()
    variants = case["variants"] = {}
    ref_name = "torchtitan" if "torchtitan" in names else None
    ref = None

    def progress(msg):
        print(f"[step_ratios {case_name(batch, ac, graphs)}] {msg}", flush=True)

    def build_step(name):
        if fail and name == fail:
            raise RuntimeError(f"{name}: made to fail on purpose (--fail-variant {fail})")
        model = overhead.build(name, shape, device, dtype, plan.compile, ac=ac)
        step = overhead.Step(model, tokens, targets, False, graphs, pool=pool)
        return step

    for name in names:
        left = deadline - time.time()
        guess = per_variant_s(name)
        if left < guess:
            variants[name] = {"skipped": f"time budget: {left:.0f} s left, estimate {guess:.0f} s"}
            progress(f"{name}: skipped ({variants[name]['skipped']})")
            rec.save()
            continue
        row = variants[name] = {}
        step = None
        try:
            row["resident_bytes_before"] = _peak_reset(device)
            t0 = time.perf_counter()
            step = build_step(name)
            loss = step()  # the first call compiles (and, with graphs, the capture ran already)
            overhead._sync(device)
            row["compile_s"] = time.perf_counter() - t0
            row["graphs"] = layer_graphs(name, plan.shape)
            t0 = time.perf_counter()
            for _ in range(plan.warmup):
                loss = step()
            overhead._sync(device)
            row["warmup_s"] = time.perf_counter() - t0
            row["loss"] = loss.item()
            if not torch.isfinite(loss).item():
                raise RuntimeError(f"{name}: non-finite loss {loss.item()} before timing")
            times, ref_times = [], []
            for r in range(plan.rounds):  # the order alternates: reference first, then second
                pair = [(step, times)] + ([(ref, ref_times)] if ref is not None else [])
                for s, into in pair if r % 2 == 0 else pair[::-1]:
                    into.append(overhead._timed(s, device))
            row["step_s"] = times
            row["median_step_s"] = statistics.median(times)
            row["tokens_per_s"] = batch * shape.seq / row["median_step_s"]
            if ref is not None:
                row["ref_step_s"] = ref_times
                row.update(_ratios(times, ref_times))
            elif name == ref_name:
                row.update(_ratios(times, times))
            row["peak_bytes"] = _peak(device)
            if profile:
                row["profile_ms"] = profile_step(step, device)
            progress(f"{name}: compile {row['compile_s']:.1f} s, step {row['median_step_s']:.4f} s"
                     + (f", {row['median_overhead_vs_torchtitan_pct']:+.1f} % over torchtitan"
                        if ref is not None else ""))  # fmt: skip
        except Exception as e:  # noqa: BLE001 (recorded; the other variants go on)
            row["error"] = f"{type(e).__name__}: {e}"[:500]
            row["traceback"] = traceback.format_exc()[-3000:]
            row["peak_bytes"] = _peak(device)
            progress(f"{name}: FAILED {row['error']}")
        finally:
            if name == ref_name and "error" not in row:
                ref = step  # kept for the case
            else:
                step = None
                _free()
        rec.save()
    ref = None
    _free()
    _baseline_ratios(variants)


def _baseline_ratios(variants: dict) -> None:
    """Each variant over the baseline: the ratio of their medians over the reference."""
    base = variants.get("baseline", {}).get("median_overhead_vs_torchtitan_pct")
    for row in variants.values():
        pct = row.get("median_overhead_vs_torchtitan_pct")
        if base is not None and pct is not None:
            row["median_overhead_vs_baseline_pct"] = 100 * ((1 + pct / 100) / (1 + base / 100) - 1)


def step_ratios(res, device, plan: Plan, rec, deadline, fail, only=None, per_graph=None):
    """The cases ``only`` (indices into ``plan.cases``; default all) in turn. Each one after the
    first starts only if the time left covers its estimate from the first case's figures."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res.setdefault("config", dict(plan.config(), dtype=str(dtype)[6:]))
    cases = res.setdefault("cases", {})
    pool = None
    for i, (batch, ac, graphs) in enumerate(plan.cases):
        if only is not None and i not in only:
            continue
        name = case_name(batch, ac, graphs)
        names = plan.case_variants(i)
        if graphs and device.type != "cuda":
            cases[name] = {"skipped": "CUDA graphs need a CUDA device"}
            rec.save()
            continue
        per_variant = _per_variant_estimate(
            res, batch, graphs, per_graph or COMPILE_GRAPH_S, plan.shape
        )
        need = sum(per_variant(n) for n in names)
        left = deadline - time.time()
        if i > 0 and left < need:
            cases[name] = {"skipped": f"time budget: {left:.0f} s left, the first case's "
                           f"figures estimate {need:.0f} s"}  # fmt: skip
            print(f"[step_ratios] {name}: skipped ({cases[name]['skipped']})", flush=True)
            rec.save()
            continue
        if graphs and pool is None:
            pool = torch.cuda.graph_pool_handle()  # one pool for every capture
        case = cases[name] = {"estimate_s": round(need, 1)}
        t0 = time.perf_counter()
        profile = "profile" not in res and not graphs
        print(f"[step_ratios] {name}: {', '.join(names)} (estimate {need:.0f} s)", flush=True)
        try:
            run_case(case, plan, batch, ac, graphs, names, device, dtype, pool, fail, profile,
                     rec, deadline, per_variant)  # fmt: skip
        except Exception:  # noqa: BLE001 (recorded; the next case still runs)
            case["error"] = traceback.format_exc()[-3000:]
        case["seconds"] = time.perf_counter() - t0
        case["table"] = "\n".join(gpu_report.variant_table(case.get("variants", {})))
        done = case.get("variants", {})
        rows = {n: r["profile_ms"] for n, r in done.items() if "profile_ms" in r}
        if profile and rows:
            against = "torchtitan" if "torchtitan" in rows else None
            res["profile"] = dict(case=name, ms_by_class=rows,
                                  table=profile_table(rows, against))  # fmt: skip
        rec.save()  # the case whole in the file before it is said to be done
        print(f"[step_ratios] {name} done in {case['seconds']:.1f} s\n{case['table']}", flush=True)
        if "profile" in res and res["profile"]["case"] == name:
            print(f"[profile] {name}\n{res['profile']['table']}", flush=True)
        _reset_between_cases()


def _reset_between_cases():
    gc.collect()
    torch._dynamo.reset()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _per_variant_estimate(res, batch, graphs, per_graph, shape):
    """Seconds one variant of a case is expected to take: the first case's compile and step
    figures where measured (steps scaled by the batch), else its graphs at ``per_graph``."""
    first = next((c for c in res.get("cases", {}).values() if c.get("variants")), None)
    measured = {}
    if first is not None:
        b0 = int(next(iter(res["cases"])).split()[0].removeprefix("B="))
        for n, r in first["variants"].items():
            if r.get("compile_s") is not None:
                step = r.get("median_step_s", 0) * batch / max(b0, 1)
                measured[n] = r["compile_s"] + r.get("warmup_s", 0) + 2 * 12 * step
    e = ESTIMATE_S

    def guess(name):
        if name in measured:
            base = measured[name]
        elif measured:
            base = max(measured.values())
        else:
            base = compile_guess(name, per_graph, shape) + 24 * e["step"] * batch / 4
        return base + (e["capture"] if graphs else 0)

    return guess


# ----------------------------------------------------------------------------------------------
# The Trainer, streamed, with a timeout

_LOG = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def trainer(res, device, plan: Plan, tmp: Path, rec: Recorder, deadline):
    """Each config through the Trainer on the embedded corpus; the dry run: the same paper
    configs at the ``cpu_small`` flavor (``benchmarks.tiny_paper``), compiled with aot_eager."""
    from benchmarks.gpu_check import _corpus_env
    from titan_lrattnres.components import data

    env = {**os.environ, **_corpus_env()}  # a corpus of this Python's own (built when missing)
    cache = Path(env[data.CACHE_ENV]) if data.CACHE_ENV in env else None
    module = "benchmarks.tiny_paper" if plan.dry else "titan_lrattnres.train"
    runs = res["runs"] = {}
    for i, config in enumerate(plan.trainer):
        folder = tmp / f"trainer_{i}"
        batch = "2" if plan.dry else "4"  # one GPU: the paper's local batch, no accumulation
        cmd = [sys.executable, "-m", module, config, "--training.steps", str(plan.trainer_steps),
               "--checkpoint.no-enable", "--validator.no-enable", "--metrics.log_freq", "1",
               "--dump_folder", str(folder), "--dataloader.dataset", "stdlib_py",
               "--hf_assets_path", str(data.tokenizer_dir(cache)),
               "--training.local_batch_size", batch,
               "--training.global_batch_size", batch]  # fmt: skip
        if plan.dry:  # inductor on 2 CPU cores would take minutes; the compile path still runs
            cmd += ["--compile.backend", "aot_eager"]
        timeout = min(TRAINER_TIMEOUT_S * (3 if plan.dry else 1), deadline - time.time() - 5)
        run = runs[config] = {"cmd": " ".join(cmd[1:]), "timeout_s": round(timeout, 1)}
        if timeout < 30:
            run["skipped"] = f"time budget: {timeout + 5:.0f} s left"
            rec.save()
            continue
        run.update(stream(cmd, env, timeout, f"[trainer {config}]"))
        logged = run.pop("_logged")
        later = [r for r in logged if r[0] > 5] or logged
        run["tokens_per_s"] = statistics.median(r[1] for r in later) if later else None
        run["mfu_pct"] = statistics.median(r[2] for r in later) if later else None
        run["steps_logged"] = len(logged)
        if run["returncode"] != 0 and "error" not in run:
            run["error"] = f"exit status {run['returncode']}"
        print(f"[trainer] {config}: rc {run['returncode']}, {run['seconds']:.0f} s, tps "
              f"{run['tokens_per_s']}, mfu {run['mfu_pct']}", flush=True)  # fmt: skip
        rec.save()
    if any("error" in r for r in runs.values()):
        res["error"] = "; ".join(f"{c}: {r['error']}" for c, r in runs.items() if "error" in r)


def stream(cmd, env, timeout, prefix) -> dict:
    """Run ``cmd`` in its own process group, print its lines as they come (prefixed), keep
    the last 40, stop it at ``timeout`` seconds."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, bufsize=1, errors="replace",
                            start_new_session=True)  # fmt: skip
    _CHILDREN.append(proc)
    tail: collections.deque[str] = collections.deque(maxlen=40)
    logged: list[tuple[int, float, float]] = []

    def read():
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            m = _LOG.search(line)
            if m:
                logged.append((int(m[1]), float(m[2].replace(",", "")), float(m[3])))
            if not re.match(r"\[rank\d+\]:[WI]\d{4} ", line):  # no torch warnings
                print(prefix, line, flush=True)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = {}
    try:
        out["returncode"] = proc.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        _kill(proc)
        out["returncode"] = proc.wait()
        out["error"] = f"timed out after {timeout:.0f} s"
    reader.join(timeout=5)
    _CHILDREN.remove(proc)
    out.update(seconds=time.perf_counter() - t0, tail="\n".join(tail)[-2000:], _logged=logged)
    return out


# ----------------------------------------------------------------------------------------------


def targets(result: dict) -> list[dict]:
    out = []
    for name, case in result.get("step_ratios", {}).get("cases", {}).items():
        if not name.startswith("B=4 AC=selective"):
            continue
        for variant, r in (case.get("variants") or {}).items():
            pct = r.get("median_overhead_vs_torchtitan_pct") if isinstance(r, dict) else None
            if pct is None or variant in ("torchtitan", "baseline"):
                continue
            bound = BOUNDS.get(variant, 5.0)
            out.append(dict(target=f"{variant} <= +{bound:.0f} % over torchtitan ({name})",
                            measured=round(pct, 2), ok=pct <= bound))  # fmt: skip
    runs = result.get("trainer", {}).get("runs", {})
    tps = [runs.get(c, {}).get("tokens_per_s") for c in ("paper_baseline", *TRAINER_MODELS)]
    if all(tps):
        ratio = tps[1] / tps[0]
        out.append(dict(target="Trainer tokens/s routed >= 0.95 x baseline",
                        measured=round(ratio, 3), ok=ratio >= 0.95))  # fmt: skip
    return out


def _versions() -> dict:
    from benchmarks.gpu_check import _versions as versions

    return versions()


SECTIONS = ("gate", "step_ratios", "trainer")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json_path", nargs="?", default=None)
    p.add_argument("--dry-run", action="store_true", help="the same plan at tiny shapes on CPU")
    p.add_argument("--sections", default=",".join(SECTIONS), help="subset of " + ",".join(SECTIONS))
    p.add_argument("--cases", default=None, help=f"BATCH:AC[:graphs],... (default {CASES})")
    p.add_argument("--variants", default=None, help="the same variants in every case")
    p.add_argument("--fail-variant", default=os.environ.get("GPU_SPEED_FAIL_VARIANT"),
                   help="make this variant fail on purpose (the others must stay)")  # fmt: skip
    p.add_argument("--estimate-only", action="store_true", help="print the plan's estimate")
    args = p.parse_args(argv)
    dry = args.dry_run
    sections = [s for s in args.sections.split(",") if s]
    if set(sections) - set(SECTIONS):
        p.error(f"unknown sections {sorted(set(sections) - set(SECTIONS))}")
    plan = Plan(dry, args.cases, args.variants)
    per_graph, source = stored_compile_seconds()
    # the estimate is the GPU plan's (the dry run runs the same plan: the same compile counts)
    gpu_plan = Plan(False, args.cases, args.variants) if dry else plan
    est = estimate(gpu_plan, sections, per_graph)
    print(f"[gpu_speed] plan: {', '.join(sections)}; cases {', '.join(plan.config()['cases'])}",
          flush=True)  # fmt: skip
    print(f"[gpu_speed] estimate on the GPU {est['total_s']:.0f} s of "
          f"{os.environ.get('GPU_CHECK_SECONDS', '525')} s, {est['compiles']} layer graphs "
          f"(compile seconds from {source}): {est['parts_s']}", flush=True)  # fmt: skip
    if args.estimate_only:
        return 0
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device here: use --dry-run (tiny shapes on CPU)")
    device = torch.device("cpu" if dry else "cuda")
    default = "gpu_speed_dry_run_cpu.json" if dry else "gpu_speed.json"
    path = Path(args.json_path or Path("benchmarks/results") / default)
    deadline = float(os.environ.get("GPU_CHECK_END", time.time() + 525)) - MARGIN_S
    # many models of one code object in one process: the benchmark's own artefact, not a user's
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    env = meta.environment(device)
    env["code"] = os.environ.get("LRATTNRES_COMMIT") or env["code"]
    result = {"device": str(device), "dry_run": dry, **env, "versions": _versions(),
              "plan": plan.config(), "estimate": dict(est, compile_seconds_from=source),
              "fail_variant": args.fail_variant, "deadline_unix": deadline}  # fmt: skip
    if dry:
        result["note"] = "CPU dry run at tiny shapes: checks that the plan runs; no GPU figure"
    rec = Recorder(path, result)
    rec.save()
    on_sigterm(rec)
    tmp = Path(tempfile.mkdtemp(prefix="gpu_speed_"))
    t_start = time.perf_counter()

    def section(name, fn):
        if name not in sections:
            return
        res = result.setdefault(name, {})
        t0 = time.perf_counter()
        if time.time() > deadline - 20 and name != "step_ratios":  # it skips case by case
            res["skipped"] = "time budget"
        else:
            try:
                fn(res)
            except Exception:  # noqa: BLE001 (recorded; the other sections still run)
                res["error"] = traceback.format_exc()[-4000:]
        result[name + "_seconds"] = result.get(name + "_seconds", 0) + time.perf_counter() - t0
        result["targets"] = [] if dry else targets(result)
        result["total_seconds"] = time.perf_counter() - t_start
        rec.save()
        print(f"[gpu_speed] {name}: {time.perf_counter() - t0:.1f} s", flush=True)

    def ratios(only):
        return lambda res: step_ratios(res, device, plan, rec, deadline, args.fail_variant,
                                       only=only, per_graph=per_graph)  # fmt: skip

    section("gate", lambda res: gate(res, device, plan, rec))
    section("step_ratios", ratios({0}))
    section("trainer", lambda res: trainer(res, device, plan, tmp, rec, deadline))
    section("step_ratios", ratios(set(range(1, len(plan.cases)))))
    for t in result.get("targets", []):
        print(f"[target] {'met ' if t['ok'] else 'MISS'} {t['target']}: {t['measured']}")
    failed = [n for n in sections if "error" in result.get(n, {})]
    failed += ["gate"] if result.get("gate", {}).get("all_ok") is False else []
    failed += [f"step_ratios {c}/{v}" for c, case in result.get("step_ratios", {})
               .get("cases", {}).items() for v, r in (case.get("variants") or {}).items()
               if "error" in r]  # fmt: skip
    print(
        f"[gpu_speed] wrote {path}; {result.get('total_seconds', 0):.0f} s; "
        f"{'OK' if not failed else 'FAILED: ' + ', '.join(dict.fromkeys(failed))}"
    )
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
