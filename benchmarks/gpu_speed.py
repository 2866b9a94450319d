"""The GPU run that measures training speed as users train (``benchmarks/gpu_check.sh --speed``;
docs/gpu-check.md). Two sections, each written to the JSON as it finishes:

1. ``step_ratios``: ``benchmarks.overhead.measure`` at the paper's shape (L=24 d=1024 T=2048,
   16 heads, vocabulary 100,277, bf16, FlexAttention, every ``model.layers`` entry compiled as
   torchtitan compiles it): torchtitan's own decoder of that shape (``torchtitan``), the
   project's baseline and the routed variants, in interleaved rounds, one case after another:
   ``GPU_SPEED_CASES`` (default ``4:selective,4:selective:graphs,4:none,1:none,1:none:graphs``:
   local batch, activation checkpointing, ``graphs`` = the whole step in a CUDA graph). The
   first case is the one the paper's configs train with (no CUDA graphs). Cases the budget does
   not reach are recorded as skipped. After the first case's rounds, one step of each of its
   models under ``torch.profiler`` (``profile``): GPU time by kernel class
   (``benchmarks.step_profile``: matmuls, attention, the depth reads' Triton kernels,
   Inductor's fused kernels, the rest) and each routed variant's difference to torchtitan's
   decoder, class by class.
2. ``trainer``: the real Trainer, ``paper_baseline`` and ``paper_sliced_block8_r64`` for
   ``GPU_SPEED_STEPS`` steps (default 30) each on the embedded corpus, local batch 4 x 2048 with
   no gradient accumulation (one GPU): torchtitan's logged tokens per second and MFU, medians
   over the steps after the first five.

Targets (``targets`` in the JSON, against this run's numbers): at the first case, standard Block,
S-LR and P-LR Block N=8 within +5 % of torchtitan's decoder and Full within +15 %; the same with
CUDA graphs; the routed Trainer's tokens/s within 5 % of the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from benchmarks import meta, overhead
from benchmarks.step_profile import profile_table

VARIANTS = ("torchtitan", "baseline", "block8", "sliced8_r64", "projected8_r32", "full")
CASES = "4:selective,4:selective:graphs,4:none,1:none,1:none:graphs"
BOUNDS = {"full": 15.0}  # % over torchtitan's decoder; every other routed variant: 5 %
TRAINER = ("paper_baseline", "paper_sliced_block8_r64")


def parse_cases(text: str) -> list[tuple[int, str, bool]]:
    """``"4:selective,1:none:graphs"`` -> ``[(4, "selective", False), (1, "none", True)]``."""
    cases = []
    for item in filter(None, text.split(",")):
        parts = item.split(":")
        if (
            len(parts) not in (2, 3)
            or parts[1] not in overhead.AC_MODES
            or parts[2:] not in ([], ["graphs"])
        ):
            raise ValueError(f"bad case {item!r}: BATCH:{'|'.join(overhead.AC_MODES)}[:graphs]")
        cases.append((int(parts[0]), parts[1], parts[2:] == ["graphs"]))
    return cases


def case_name(batch: int, ac: str, graphs: bool) -> str:
    return f"B={batch} AC={ac}" + (" CUDA graphs" if graphs else "")


def _plan(dry: bool):
    """``(shape, rounds, cases, variants)``: the paper's shape and the environment's choice, or
    the dry run's tiny ones."""
    if dry:
        shape = overhead.Shape(4, 64, 32, heads=4, vocab=256)
        variants = ("torchtitan", "baseline", "sliced2_r32", "full")
        return shape, 2, [(2, "none", False), (2, "selective", False)], variants
    shape = overhead.Shape(24, 1024, 2048, heads=16, vocab=100277)
    cases = parse_cases(os.environ.get("GPU_SPEED_CASES", CASES))
    variants = tuple(os.environ.get("GPU_SPEED_VARIANTS", ",".join(VARIANTS)).split(","))
    return shape, 10, cases, variants


def step_ratios(res, device, dry, deadline):
    """Each case in turn; the first one timed also profiles one step per variant (the models
    it built and warmed: ``res["profile"]``)."""
    shape, rounds, cases, variants = _plan(dry)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    res["config"] = dict(layers=shape.layers, dim=shape.dim, seq=shape.seq, heads=shape.heads,
                         vocab=shape.vocab, hidden=shape.hidden_dim, dtype=str(dtype)[6:],
                         rounds=rounds, variants=variants, compile=not dry)  # fmt: skip
    res["cases"] = {}
    for batch, ac, graphs in cases:
        name = case_name(batch, ac, graphs)
        if graphs and device.type != "cuda":
            res["cases"][name] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        if time.time() > deadline - 60:
            res["cases"][name] = {"skipped": "time budget"}
            continue
        case = res["cases"][name] = {}
        profile = "profile" not in res and not graphs
        try:
            case["result"] = overhead.measure(
                overhead.Shape(shape.layers, shape.dim, shape.seq, shape.heads, batch,
                               shape.vocab),
                device=device, dtype=dtype, variants=variants, rounds=rounds, warmup=3,
                cuda_graphs=graphs, compile_=not dry, ac=ac, profile=profile,
                progress=lambda m, n=name: print(f"[step_ratios {n}]", m, flush=True),
            )  # fmt: skip
            case["table"] = overhead.table(case["result"])
            print(f"[step_ratios] {name}\n{case['table']}", flush=True)
            if profile:
                rows = case["result"].pop("_profile_ms")
                table = profile_table(rows)
                res["profile"] = dict(case=name, ms_by_class=rows, table=table)
                print(f"[profile] {name}\n{table}", flush=True)
        except Exception:  # noqa: BLE001 (recorded; the next case still runs)
            case["error"] = traceback.format_exc()[-3000:]


