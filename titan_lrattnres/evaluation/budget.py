"""The comparison at a matched budget: validation loss against tokens and against training time.

    python -m titan_lrattnres.sweep --budget [--configs a,b,c] [--steps 2000] [--val-every 200] \
        [--seeds 0,1] [--out DIR] [--allow-busy] [--dry-run] [--section.field VALUE ...]
        (any other argument is passed to every training run)

Every config (default: the baseline at the shared rate 3e-3 and at 1e-3, the rate it does best
at in the 200-step learning-rate check, standard Full, standard Block N=4, S-LR and P-LR Block
N=4) is trained once per seed for the same ``--steps`` (default 2,000: 4.1M tokens of the
``cpu_default`` recipe), one process at a time, into ``OUT/CONFIG_seedS``. The learning-rate
schedule follows the run's length (its decay spans every step after warmup). Each run validates
every ``--val-every`` steps and at its end on the same held-out batches; a checkpoint is saved at
the end only. A finished run (``summary.json`` and ``budget_run.json`` of the same steps, seed and
interval) is reused, so an interrupted sweep continues where it stopped.

Per validation point the trainer records the tokens seen, the training seconds (since the first
step, whose compile is left out; validation and checkpoint saves are left out too) and each
held-out batch's mean loss (:class:`titan_lrattnres.training.trainer.EndValidator`).
Throughput is tokens over those seconds. It is only worth something on an idle machine: before
each run the sweep measures how many cores other processes use (``/proc/stat``, 2 s) and refuses
to start above 0.25 (``--allow-busy`` goes on, with a warning); during the run it records the
CPU time that other processes took (all CPU time minus the run's own), shown in the report.

Writes ``OUT/budget.md`` (one row per config: final loss, paired Δ against the reference
baseline, throughput ratio, tokens and seconds to reach the reference's final loss),
``OUT/budget.json`` (every run with its points) and ``OUT/budget.png`` (validation loss against
tokens and against seconds, one line per config, the mean over seeds). The reference is the
baseline config with the lowest final loss; every comparison pairs runs of the same seed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from titan_lrattnres.evaluation.machine import (
    BUSY_CORES,
    busy_cores,
    machine_name,
    measured_alone,
    run_training,
)
from titan_lrattnres.evaluation.sweep import (
    DEFAULT_CONFIGS,
    _fmt,
    available_configs,
    ci95,
    config_lr,
    label,
    train_command,
    train_env,
)

BUDGET_CONFIGS = (*DEFAULT_CONFIGS, "cpu_default_baseline_lr1e-3")


def run_record(summary: dict, meta: dict) -> dict:
    """One run: its identity, throughput and validation points (with per-batch losses)."""
    points = [
        {k: v.get(k) for k in ("step", "tokens", "train_s", "loss", "batch_losses")}
        for v in summary.get("val_history", [])
    ]
    return {
        **meta,
        "lr": config_lr(meta["config"]),
        **{k: summary.get(k) for k in ("variant", "blocks", "block_layers", "rank")},
        "tokens_per_s": summary.get("tokens_per_s"),
        "points": points,
    }


def crossing(points: list[dict], target: float, axis: str) -> float | None:
    """The first ``axis`` value (tokens or train_s) at which the loss reaches ``target``,
    interpolated linearly between the validation points around it; None if never."""
    prev = None
    for p in points:
        if p["loss"] is None or p[axis] is None:
            continue
        if p["loss"] <= target:
            if prev is None or prev["loss"] == p["loss"]:
                return float(p[axis])
            f = (prev["loss"] - target) / (prev["loss"] - p["loss"])
            return prev[axis] + f * (p[axis] - prev[axis])
        prev = p
    return None


def _final(run: dict) -> dict:
    return run["points"][-1] if run["points"] else {}


def summarize(runs: list[dict]) -> tuple[list[dict], str | None]:
    """One row per config (mean over its seeds) and the reference config's name."""
    by_config: dict[str, dict[int, dict]] = {}
    for r in runs:
        by_config.setdefault(r["config"], {})[r["seed"]] = r
    finals = {
        c: sum(_final(r).get("loss") or math.inf for r in s.values()) / len(s)
        for c, s in by_config.items()
    }
    baselines = [c for c, s in by_config.items() if next(iter(s.values()))["variant"] == "baseline"]
    ref = min(baselines, key=finals.get) if baselines else None
    ref_runs = by_config.get(ref, {})
    ref_tok_s = _mean([r["tokens_per_s"] for r in ref_runs.values()])
    rows = []
    for config, seeds in by_config.items():
        first = next(iter(seeds.values()))
        batches = [_final(r).get("batch_losses") for r in seeds.values()]
        row = {
            "config": config,
            "lr": first["lr"],
            **{k: first[k] for k in ("variant", "blocks", "block_layers", "rank")},
            "seeds": sorted(seeds),
            "final_loss_per_seed": [_final(seeds[s]).get("loss") for s in sorted(seeds)],
            "tokens": _mean([_final(r).get("tokens") for r in seeds.values()]),
            "train_s": _mean([_final(r).get("train_s") for r in seeds.values()]),
            "tokens_per_s": _mean([r["tokens_per_s"] for r in seeds.values()]),
            "other_cores": max((r.get("other_cores") or 0.0 for r in seeds.values()), default=0),
            "alone": all(measured_alone(r) for r in seeds.values()),
        }
        row["final_loss"], row["final_ci95"] = _seed_mean_ci(batches)
        row["tokens_per_s_ratio"] = (
            row["tokens_per_s"] / ref_tok_s if row["tokens_per_s"] and ref_tok_s else None
        )
        pairs = [(seeds[s], ref_runs[s]) for s in sorted(seeds) if s in ref_runs]
        diffs = []
        for r, q in pairs:
            mine, theirs = _final(r).get("batch_losses"), _final(q).get("batch_losses")
            if mine and theirs and len(mine) == len(theirs):
                diffs.append([a - b for a, b in zip(mine, theirs)])
        row["delta"], row["delta_ci95"] = _seed_mean_ci(diffs) if diffs else (None, None)
        for axis in ("tokens", "train_s"):
            reached = [crossing(r["points"], _final(q)["loss"], axis) for r, q in pairs]
            totals = [_final(q)[axis] for _, q in pairs]
            done = [x / t for x, t in zip(reached, totals) if x is not None and t]
            row[f"reach_{axis}_per_seed"] = reached
            row[f"reach_{axis}_frac"] = (
                sum(done) / len(done) if pairs and len(done) == len(pairs) else None
            )
        row["reached_seeds"] = sum(x is not None for x in row["reach_tokens_per_seed"])
        row["paired_seeds"] = len(pairs)
        rows.append(row)
    return rows, ref


