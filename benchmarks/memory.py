"""Peak memory of one training step per variant, per rank, predicted on the CPU without a GPU.

    python -m benchmarks.memory [--flavor paper_0p5b] [--seq 2048] [--batch 4]
        [--variants baseline,block8,...] [--ac none,selective,full] [--fsdp 8,64]
        [--dtype bf16|fp32] [--optimizer recipe|adamw] [--json PATH]

The table of variants over the prediction of :mod:`titan_lrattnres.evaluation.memory`: how it
works, what it counts and what it does not see are in that module's docstring.
``tests/benchmarks/test_memory.py`` holds the prediction to a real CPU run at a small shape, and
``benchmarks/gpu_check.py``'s ``memory`` section to ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import torch

from benchmarks.meta import environment, write
from benchmarks.overhead import DEFAULT_VARIANTS as STEP_VARIANTS
from benchmarks.overhead import parse_variant
from titan_lrattnres.evaluation.memory import (  # noqa: F401  (benchmarks.memory.<name> as before)
    AC_MODES,
    DTYPES,
    GIB,
    GROUPS,
    Case,
    apply_ac,
    build,
    build_loss,
    build_optimizers,
    device_snapshot,
    measure,
    measure_real,
    process_group,
    track,
    train_step,
)

# The prediction itself is titan_lrattnres.evaluation.memory (the sweep's memory column); this
# module is its command, over a table of variants.
DEFAULT_VARIANTS = tuple(v for v in STEP_VARIANTS if v != "torchtitan")  # the project's model only


def named_case(name: str, **kw) -> Case:
    """The case of a ``benchmarks.overhead`` variant name (e.g. ``sliced8_r64``; standard
    AttnRes: r = d; the baseline: rank 0, unused)."""
    from titan_lrattnres.model.registry import FLAVORS

    variant, blocks, rank = parse_variant(name)
    if variant == "attnres":
        rank = FLAVORS[kw.get("flavor", Case.flavor)].dim
    return Case(variant=variant, blocks=blocks, rank=rank, **kw)


def cases(flavor, variants, ac_modes, fsdp_sizes, **kw) -> list[tuple[str, Case]]:
    return [(name, named_case(name, flavor=flavor, ac=ac, fsdp=w, **kw))
            for w in fsdp_sizes for ac in ac_modes for name in variants]  # fmt: skip


def run(named_cases, progress=print) -> list[dict]:
    """Every case in turn (one fake process group each); rows with the ratio of the total to
    the baseline's at the same AC mode and FSDP size."""
    rows = []
    for i, (name, case) in enumerate(named_cases, 1):
        r = measure(case)
        rows.append({"name": name, "case": asdict(case), **r})
        progress(
            f"  [{i}/{len(named_cases)}] {name:<15} ac={case.ac:<9} fsdp={case.fsdp:<3} "
            f"peak {r['peak'] / GIB:7.2f} GiB  ({r['optimizer']}, {r['seconds']:.1f} s)"
        )
    base = {(r["case"]["ac"], r["case"]["fsdp"]): r["peak"] for r in rows
            if r["case"]["variant"] == "baseline"}  # fmt: skip
    for r in rows:
        b = base.get((r["case"]["ac"], r["case"]["fsdp"]))
        r["ratio_to_baseline"] = r["peak"] / b if b else None
    return rows


def unit(rows: list[dict]) -> tuple[str, int]:
    """GiB, or MiB when every peak is under 1 GiB (small test shapes)."""
    return ("GiB", GIB) if max(r["peak"] for r in rows) >= GIB else ("MiB", 2**20)


def table(rows: list[dict], key: str = "at_peak") -> str:
    """Per category (``at_peak`` or ``max``), the peak total and its ratio to the baseline, in
    ``unit(rows)``."""
    _, div = unit(rows)
    cols = list(GROUPS)
    head = f"{'variant':<16}{'ac':<10}{'fsdp':>5}" + "".join(f"{c[:11]:>12}" for c in cols)
    lines = [head + f"{'total':>10}{'x base':>8}"]
    for r in rows:
        c = r["case"]
        ratio = r.get("ratio_to_baseline")
        lines.append(
            f"{r['name']:<16}{c['ac']:<10}{c['fsdp']:>5}"
            + "".join(f"{r[key][g] / div:>12.2f}" for g in cols)
            + f"{r['peak'] / div:>10.2f}"
            + (f"{ratio:>8.3f}" if ratio else f"{'-':>8}")
        )
    return "\n".join(lines)


def _csv(s: str, kind=str) -> list:
    return [kind(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="paper_0p5b")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="local batch (train_configs/paper_grid)")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--ac", default=",".join(AC_MODES), help=f"comma list of {AC_MODES}")
    p.add_argument("--fsdp", default="8,64", help="FSDP sizes (ranks), comma list")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--optimizer", choices=("recipe", "adamw"), default="recipe")
    p.add_argument("--implementation", choices=("fused", "foreach", "for-loop"), default="fused",
                   help="AdamW's (the GPU configs: fused; the CPU ones: foreach)")  # fmt: skip
    p.add_argument("--z-loss", type=float, default=1e-5, help="0: plain cross-entropy")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    from titan_lrattnres.model.registry import FLAVORS

    if a.flavor not in FLAVORS:
        p.error(f"unknown flavor {a.flavor!r}; known: {', '.join(FLAVORS)}")
    variants, modes, sizes = _csv(a.variants), _csv(a.ac), _csv(a.fsdp, int)
    try:
        for v in variants:
            parse_variant(v)
    except ValueError as e:
        p.error(str(e))
    if bad := [m for m in modes if m not in AC_MODES]:
        p.error(f"unknown AC modes {bad}; known: {', '.join(AC_MODES)}")
    f = FLAVORS[a.flavor]
    print(
        f"memory: {a.flavor} (L={f.n_layers} d={f.dim} heads={f.n_heads} hidden={f.hidden_dim} "
        f"vocab={f.vocab_size}) T={a.seq} local batch {a.batch}, {a.dtype} params / fp32 "
        f"masters, optimizer {a.optimizer}, per rank at FSDP {sizes}; torch {torch.__version__}"
    )
    shape = dict(seq=a.seq, batch=a.batch, dtype=a.dtype, optimizer=a.optimizer,
                 z_loss=a.z_loss, implementation=a.implementation)  # fmt: skip
    todo = cases(a.flavor, variants, modes, sizes, **shape)
    rows = run(todo)
    name = unit(rows)[0]
    print(f"\n{name} per rank, categories at the moment of the peak:")
    print(table(rows, "at_peak"))
    print(f"\n{name} per rank, each category's own maximum over the step (total: the peak):")
    print(table(rows, "max"))
    used = sorted({f"{r['optimizer']} ({' + '.join(r['optimizers'])})" for r in rows})
    print(f"\noptimizer: {', '.join(used)}" + "".join(
        f"\n  {r['name']} ac={r['case']['ac']} fsdp={r['case']['fsdp']}: {r['optimizer_note']}"
        for r in rows if "optimizer_note" in r))  # fmt: skip
    if a.json:
        command = ["python", "-m", "benchmarks.memory", *(sys.argv[1:] if argv is None else argv)]
        meta = dict(vars(a), command=" ".join(command), **environment("cpu"),
                    units="bytes per rank", categories=GROUPS)  # fmt: skip
        write(a.json, {"config": meta, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