_LOG = re.compile(r"step:\s*(\d+).*?tps:\s*([\d,]+).*?mfu:\s*([\d.]+)%")


def trainer(res, device, dry, tmp: Path):
    """Each config through ``python -m titan_lrattnres.train`` on the embedded corpus."""
    from benchmarks.gpu_check import _corpus_env
    from titan_lrattnres.components import data

    steps = 3 if dry else int(os.environ.get("GPU_SPEED_STEPS", "30"))
    configs = ("cpu_smoke",) if dry else TRAINER  # the dry run: the command and its parsing
    env = {**os.environ, **_corpus_env()}  # a corpus of this Python's own (built when missing)
    cache = Path(env[data.CACHE_ENV]) if data.CACHE_ENV in env else None
    res["runs"] = {}
    for i, config in enumerate(configs):
        folder = tmp / f"trainer_{i}"
        cmd = [sys.executable, "-m", "titan_lrattnres.train", config, "--training.steps",
               str(steps), "--checkpoint.no-enable", "--validator.no-enable",
               "--metrics.log_freq", "1", "--dump_folder", str(folder),
               "--dataloader.dataset", "stdlib_py",
               "--hf_assets_path", str(data.tokenizer_dir(cache))]  # fmt: skip
        if not dry:  # one GPU: the paper's local batch, no gradient accumulation
            cmd += ["--training.local_batch_size", "4", "--training.global_batch_size", "4"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        out = proc.stdout + proc.stderr
        logged = [(int(s), float(t.replace(",", "")), float(m)) for s, t, m in _LOG.findall(out)]
        later = [r for r in logged if r[0] > 5] or logged
        run = res["runs"][config] = {
            "cmd": " ".join(cmd[1:]), "returncode": proc.returncode,
            "seconds": time.perf_counter() - t0, "tail": out[-1500:],
            "tokens_per_s": statistics.median(r[1] for r in later) if later else None,
            "mfu_pct": statistics.median(r[2] for r in later) if later else None,
        }  # fmt: skip
        print(f"[trainer] {config}: rc {proc.returncode}, tps {run['tokens_per_s']}, "
              f"mfu {run['mfu_pct']}", flush=True)  # fmt: skip


def targets(result: dict) -> list[dict]:
    out = []
    for name, case in result.get("step_ratios", {}).get("cases", {}).items():
        if not name.startswith("B=4 AC=selective"):
            continue
        for variant, r in case.get("result", {}).items():
            pct = r.get("median_overhead_vs_torchtitan_pct") if isinstance(r, dict) else None
            if pct is None or variant in ("torchtitan", "baseline"):
                continue
            bound = BOUNDS.get(variant, 5.0)
            out.append(dict(target=f"{variant} <= +{bound:.0f} % over torchtitan ({name})",
                            measured=round(pct, 2), ok=pct <= bound))  # fmt: skip
    runs = result.get("trainer", {}).get("runs", {})
    tps = [runs.get(c, {}).get("tokens_per_s") for c in TRAINER]
    if all(tps):
        ratio = tps[1] / tps[0]
        out.append(dict(target="Trainer tokens/s routed >= 0.95 x baseline",
                        measured=round(ratio, 3), ok=ratio >= 0.95))  # fmt: skip
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json_path", nargs="?", default=None)
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU, end to end")
    p.add_argument("--sections", default="step_ratios,trainer")
    args = p.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        p.error("no CUDA device here: use --dry-run (tiny shapes on CPU)")
    device = torch.device("cpu" if dry else "cuda")
    default = "gpu_speed_dry_run_cpu.json" if dry else "gpu_speed.json"
    path = Path(args.json_path or Path("benchmarks/results") / default)
    deadline = float(os.environ.get("GPU_CHECK_END", time.time() + 540))
    result = {"device": str(device), "dry_run": dry, **meta.environment(device)}
    tmp = Path(tempfile.mkdtemp(prefix="gpu_speed_"))
    sections = {
        "step_ratios": lambda res: step_ratios(res, device, dry, deadline),
        "trainer": lambda res: trainer(res, device, dry, tmp),
    }
    for name in [s for s in args.sections.split(",") if s]:
        res = result[name] = {}
        t0 = time.perf_counter()
        if time.time() > deadline - 20:
            res["skipped"] = "time budget"
        else:
            try:
                sections[name](res)
            except Exception:  # noqa: BLE001 (recorded; the other sections still run)
                res["error"] = traceback.format_exc()[-4000:]
        result[name + "_seconds"] = time.perf_counter() - t0
        result["targets"] = [] if dry else targets(result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1, default=str))
    for t in result["targets"]:
        print(f"[target] {'met ' if t['ok'] else 'MISS'} {t['target']}: {t['measured']}")
    failed = [n for n in sections if "error" in result.get(n, {})]
    print(f"[gpu_speed] wrote {path}; {'OK' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    raise SystemExit(main())
