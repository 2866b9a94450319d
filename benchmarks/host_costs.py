"""What a step does on the host, event by event, against torchtitan's decoder of the same shape.

    python -m benchmarks.host_costs [--layers 24 --dim 64 --seq 32] [--ac none|selective|full]
        [--variants torchtitan,baseline,block8,...] [--steps 5] [--guard-pairs 0] [--top 12]
        [--json PATH]

Where a step is host work (a tiny width), its time is the calls the host makes. For each variant
(``benchmarks.overhead``'s models: every layer compiled as torchtitan compiles it, after
torchtitan's activation checkpointing ``--ac``) ``--steps`` training steps (forward, loss,
backward) run under ``torch.profiler`` (CPU activity), after warm-up steps that compile. Each
step's top-level host events (those with no parent event: a compiled layer's region, dynamo's
cache lookup, the autograd engine's node evaluations, the eager ops outside the layers) are
counted and timed by name (compile ids and graph hashes left out of the name), per step. The
step's wall time under the profiler less its top-level events' is the host time outside every
event (Python between the calls, the profiler's own). ``--guard-pairs N`` also times, without
the profiler, N pairs of steps with dynamo's guards checked and skipped: what checking them
costs a step (``guard_cost``).

The tables: per variant, its top-level events per step, their time and the time outside them,
each beside torchtitan's decoder's; then, per variant, the events whose count per step differs
from torchtitan's decoder's and the ones whose time differs most (``--top``). Times under the
profiler are inflated and meant to be read against each other, within one run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict

import torch

from benchmarks.meta import environment, write
from benchmarks.overhead import AC_MODES, Shape, Step, _timed, build, parse_variant

DEFAULT_VARIANTS = ("torchtitan", "baseline", "block8", "sliced8_r64", "projected8_r32", "full")
# compile ids ("Torch-Compiled Region: 3/0") and graph hashes ("CompiledFxGraph fdhnzks")
_IDS = re.compile(r"(?<=: )\d+/\d+$|(?<=CompiledFxGraph )\w+")


def event_name(name: str) -> str:
    """The profiler's event name without the compile id or graph hash: the same event of two
    models (or two layers) has one name."""
    return _IDS.sub("*", name)


def profile_steps(step, steps: int, device="cpu") -> dict:
    """``steps`` calls of ``step`` under ``torch.profiler`` (CPU activity): per step, the
    top-level host events by name (``{"count", "us"}``), their sum, the wall time and the time
    outside every event."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            walls.append(_timed(step, device))
    events = defaultdict(lambda: {"count": 0.0, "us": 0.0})
    for evt in prof.events():
        if evt.cpu_parent is not None:
            continue
        row = events[event_name(evt.name)]
        row["count"] += 1 / steps
        row["us"] += evt.cpu_time_total / steps
    events = dict(sorted(events.items(), key=lambda kv: -kv[1]["us"]))
    top_us = sum(e["us"] for e in events.values())
    wall_us = 1e6 * sum(walls) / steps
    return {
        "events": events,
        "top_level_per_step": sum(e["count"] for e in events.values()),
        "top_level_us": top_us,
        "step_us": wall_us,
        "median_step_us": 1e6 * statistics.median(walls),
        "outside_us": max(wall_us - top_us, 0.0),
    }


def guard_cost(step, pairs: int, device="cpu") -> dict:
    """What dynamo's guard checks cost a step: ``pairs`` pairs of unprofiled steps, one with
    every compiled region's guards evaluated and one with them skipped
    (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``: safe here, every step passes
    the same inputs to the same modules), alternating so a drift of the machine reaches both;
    the medians (microseconds) and their difference."""
    times = {False: [], True: []}
    for _ in range(pairs):
        for skip in (False, True):
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                times[skip].append(1e6 * _timed(step, device))
    guarded, unguarded = (statistics.median(times[skip]) for skip in (False, True))
    return {"guarded_step_us": guarded, "unguarded_step_us": unguarded,
            "guards_us": guarded - unguarded}  # fmt: skip


def measure(
    shape: Shape,
    variants=DEFAULT_VARIANTS,
    *,
    steps: int = 5,
    warmup: int = 3,
    ac: str = "none",
    device="cpu",
    compile_: bool = True,
    backend: str = "inductor",
    guard_pairs: int = 0,
    progress=print,
) -> dict:
    """Per variant, :func:`profile_steps` of its training step (``benchmarks.overhead.Step``:
    forward, loss, backward; fp32) after ``warmup`` steps, and with ``guard_pairs`` its
    :func:`guard_cost`; with ``torchtitan`` among the
    variants, each row adds ``over_torchtitan``: its per-step differences to torchtitan's
    decoder (events, their time, the time outside them)."""
    for name in variants:
        parse_variant(name)  # a bad name fails before anything is built
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].flatten().contiguous()
    result = {}
    for name in variants:
        model = build(name, shape, device, torch.float32, compile_, ac=ac, backend=backend)
        step = Step(model, tokens, targets, optimizer=False, cuda_graph=False)
        for _ in range(warmup):
            step()
        result[name] = profile_steps(step, steps, device)
        if guard_pairs:
            result[name].update(guard_cost(step, guard_pairs, device))
        progress(f"  profiled {name}")
    if "torchtitan" in result:
        base = result["torchtitan"]
        for row in result.values():
            row["over_torchtitan"] = {
                "top_level_per_step": row["top_level_per_step"] - base["top_level_per_step"],
                "top_level_us": row["top_level_us"] - base["top_level_us"],
                "outside_us": row["outside_us"] - base["outside_us"],
                "events": event_differences(row["events"], base["events"]),
            }
    return result