def _mean(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def _seed_mean_ci(per_seed: list[list[float] | None]) -> tuple[float | None, float | None]:
    """Mean and 95 % CI over batches of the per-batch values averaged over seeds."""
    per_seed = [b for b in per_seed if b]
    if not per_seed or len({len(b) for b in per_seed}) != 1:
        return None, None
    return ci95([sum(v) / len(v) for v in zip(*per_seed)])


def markdown(rows: list[dict], ref: str | None, meta: dict) -> str:
    ref_label = next((label(r) + f" (lr {r['lr']:g})" for r in rows if r["config"] == ref), "-")
    head = (
        f"# Matched budget: loss against tokens and against time\n\n"
        f"Machine: {meta['machine']}. Every run: {meta['steps']:,} steps "
        f"({meta['tokens']:,.0f} tokens), validated every {meta['val_every']} steps on the same "
        f"{meta['val_batches']} held-out batches; seeds {', '.join(map(str, meta['seeds']))}; "
        "one run at a time.\n\n"
        f"Reference: {ref_label}, the baseline with the lowest final loss. Final loss: the mean "
        "over seeds and held-out batches, ± 1.96·std/sqrt(n) over the batches of the "
        "seed-averaged losses; Δ: the same over the per-batch differences to the reference run of "
        "the same seed. Tokens/s: training tokens over training seconds (validation, checkpoint "
        "saves and the first step's compile left out). To reach: the tokens and seconds a run "
        "takes to reach its seed's reference final loss (linear between validation points), as a "
        "fraction of the reference's; the mean over seeds, or 'not reached' when a seed does not. "
        "Others' CPU: the most that other processes used during any of a config's runs, in "
        "cores.\n\n"
    )
    lines = [
        "| model | config | lr | final val loss | per seed | Δ vs reference | tokens/s | "
        "× reference | tokens to reach | time to reach | others' CPU |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        loss = _fmt(r["final_loss"], ".4f") + (
            f" ± {r['final_ci95']:.4f}" if r["final_ci95"] is not None else ""
        )
        delta = _fmt(r["delta"], "+.4f") + (
            f" ± {r['delta_ci95']:.4f}" if r["delta_ci95"] is not None else ""
        )
        reach = {
            a: "-" if r["config"] == ref
            else _fmt(r[f"reach_{a}_frac"], ".2f") + "×"
            if r[f"reach_{a}_frac"] is not None
            else f"not reached ({r['reached_seeds']}/{r['paired_seeds']} seeds)"
            for a in ("tokens", "train_s")
        }  # fmt: skip
        lines.append(
            f"| {label(r)} | {r['config']} | {_fmt(r['lr'], 'g')} | {loss} | "
            f"{' / '.join(_fmt(x, '.4f') for x in r['final_loss_per_seed'])} | {delta} | "
            f"{_fmt(r['tokens_per_s'], ',.0f')} | {_fmt(r['tokens_per_s_ratio'], '.3f')} | "
            f"{reach['tokens']} | {reach['train_s']} | {_fmt(r['other_cores'], '.2f')} |"
        )
    busy = [r["config"] for r in rows if not r["alone"]]
    warn = (
        f"\n**Throughput not alone**: other processes used more than {BUSY_CORES} cores before "
        f"or during runs of {', '.join(busy)}; their tokens/s and times are not comparable.\n"
        if busy
        else ""
    )
    return head + "\n".join(lines) + "\n" + warn


def plot(runs: list[dict], rows: list[dict], ref: str | None, path: Path) -> Path:
    """Validation loss against tokens and against training seconds, mean over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), sharey=True)
    for row in rows:
        seeds = [r for r in runs if r["config"] == row["config"]]
        n = min(len(r["points"]) for r in seeds)
        if n == 0:
            continue
        loss = [_mean([r["points"][i]["loss"] for r in seeds]) for i in range(n)]
        name = f"{label(row)}, lr {row['lr']:g}" if row["lr"] else label(row)
        for ax, axis, scale in ((axes[0], "tokens", 1e6), (axes[1], "train_s", 1.0)):
            x = [_mean([r["points"][i][axis] for r in seeds]) / scale for i in range(n)]
            ax.plot(x, loss, marker="o", ms=3, lw=1.4, ls="--" if row["config"] == ref else "-",
                    label=name)  # fmt: skip
    ref_row = next((r for r in rows if r["config"] == ref), None)
    for ax, xlabel in zip(axes, ("training tokens (millions)", "training seconds")):
        if ref_row is not None and ref_row["final_loss"] is not None:
            ax.axhline(ref_row["final_loss"], c="gray", lw=0.8, ls=":")
        ax.set_xlabel(xlabel)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("validation loss (mean over seeds)")
    axes[0].set_title("matched tokens")
    axes[1].set_title("matched time (validation and saves excluded)")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(runs: list[dict], out: Path, meta: dict) -> list[dict]:
    rows, ref = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / "budget.md").write_text(markdown(rows, ref, meta))
    body = {"meta": meta, "reference": ref, "rows": rows, "runs": runs}
    (out / "budget.json").write_text(json.dumps(body, indent=2) + "\n")
    plot(runs, rows, ref, out / "budget.png")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.sweep --budget",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--configs", default=",".join(BUDGET_CONFIGS), help="comma list of names")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--val-every", type=int, default=200)
    p.add_argument("--seeds", default="0,1", help="comma list of integers")
    p.add_argument("--out", default="runs/budget")
    p.add_argument("--allow-busy", action="store_true",
                   help="train even when other processes use the CPU (warns)")  # fmt: skip
    p.add_argument("--dry-run", action="store_true", help="print the commands, train nothing")
    ns, extra = p.parse_known_args(argv)
    if ns.steps < 1 or ns.val_every < 1:
        p.error("--steps and --val-every must be positive")
    try:
        seeds = [int(s) for s in ns.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes a comma list of integers, not {ns.seeds!r}")
    names = [c for c in ns.configs.split(",") if c]
    unknown = sorted(set(names) - available_configs())
    if unknown:
        p.error(f"not train_configs names: {', '.join(unknown)}")
    out = Path(ns.out)
    env = train_env()
    runs = []
    for name in names:
        for seed in seeds:
            run = out / f"{name}_seed{seed}"
            want = {"config": name, "seed": seed, "steps": ns.steps, "val_every": ns.val_every}
            overrides = [
                *("--training.steps", str(ns.steps), "--validator.freq", str(ns.val_every)),
                *("--debug.seed", str(seed), "--checkpoint.interval", str(ns.steps)),
            ]
            cmd = train_command(name, run, 1, [*extra, *overrides])
            meta_file, summary_file = run / "budget_run.json", run / "summary.json"
            if summary_file.is_file() and meta_file.is_file():
                meta = json.loads(meta_file.read_text())
                if {k: meta.get(k) for k in want} != want:
                    raise SystemExit(f"{run} holds another run ({meta}); use another --out")
                print(f"reuse {run}")
            elif ns.dry_run:
                print(" ".join(cmd))
                continue
            else:
                busy = busy_cores()
                if busy is not None and busy > BUSY_CORES:
                    line = (f"the machine is busy: other processes use {busy:.2f} cores (over "
                            f"{BUSY_CORES}); throughput would not be the run's own")  # fmt: skip
                    if not ns.allow_busy:
                        raise SystemExit(f"{line}; stop them or pass --allow-busy")
                    print(f"WARNING: {line}", flush=True)
                print("$ " + " ".join(cmd), flush=True)
                rc, other = run_training(cmd, env)
                if rc != 0 or not summary_file.is_file():
                    raise SystemExit(f"{name} seed {seed} failed (exit {rc}): no {summary_file}")
                meta = {**want, "busy_cores_before": busy, "other_cores": other}
                meta_file.write_text(json.dumps(meta, indent=2) + "\n")
            runs.append(run_record(json.loads(summary_file.read_text()), meta))
    if not runs:
        return 0
    batches = {len(_final(r).get("batch_losses") or []) for r in runs}
    meta = {
        "machine": machine_name(),
        "steps": ns.steps,
        "val_every": ns.val_every,
        "seeds": seeds,
        "tokens": _mean([_final(r).get("tokens") for r in runs]) or 0,
        "val_batches": max(batches),
        "python": sys.version.split()[0],
    }
    write_report(runs, out, meta)
    print((out / "budget.md").read_text())
    return 0
