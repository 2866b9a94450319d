"""Optimiser step time (Muon recipe vs AdamW) and collectives per step at 2 ranks.

    python -m benchmarks.optimizer [--flavor cpu_small] [--rounds 7] [--threads 1] [--json PATH]

One process: the ``cpu_default`` model shape (``--flavor``, S-LR Block N=4 r=32) with fixed
random gradients; a round times one ``step()`` of each optimiser in a rotating order, and the
table gives the median over rounds and the ratio to AdamW within each round (a shared machine's
drifts cancel). Optimisers: the configs' AdamW container (``train_configs.common.param_groups``,
foreach), the paper's recipe container (``recipe_param_groups``: Muon with bf16 and with fp32
Polar Express, AdamW for embedding / head / queries), and ``torch.optim.Muon`` (plain
Newton-Schulz, no NorMuon) on the same matrices with AdamW beside it, for reference.

Then 2 gloo ranks (``torch.distributed.run``, FSDP2 per layer + root): the collectives of one
``step()`` counted with ``CommDebugMode`` (c10d and functional collectives alike) and the step
time per optimiser. One thread per process by default (``--threads``): on a shared 2-core
machine OpenMP threads that spin against other processes inflate times tenfold.
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

import torch

from benchmarks.meta import environment, write
from titan_lrattnres.components.optimizers import QUERIES, recipe_param_groups
from titan_lrattnres.spec import model_registry
from train_configs.common import param_groups

MODEL = dict(variant="sliced", blocks=4, rank=32, depth_backend="reference")
OPTIMISERS = ("adamw", "muon_bf16", "muon_fp32", "torch_muon")


def build_model(flavor: str):
    torch.manual_seed(0)
    model = model_registry(flavor, **MODEL).model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def build_optimiser(name: str, model):
    if name == "adamw":
        cfg = param_groups("sliced", lr=3e-3, lr_embed=3e-3, lr_head=3e-3, lr_query=3e-3)
        cfg.implementation = "foreach"
        return cfg.build(model_parts=[model])
    if name.startswith("muon"):
        dtype = "bfloat16" if name == "muon_bf16" else "float32"
        return recipe_param_groups("sliced", ortho_dtype=dtype, implementation="foreach").build(
            model_parts=[model]
        )
    matrices = [p for n, p in model.named_parameters() if p.ndim == 2 and _muon_name(n)]
    rest = [p for n, p in model.named_parameters() if not (p.ndim == 2 and _muon_name(n))]
    muon = torch.optim.Muon(matrices, lr=1e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW(rest, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, foreach=True)
    return _Both(muon, adamw)


def _muon_name(name: str) -> bool:
    """Whether ``torch.optim.Muon`` takes the parameter: not the embedding, the head or the
    depth queries (each layer's ``queries [n, r]``)."""
    if re.search(QUERIES, name):
        return False
    return not any(s in name for s in ("tok_embeddings", "lm_head"))


class _Both:
    def __init__(self, *opts):
        self.opts = opts

    def step(self):
        for o in self.opts:
            o.step()


def set_grads(model, seed: int = 1) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        full = torch.randn(p.shape, generator=g) * 1e-2
        p.grad = (
            distribute_tensor(full, p.device_mesh, p.placements) if isinstance(p, DTensor) else full
        )


def time_steps(flavor: str, rounds: int) -> dict:
    runs = {}
    for name in OPTIMISERS:
        model = build_model(flavor)
        set_grads(model)
        opt = build_optimiser(name, model)
        opt.step()  # state allocated, warm
        runs[name] = opt
    times = {name: [] for name in OPTIMISERS}
    for r in range(rounds):
        order = OPTIMISERS[r % len(OPTIMISERS) :] + OPTIMISERS[: r % len(OPTIMISERS)]
        for name in order:
            t = time.perf_counter()
            runs[name].step()
            times[name].append(time.perf_counter() - t)
    out = {}
    for name, ts in times.items():
        ratios = [a / b for a, b in zip(ts, times["adamw"])]
        out[name] = {
            "median_ms": 1e3 * statistics.median(ts),
            "min_ms": 1e3 * min(ts),
            "ratio_to_adamw": statistics.median(ratios),
        }
    return out


def worker(flavor: str, rounds: int, out: str) -> None:
    """2 ranks: FSDP2 (each layer, then the root), collectives and time per step."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    from titan_lrattnres.training import cpu

    cpu.release_gloo_at_exit()  # no SIGABRT at exit (see release_gloo_at_exit)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    result = {}
    for name in OPTIMISERS:
        model = build_model(flavor)
        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        set_grads(model)
        opt = build_optimiser(name, model)
        opt.step()
        with CommDebugMode() as comm:
            opt.step()
        ts = []
        for _ in range(rounds):
            dist.barrier()
            t = time.perf_counter()
            opt.step()
            ts.append(time.perf_counter() - t)
        kinds = {str(k): v for k, v in comm.get_comm_counts().items()}
        result[name] = {
            "collectives": comm.get_total_counts(),
            "by_kind": kinds,
            "median_ms": 1e3 * statistics.median(ts),
        }
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def two_ranks(flavor: str, rounds: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "rank0.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2"]
        cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
        cmd += ["-m", "benchmarks.optimizer", "--worker", out, "--flavor", flavor]
        cmd += ["--rounds", str(rounds)]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        subprocess.run(cmd, check=True, env=env, capture_output=True, text=True)
        with open(out) as f:
            return json.load(f)


def table(one: dict, two: dict, flavor: str, n_matrices: int) -> str:
    lines = [
        f"optimizer step, {flavor} (S-LR Block N=4 r=32, {n_matrices} Muon matrices)",
        "| optimizer | 1 proc median ms | x AdamW | 2 ranks median ms | collectives / step |",
        "|---|---|---|---|---|",
    ]
    for name in OPTIMISERS:
        a, b = one[name], two[name]
        kinds = ", ".join(f"{v} {k.split('.')[-1]}" for k, v in sorted(b["by_kind"].items()))
        lines.append(
            f"| {name} | {a['median_ms']:.1f} | {a['ratio_to_adamw']:.2f} | {b['median_ms']:.1f}"
            f" | {b['collectives']} ({kinds}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flavor", default="cpu_small")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.worker:
        return worker(args.flavor, args.rounds, args.worker)
    one = time_steps(args.flavor, args.rounds)
    two = two_ranks(args.flavor, args.rounds)
    model = build_model(args.flavor)
    n = sum(1 for n, p in model.named_parameters() if p.ndim >= 2 and _muon_name(n))
    report = {
        "flavor": args.flavor,
        "rounds": args.rounds,
        **environment(),  # threads among them
        "one_process": one,
        "two_ranks": two,
    }
    print(table(one, two, args.flavor, n))
    if args.json:
        write(args.json, report)


if __name__ == "__main__":
    main()