def event_differences(events: dict, base: dict) -> dict:
    """``{name: {"count", "us"}}``: per step, ``events`` less ``base``, for every name in
    either."""
    zero = {"count": 0.0, "us": 0.0}
    return {
        name: {k: events.get(name, zero)[k] - base.get(name, zero)[k] for k in ("count", "us")}
        for name in dict.fromkeys([*events, *base])
    }


def table(result: dict, top: int = 12) -> str:
    titan = "torchtitan" in result
    lines = ["| variant | top-level events / step | their host ms / step | outside ms / step |"
             + (" events over torchtitan | ms over torchtitan | outside ms over torchtitan |"
                if titan else ""),
             "|---|---|---|---|" + ("---|---|---|" if titan else "")]  # fmt: skip
    guards = all("guards_us" in r for r in result.values())
    if guards:
        lines = [lines[0] + " step ms, guards checked / skipped | guards ms / step |",
                 lines[1] + "---|---|"]  # fmt: skip
    for name, r in result.items():
        line = (f"| {name} | {r['top_level_per_step']:.0f} | {r['top_level_us'] / 1e3:.2f} | "
                f"{r['outside_us'] / 1e3:.2f} |")  # fmt: skip
        if titan:
            o = r["over_torchtitan"]
            line += (f" {o['top_level_per_step']:+.0f} | {o['top_level_us'] / 1e3:+.2f} | "
                     f"{o['outside_us'] / 1e3:+.2f} |")  # fmt: skip
        if guards:
            line += (f" {r['guarded_step_us'] / 1e3:.2f} / {r['unguarded_step_us'] / 1e3:.2f} | "
                     f"{r['guards_us'] / 1e3:.2f} |")  # fmt: skip
        lines.append(line)
    if not titan:
        return "\n".join(lines)
    lines += ["", "| variant | event | per step | over torchtitan | us / step "
              "| us over torchtitan |", "|---|---|---|---|---|---|"]  # fmt: skip
    for name, r in result.items():
        if name == "torchtitan":
            continue
        diff = r["over_torchtitan"]["events"]
        counted = [e for e, d in diff.items() if abs(d["count"]) > 1e-9]
        timed = sorted(diff, key=lambda e: -abs(diff[e]["us"]))[:top]
        for event in dict.fromkeys([*counted, *timed]):
            mine = r["events"].get(event, {"count": 0.0, "us": 0.0})
            d = diff[event]
            lines.append(f"| {name} | {event} | {mine['count']:g} | {d['count']:+g} | "
                         f"{mine['us']:.0f} | {d['us']:+.0f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    Shape.add_arguments(p, layers=24, dim=64, seq=32, heads=4)
    p.add_argument("--device", default="cpu")
    p.add_argument("--ac", choices=AC_MODES, default="none")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--steps", type=int, default=5, help="profiled steps per variant")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--guard-pairs",
        type=int,
        default=0,
        help="also time this many pairs of steps with guards checked / skipped",
    )
    p.add_argument("--top", type=int, default=12, help="events listed by time difference")
    p.add_argument("--no-compile", action="store_true", help="eager layers (debugging)")
    p.add_argument("--json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.guard_pairs < 0:
        p.error("--steps must be >= 1 and --guard-pairs >= 0")
    if torch.device(args.device).type == "cpu":
        from titan_lrattnres.training.cpu import keep_freed_memory

        keep_freed_memory()  # as the trainer and benchmarks.overhead run on CPU
    shape = Shape.of(args)
    variants = [v for v in args.variants.split(",") if v]
    try:
        result = measure(shape, variants, steps=args.steps, warmup=args.warmup, ac=args.ac,
                         device=args.device, compile_=not args.no_compile,
                         guard_pairs=args.guard_pairs)  # fmt: skip
    except (ValueError, RuntimeError) as e:
        print(f"host_costs: {e}", file=sys.stderr)
        return 2
    print(f"host_costs: L={shape.layers} d={shape.dim} T={shape.seq} B={shape.batch} "
          f"AC {args.ac}, {args.steps} profiled steps per variant on {args.device}")  # fmt: skip
    print(table(result, args.top))
    if args.json:
        config = {**vars(args), **environment(args.device)}
        write(args.json, {"config": config, "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
