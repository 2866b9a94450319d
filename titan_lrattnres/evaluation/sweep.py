"""Variant sweep at matched tokens, data and seed: train, evaluate, tabulate, plot (cf. Figure 1).

    python -m titan_lrattnres.sweep [--configs a,b,c] [--out DIR] [--nproc N] [--dry-run] \
        [--merge OLD/sweep.json] [--section.field VALUE ...]
        (any other argument is passed to every training run)

Each config (a name from ``train_configs``) is trained into ``OUT/NAME`` with
``python -m titan_lrattnres.train NAME --dump_folder OUT/NAME`` (``torchrun --standalone
--nproc_per_node N -m titan_lrattnres.train ...`` for N > 1), unless that folder already holds a
``summary.json`` (a finished run is reused). Then, per run:

- validation loss recomputed from the newest checkpoint over the held-out split: per-batch mean
  cross-entropy over ``--val-batches`` batches of the run's ``[local_batch_size, seq_len]``,
  reported as mean ± 1.96·std/sqrt(n) (falls back to the trainer's ``final_val_loss``, no CI,
  when no validation text is available);
- added FLOPs % (docs/method.md §5, ``titan_lrattnres.model.flops.added_flops_percent``),
  parameters and tokens/s (the run's ``summary.json``). Tokens/s is shown only for a run measured
  alone: before each run the sweep measures the cores other processes use, and during it the CPU
  time they take (:mod:`titan_lrattnres.evaluation.machine`, kept in the run's
  ``machine_load.json``); above 0.25 cores, or for a run without that record, the column says
  ``-`` and the JSON keeps the figure;
- peak memory per rank of one training step as :mod:`titan_lrattnres.evaluation.memory` (the
  model behind ``python -m benchmarks.memory``) predicts it for
  the run's shape (flavor, variant, blocks, rank, seq, local batch; AC mode, parameter dtype,
  optimizer and loss of the run's config; FSDP size = its data-parallel degree), computed once
  per distinct shape (``--no-memory``: not at all). The process's peak RSS, which the trainer
  writes into ``summary.json`` (``peak_rss_mib``: the whole process, allocator caches and
  libraries included), stays in ``sweep.json`` as ``peak_rss_mib``. A prediction that fails
  leaves ``-`` in its row and a line under the table naming the error.

Writes ``OUT/sweep.md``, ``OUT/sweep.json`` and ``OUT/sweep.png`` (validation loss vs added
FLOPs %, one labelled point per variant, 95% CI error bars). When the configs hold one model at
several learning rates (``cpu_default_*_lr*``), ``sweep.md`` (and ``sweep_best_lr.json``) add
each model at its best rate with the paired difference to the baseline at ITS best rate, and
``sweep.png`` shows those rows.
``--decode FILE`` (from ``python -m benchmarks.decode --json``) and ``--longctx FILE``
(``longctx.json`` of ``python -m titan_lrattnres.longctx``) add their columns: decode latency
per token over the baseline (batch 1 and 8; per model), and per trained run the loss in the last
quarter of a 4x-training-length input minus its loss at 1x (extrapolation) and the copy probe's
gain (first minus second occurrence loss) at the longest gap. ``--merge OLD/sweep.json`` adds the
rows of an earlier sweep (runs that need not be on this machine: their per-batch losses are in the
JSON) to this one's, in the earlier order, new configs after; a config in both takes this run's.

``python -m titan_lrattnres.sweep --budget ...`` is the comparison at a matched budget, loss
against tokens and against time, several seeds (:mod:`titan_lrattnres.evaluation.budget`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from titan_lrattnres.evaluation.machine import (
    BUSY_CORES,
    busy_cores,
    measured_alone,
    run_training,
)
from titan_lrattnres.model.registry import ModelIdentity

# baseline, standard Full, standard Block N=4, S-LR Block N=4 r=32, P-LR Block N=4 r=32 (cpu_small)
DEFAULT_CONFIGS = (
    "cpu_default_baseline",
    "cpu_default_attnres_full",
    "cpu_default_attnres",
    "cpu_default_sliced",
    "cpu_default_projected",
)


def available_configs() -> set[str]:
    try:
        from train_configs import CONFIGS
    except ImportError:
        return set()
    return set(CONFIGS)


def train_command(name: str, run_dir: Path, nproc: int, extra: list[str]) -> list[str]:
    launcher = [sys.executable, "-m"]
    if nproc > 1:
        launcher += ["torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m"]
    return [*launcher, "titan_lrattnres.train", name, "--dump_folder", str(run_dir), *extra]


def train_env() -> dict[str, str]:
    """The environment of a training run: this process's, with the clone first on the path."""
    root = str(Path(__file__).resolve().parents[2])
    return dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))


