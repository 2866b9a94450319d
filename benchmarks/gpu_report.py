"""The training-speed run's JSON (``benchmarks/gpu_speed.py``) as the markdown that
``benchmarks/results/gpu_*.md`` commits: the machine and software (versions, the torch_compat
shims, the commit), the plan's estimate against what it took, the correctness gate, one table
per case (each variant's compile seconds, step time, ratios, peak memory, or its error), the
kernel-class profile, the Trainer's tokens/s and MFU, the targets.

    python -m benchmarks.gpu_report gpu_speed.json [-o benchmarks/results/gpu_h100.md]

A run stopped early (SIGTERM, timeout) still reports every figure it wrote.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _x(pct, ci=None) -> str:
    if pct is None:
        return "-"
    out = f"{1 + pct / 100:.3f}x"
    if ci:
        out += f" [{1 + ci[0] / 100:.3f}, {1 + ci[1] / 100:.3f}]"
    return out


def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")[:160]


def header(r: dict) -> list[str]:
    v = r.get("versions", {})
    shims = v.get("torch_compat_patches")
    lines = [
        f"# Training speed on {r.get('gpu') or r.get('device')}"
        + (" (CPU dry run: no GPU figure)" if r.get("dry_run") else ""),
        "",
        f"- machine: {r.get('gpu') or '-'}; CPU {r.get('cpu')}; Python {r.get('python')}",
        f"- torch {v.get('torch')}, triton {v.get('triton')}, torchtitan {v.get('torchtitan')}",
        "- torch_compat shims: "
        + ("not on PYTHONPATH (torch >= 2.14)" if shims is None else ", ".join(shims) or "none"),
        f"- code {r.get('code') or 'unknown (no git checkout)'}, {r.get('date')}",
    ]
    est = r.get("estimate", {})
    if est:
        lines.append(
            f"- plan estimate {est.get('total_s')} s ({est.get('compiles')} model compiles, "
            f"compile seconds from {est.get('compile_seconds_from')}); took "
            f"{_f(r.get('total_seconds'), '.0f')} s"
        )
    if r.get("stopped"):
        lines.append(f"- **stopped early**: {r['stopped']}")
    if r.get("fail_variant"):
        lines.append(f"- `{r['fail_variant']}` made to fail on purpose (`--fail-variant`)")
    return lines + [""]


def gate(g: dict) -> list[str]:
    if not g:
        return []
    c = g.get("config", {})
    lines = [
        "## Correctness gate",
        "",
        f"{c.get('candidate')} against {c.get('against')}, fp32, L={c.get('layers')} "
        f"d={c.get('dim')} T={c.get('seq')} B={c.get('batch')}; bounds {c.get('bounds')}. "
        + ("**all ok**" if g.get("all_ok") else "**FAILED**")
        + (f" ({g['note']})" if g.get("note") else ""),
        "",
        "| variant | loss | rel. diff | worst gradient rel. diff (parameter) | ok |",
        "|---|---|---|---|---|",
    ]
    for name, row in g.get("variants", {}).items():
        if "error" in row:
            lines.append(f"| {name} | error: {_cell(row['error'].splitlines()[-1])} | | | no |")
            continue
        lines.append(
            f"| {name} | {row['loss']:.6f} | {row['loss_rel']:.2e} | "
            f"{row['grad_rel_worst']:.2e} ({row['grad_worst_param']}) | "
            f"{'yes' if row['ok'] else 'NO'} |"
        )
    for key in ("error", "skipped"):
        if key in g:
            lines.append(f"\n{key}: {_cell(g[key])}")
    return lines + [""]


def variant_table(variants: dict) -> list[str]:
    """A case's variants as markdown rows (the report's table, and the run's own printout)."""
    lines = [
        "| variant | compile s | step ms | tokens/s | over torchtitan | over baseline "
        "| peak GiB | error / skipped |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for v, row in variants.items():
        step = row.get("median_step_s")
        peak = row.get("peak_bytes")
        lines.append(
            f"| {v} | {_f(row.get('compile_s'), '.1f')} | "
            f"{_f(None if step is None else 1e3 * step, '.2f')} | "
            f"{_f(row.get('tokens_per_s'), ',.0f')} | "
            f"{_x(row.get('median_overhead_vs_torchtitan_pct'), row.get('ci95_overhead_vs_torchtitan_pct'))} | "  # noqa: E501
            f"{_x(row.get('median_overhead_vs_baseline_pct'))} | "
            f"{_f(None if peak is None else peak / 2**30, '.2f')} | "
            f"{_cell(row.get('error') or row.get('skipped') or '')} |"
        )
    return lines


def cases(s: dict) -> list[str]:
    if not s:
        return []
    c = s.get("config", {})
    lines = [
        "## Step time against torchtitan's decoder",
        "",
        f"L={c.get('layers')} d={c.get('dim')} T={c.get('seq')}, {c.get('heads')} heads, "
        f"vocabulary {c.get('vocab')}, {c.get('dtype')}, {c.get('rounds')} rounds, "
        f"compiled: {c.get('compile')}. Each variant's steps alternate with the reference's "
        "(torchtitan's decoder, kept built through its case); over torchtitan: median of the "
        "per-round ratios [95 % interval]; over the baseline: the ratio of the two medians.",
        "",
    ]
    for name, case in s.get("cases", {}).items():
        lines.append(f"### {name}")
        lines.append("")
        if "skipped" in case:
            lines += [f"skipped: {case['skipped']}", ""]
            continue
        lines += variant_table(case.get("variants") or {})
        if "error" in case:
            lines.append(f"\ncase error: {_cell(case['error'].splitlines()[-1])}")
        lines += ["", f"{_f(case.get('seconds'), '.0f')} s (estimate {case.get('estimate_s')} s)"]
        lines.append("")
    p = s.get("profile")
    if p:
        lines += [f"### Where one step's time goes ({p['case']}, ms by kernel class)", "",
                  "```", p["table"], "```", ""]  # fmt: skip
    return lines


def trainer(t: dict) -> list[str]:
    if not t:
        return []
    lines = ["## The Trainer", "", "| config | exit | seconds | tokens/s | MFU % | note |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for c, run in t.get("runs", {}).items():
        lines.append(
            f"| {c} | {run.get('returncode', '-')} | {_f(run.get('seconds'), '.0f')} | "
            f"{_f(run.get('tokens_per_s'), ',.0f')} | {_f(run.get('mfu_pct'), '.2f')} | "
            f"{_cell(run.get('error') or run.get('skipped') or '')} |"
        )
    if t.get("skipped"):
        lines.append(f"\nskipped: {t['skipped']}")
    return lines + [""]


def targets(ts: list) -> list[str]:
    if not ts:
        return []
    lines = ["## Targets", "", "| target | measured | met |", "|---|---|---|"]
    for t in ts:
        lines.append(f"| {t['target']} | {t['measured']} | {'yes' if t['ok'] else 'NO'} |")
    return lines + [""]


def report(r: dict) -> str:
    parts = header(r) + gate(r.get("gate", {})) + cases(r.get("step_ratios", {}))
    parts += trainer(r.get("trainer", {})) + targets(r.get("targets", []))
    return "\n".join(parts).rstrip() + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json_path")
    p.add_argument("-o", "--out", default=None, help="write here (default: print)")
    a = p.parse_args(argv)
    text = report(json.loads(Path(a.json_path).read_text()))
    if a.out:
        Path(a.out).write_text(text)
        print(f"wrote {a.out}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