def ci95(losses: list[float]) -> tuple[float, float]:
    """``(mean, half-width)`` of the 95% normal confidence interval of the mean."""
    n = len(losses)
    mean = sum(losses) / n
    if n < 2:
        return mean, float("nan")
    var = sum((x - mean) ** 2 for x in losses) / (n - 1)
    return mean, 1.96 * math.sqrt(var / n)


@torch.no_grad()
def batch_losses(model, tokens: torch.Tensor, batch: int, seq_len: int, n: int) -> list[float]:
    """Mean next-token cross-entropy of each of up to ``n`` consecutive batches
    ``[batch, seq_len + 1]`` cut from the flat ``tokens``."""
    per = batch * (seq_len + 1)
    losses = []
    for i in range(min(n, tokens.numel() // per)):
        x = tokens[i * per : (i + 1) * per].reshape(batch, seq_len + 1)
        logits = model(x[:, :-1])
        losses.append(
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), x[:, 1:].flatten()
            ).item()
        )
    return losses


def evaluate_run(run_dir: Path, summary: dict, val_batches: int) -> dict:
    """Validation loss with a CI from the run's checkpoint (see the module docstring)."""
    from titan_lrattnres.evaluation.inference import (
        default_validation_source,
        load_model,
        model_args_from_summary,
        validation_tokens,
    )

    source = default_validation_source()
    if source is None:
        return {}
    model, _ = load_model(run_dir, model_args=model_args_from_summary(summary))
    batch, seq = summary["local_batch_size"], summary["seq_len"]
    tokens = validation_tokens(*source, val_batches * batch * (seq + 1))
    losses = batch_losses(model, tokens, batch, seq, val_batches)
    if not losses:
        return {}
    mean, half = ci95(losses)
    return {
        "val_loss": mean,
        "val_ci95": half,
        "val_batches": len(losses),
        "val_batch_losses": losses,
        "params": sum(p.numel() for p in model.parameters()),
    }


def config_lr(name: str) -> float | None:
    """The learning rate of a config's matrices (its last parameter group), or None."""
    try:
        from train_configs import get_config

        return get_config(name).optimizer.param_groups[-1].optimizer_kwargs["lr"]
    except (ImportError, KeyError, AttributeError, IndexError):
        return None


def model_key(variant: str, blocks, rank, block_layers=None) -> tuple:
    """What identifies a model across tables (``ModelIdentity.key``)."""
    return ModelIdentity(variant=variant, blocks=blocks, rank=rank, block_layers=block_layers).key()


def make_row(
    name: str, summary: dict, evaluation: dict | None = None, load: dict | None = None
) -> dict:
    """One table row from a run summary, (optionally) our own evaluation and the machine's
    load around the run (``machine_load.json``)."""
    from titan_lrattnres.model.flops import added_flops_percent
    from titan_lrattnres.model.registry import FLAVORS

    f = FLAVORS[summary["flavor"]]
    variant, blocks = summary["variant"], summary.get("blocks")
    block_layers = summary.get("block_layers")
    added = added_flops_percent(
        variant,
        num_layers=f.n_layers,
        dim=f.dim,
        hidden=f.hidden_dim,
        rank=summary.get("rank"),
        blocks=blocks,
        block_layers=block_layers,
    )
    ev = evaluation or {}
    return {
        "config": name,
        "lr": config_lr(name),
        "variant": variant,
        "blocks": blocks,
        "block_layers": block_layers,
        "rank": None
        if variant == "baseline"
        else (f.dim if variant == "attnres" else summary.get("rank")),
        "tokens": summary.get("tokens"),
        "val_loss": ev.get("val_loss", summary.get("final_val_loss")),
        "val_ci95": ev.get("val_ci95"),
        "val_batches": ev.get("val_batches"),
        "val_batch_losses": ev.get("val_batch_losses"),
        "trainer_val_loss": summary.get("final_val_loss"),
        "added_flops_pct": added,
        "params": ev.get("params", summary.get("params")),
        "tokens_per_s": summary.get("tokens_per_s"),
        "other_cores": (load or {}).get("other_cores"),
        "busy_cores_before": (load or {}).get("busy_cores_before"),
        "peak_rss_mib": summary.get("peak_rss_mib"),
        "memory_case": memory_case(name, summary),
    }


_AC_MODES = {None: "none", "SelectiveAC": "selective", "FullAC": "full"}


def memory_case(name: str, summary: dict) -> dict | None:
    """The fields of a ``benchmarks.memory.Case`` for a run: its shape from ``summary`` (what
    it ran with, command-line overrides included), AC mode, parameter dtype, optimizer and loss
    from its config, FSDP size = world size / replicas. None where the benchmark does not model
    the run (an unknown config or shape, tensor, pipeline or context parallel, another AC
    mode)."""
    if any(summary.get(k) is None for k in ("flavor", "variant", "seq_len", "local_batch_size")):
        return None
    try:
        from train_configs import get_config

        config = get_config(name)
    except (ImportError, KeyError):
        return None
    par = config.parallelism
    if max(par.tensor_parallel_degree, par.pipeline_parallel_degree,
           par.context_parallel_degree) > 1:  # fmt: skip
        return None
    ac = config.activation_checkpoint
    ac_mode = _AC_MODES.get(None if ac is None else type(ac).__qualname__.split(".")[0])
    if ac_mode is None:
        return None
    muon = [g.optimizer_kwargs for g in config.optimizer.param_groups
            if g.optimizer_name == "Muon"]  # fmt: skip
    inner = getattr(config.loss, "loss_fn", config.loss)
    world = summary.get("world_size") or 1
    return {
        "flavor": summary["flavor"],
        "variant": summary["variant"],
        "blocks": summary.get("blocks"),
        "block_layers": summary.get("block_layers"),
        "rank": summary.get("rank") or 64,
        "seq": summary["seq_len"],
        "batch": summary["local_batch_size"],
        "ac": ac_mode,
        "fsdp": max(world // max(par.data_parallel_replicate_degree, 1), 1),
        "dtype": "bf16" if config.training.mixed_precision_param == "bfloat16" else "fp32",
        "optimizer": "recipe" if muon else "adamw",
        "ortho_dtype": muon[0].get("ortho_dtype", "bfloat16") if muon else "bfloat16",
        "implementation": config.optimizer.implementation,
        "z_loss": getattr(inner, "z_loss_weight", 0.0),
        "loss_chunks": getattr(config.loss, "num_chunks", 8),
        "max_norm": config.training.max_norm,
    }


def predict_memory(case: dict) -> dict:
    """The predicted training memory of a ``memory_case``
    (:func:`titan_lrattnres.evaluation.memory.measure`): its peak and categories (bytes)."""
    from titan_lrattnres.evaluation.memory import Case, measure

    return measure(Case(**case))


def attach_memory(rows: list[dict], predict=None, progress=print) -> None:
    """``predicted_peak_mib`` (and ``predicted_memory``: the prediction's figures, bytes) of every
    row with a ``memory_case``, computed once per distinct case (``predict``, default
    ``predict_memory``); a failure is kept in the row as ``memory_error``."""
    predict = predict or predict_memory
    done: dict[str, dict | None] = {}
    errors: dict[str, str] = {}
    for r in rows:
        case = r.get("memory_case")
        if case is None or r.get("predicted_peak_mib") is not None:
            continue
        key = json.dumps(case, sort_keys=True)
        if key not in done:
            try:
                done[key] = predict(case)
            except Exception as e:  # noqa: BLE001 (the column shows "-"; the sweep goes on)
                errors[key] = f"{type(e).__name__}: {e}"
                progress(f"{r['config']}: no memory prediction ({errors[key]})")
                done[key] = None
            else:
                mib = done[key]["peak"] / 2**20
                progress(f"{r['config']}: predicted peak {mib:,.0f} MiB per rank")
        pred = done[key]
        if key in errors:
            r["memory_error"] = errors[key]
        if pred is not None:
            r["predicted_peak_mib"] = pred["peak"] / 2**20
            r["predicted_memory"] = {k: pred[k] for k in ("peak", "at_peak", "max", "optimizer")}


def add_paired_deltas(rows: list[dict]) -> None:
    """``delta_vs_baseline`` (± paired 95% CI): every run is evaluated on the same batches, so
    the per-batch differences to the baseline cancel the batch-to-batch spread of the corpus."""
    base = next((r for r in rows if r["variant"] == "baseline"), None)
    base_losses = (base or {}).get("val_batch_losses")
    for r in rows:
        losses = r.get("val_batch_losses")
        if not base_losses or not losses or len(losses) != len(base_losses):
            r["delta_vs_baseline"], r["delta_ci95"] = None, None
            continue
        r["delta_vs_baseline"], r["delta_ci95"] = ci95([a - b for a, b in zip(losses, base_losses)])


def merge_rows(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` (rows of an earlier ``sweep.json``) in their order, a config run again replaced by
    its ``new`` row, then the new configs; deltas and extras are recomputed by ``write_report``."""
    fresh = {r["config"]: r for r in new}
    merged = [fresh.pop(r["config"], r) for r in old]
    for r in merged:  # earlier sweeps named the process's peak RSS "peak_mem_mib"
        if "peak_mem_mib" in r:
            r.setdefault("peak_rss_mib", r.pop("peak_mem_mib"))
    return merged + list(fresh.values())


def best_lr_rows(rows: list[dict]) -> list[dict]:
    """Each model (``model_key``) at its lowest validation loss over learning rates, with the
    paired difference to the baseline at the baseline's best rate; [] if no model has two rates."""
    best: dict[tuple, dict] = {}
    counts: dict[tuple, int] = {}
    for r in rows:
        key = model_key(r["variant"], r["blocks"], r["rank"], r.get("block_layers"))
        counts[key] = counts.get(key, 0) + 1
        if r["val_loss"] is not None and (key not in best or r["val_loss"] < best[key]["val_loss"]):
            best[key] = r
    if max(counts.values(), default=0) < 2:
        return []
    picked = [dict(r) for r in best.values()]
    add_paired_deltas(picked)
    return picked


def attach_extras(rows: list[dict], decode: dict | None, longctx: dict | None) -> None:
    """Decode latency and long-input columns (see the module docstring), matched by model."""
    if decode:
        by_key = {}
        result = decode["result"]
        # benchmarks.decode: {mode: {batch: ...}}; the compiled path's ratios when measured
        result = result.get("compiled") or result.get("eager") or result
        for batch, table in result.items():
            for r in table.values():
                v, blocks, rank = r["variant"]
                by_key.setdefault(model_key(v, blocks, rank), {})[str(batch)] = r["decode_ratio"]
        for r in rows:
            ratios = by_key.get(model_key(r["variant"], r["blocks"], r["rank"]), {})
            r["decode_ratio_b1"], r["decode_ratio_b8"] = ratios.get("1"), ratios.get("8")
    if longctx:  # per trained run (matched by its folder name = config)
        by_run = {}
        for run in longctx["runs"].values():
            pos, probe = run["loss_by_position"], run["copy_probe"]
            one, far = pos["1"]["buckets"], pos[max(pos, key=int)]["buckets"]
            tail = far[-(len(far) // 4 or 1) :]
            gap = probe[max(probe, key=int)]
            by_run[Path(run["run"]).name] = {
                "long_degradation": sum(tail) / len(tail) - sum(one) / len(one),
                "copy_gain": gap["first_loss"] - gap["second_loss"],
            }
        for r in rows:
            r.update(by_run.get(r["config"], {}))


def label(row: dict) -> str:
    v = {"baseline": "Baseline", "attnres": "Standard", "sliced": "S-LR", "projected": "P-LR"}
    name = v.get(row["variant"], row["variant"])
    if row["variant"] == "baseline":
        return name
    if row.get("block_layers") is not None:
        shape = f"Block {row['block_layers']}-layer"
    else:
        shape = "Full" if row["blocks"] is None else f"Block N={row['blocks']}"
    rank = f" r={row['rank']}" if row["variant"] in ("sliced", "projected") else ""
    return f"{name} {shape}{rank}"


def _fmt(x, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(rows: list[dict]) -> str:
    extras = [
        (k, h, f)
        for k, h, f in (
            ("decode_ratio_b1", "decode × base B=1", ".3f"),
            ("decode_ratio_b8", "decode × base B=8", ".3f"),
            ("long_degradation", "loss last ¼ of 4×T − 1×T", "+.3f"),
            ("copy_gain", "copy gain, longest gap", "+.3f"),
        )
        if any(r.get(k) is not None for r in rows)
    ]
    notes = [
        f"\n{r['config']}: no predicted memory ({r['memory_error']})"
        for r in rows
        if r.get("memory_error")
    ]
    lines = [
        "| model | config | lr | val loss (± 95% CI) | Δ vs baseline (paired 95% CI) | "
        "added FLOPs % | params | tokens/s | predicted peak MiB/rank (benchmarks.memory) |"
        + "".join(f" {h} |" for _, h, _ in extras),
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(extras),
    ]
    for r in rows:
        loss = _fmt(r["val_loss"], ".4f")
        if r.get("val_ci95") is not None and not math.isnan(r["val_ci95"]):
            loss += f" ± {r['val_ci95']:.4f}"
        tok_s = r["tokens_per_s"] if measured_alone(r) else None
        delta = _fmt(r.get("delta_vs_baseline"), "+.4f")
        if r.get("delta_ci95") is not None and not math.isnan(r["delta_ci95"]):
            delta += f" ± {r['delta_ci95']:.4f}"
        lines.append(
            f"| {label(r)} | {r['config']} | {_fmt(r.get('lr'), 'g')} | {loss} | {delta} | "
            f"{_fmt(r['added_flops_pct'], '.3f')} | "
            f"{_fmt(r['params'], ',')} | {_fmt(tok_s, ',.0f')} | "
            f"{_fmt(r.get('predicted_peak_mib'), ',.0f')} |"
            + "".join(f" {_fmt(r.get(k), f)} |" for k, _, f in extras)
        )
    return "\n".join(lines) + "\n" + "".join(f"{n}\n" for n in notes)


def plot(rows: list[dict], path: str | Path, title: str = "") -> Path:
    """Validation loss vs added FLOPs %, one labelled point per variant (paper's Figure 1)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in rows:
        if r["val_loss"] is None:
            continue
        err = r.get("val_ci95")
        ax.errorbar(
            r["added_flops_pct"],
            r["val_loss"],
            yerr=None if err is None or math.isnan(err) else err,
            fmt="o",
            capsize=3,
        )
        ax.annotate(
            label(r),
            (r["added_flops_pct"], r["val_loss"]),
            textcoords="offset points",
            xytext=(5, 5),
            fontsize=8,
        )
    ax.set_xlabel("added FLOPs % (forward, per token)")
    ax.set_ylabel("validation loss")
    ax.set_title(title or "validation loss vs added FLOPs")
    ax.grid(alpha=0.3)
    ax.margins(x=0.3, y=0.15)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(rows: list[dict], out: Path, decode=None, longctx=None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    add_paired_deltas(rows)
    attach_extras(rows, decode, longctx)
    best = best_lr_rows(rows)
    md = (
        "# Variant sweep\n\nMatched tokens, data and seed. Validation loss: mean of per-batch "
        "losses over the held-out split, ± 1.96·std/sqrt(n); Δ vs baseline: mean of the "
        "per-batch differences on the same batches, ± 1.96·std/sqrt(n). Tokens/s: only for runs "
        f"measured alone (other processes under {BUSY_CORES} cores before and during the run); "
        "'-' where they used more or the run has no such record (the JSON keeps the figure).\n\n"
        + markdown_table(rows)
    )
    if best:
        md += (
            "\n## Each model at its best learning rate\n\nΔ vs the baseline at the baseline's "
            "best rate (same held-out batches, paired).\n\n" + markdown_table(best)
        )
    (out / "sweep.md").write_text(md)
    (out / "sweep.json").write_text(json.dumps(rows, indent=2) + "\n")
    if best:
        (out / "sweep_best_lr.json").write_text(json.dumps(best, indent=2) + "\n")
    # one point per model: at its best rate when there are several
    plot(best or rows, out / "sweep.png", "each model at its best learning rate" if best else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m titan_lrattnres.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="comma list of names")
    p.add_argument("--out", default="runs/sweep")
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--val-batches", type=int, default=40)
    p.add_argument("--dry-run", action="store_true", help="print the commands, train nothing")
    p.add_argument("--decode", help="JSON of python -m benchmarks.decode --json (columns)")
    p.add_argument("--longctx", help="longctx.json of python -m titan_lrattnres.longctx")
    p.add_argument("--merge", help="sweep.json of an earlier sweep: its rows join the table")
    p.add_argument("--no-memory", action="store_true",
                   help="no predicted peak memory column (benchmarks.memory)")  # fmt: skip
    ns, extra = p.parse_known_args(argv)
    out = Path(ns.out)
    names = [c for c in ns.configs.split(",") if c]
    known = available_configs()
    rows = []
    for name in names:
        if known and name not in known:
            print(f"skip {name}: not a train_configs name (known: {', '.join(sorted(known))})")
            continue
        run = out / name
        summary_file = run / "summary.json"
        cmd = train_command(name, run, ns.nproc, extra)
        load_file = run / "machine_load.json"
        if summary_file.is_file():
            print(f"reuse {run} (summary.json present)")
        elif ns.dry_run:
            print(" ".join(cmd))
            continue
        else:
            busy = busy_cores()
            if busy is not None and busy > BUSY_CORES:
                print(f"WARNING: other processes use {busy:.2f} cores: {name}'s tokens/s will "
                      "not be its own and stays out of the table", flush=True)  # fmt: skip
            print("$ " + " ".join(cmd), flush=True)
            rc, other = run_training(cmd, train_env())
            if rc != 0 or not summary_file.is_file():
                print(f"FAILED {name}: no {summary_file}; left out of the table")
                continue
            load = {"busy_cores_before": busy, "other_cores": other}
            load_file.write_text(json.dumps(load, indent=2) + "\n")
        summary = json.loads(summary_file.read_text())
        try:
            evaluation = evaluate_run(run, summary, ns.val_batches)
        except (OSError, KeyError, ValueError, RuntimeError) as e:
            print(
                f"{name}: no own evaluation ({type(e).__name__}: {e}); using the trainer's "
                "final_val_loss without a CI"
            )
            evaluation = {}
        load = json.loads(load_file.read_text()) if load_file.is_file() else None
        rows.append(make_row(name, summary, evaluation, load))
    if ns.merge and not ns.dry_run:
        rows = merge_rows(json.loads(Path(ns.merge).read_text()), rows)
    if rows and not ns.no_memory:
        attach_memory(rows)
    if rows:
        extras = [json.loads(Path(f).read_text()) if f else None for f in (ns.decode, ns.longctx)]
        write_report(rows, out, *extras)
        print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
