"""Multi-rank Muon checks (gloo, CPU, under torch.distributed.run): ``worker.py OUT`` on 2 ranks
(test_muon.py), ``worker.py OUT tp`` on 8 ranks (test_muon_tp.py).

Each rank writes ``OUT/rank{r}.json``. 2 ranks: for every layout (FSDP2 1-D mesh, HSDP (1, 2)
and (2, 1) meshes) and ortho dtype, the largest |2-rank - 1-process| parameter difference over 3
steps and the all-to-all count; then whether a DCP save / load of the optimiser state gives a
bitwise identical next step. The 1-process reference runs in each rank on plain tensors.
``fused_*``: pairs of parameters fused into one matrix (``Muon(fuse=...)``), each member sharded
by its own rows, against one process's Muon on the concatenated matrices.

8 ranks (``tp``): a tiny transformer layer's weights (``Stage``) laid out as torchtitan 0.3.0
lays them out, by torch's tensor-parallel styles (``wqkv``, ``w1``, ``w3`` column-wise, ``wo``,
``w2`` row-wise, the root ``embedding_key`` replicated over TP) and FSDP2's ``fully_shard``, on
meshes cut from the 8 ranks: PP2 x FSDP2 x TP2 (each pipeline stage its own model part and
Muon), HSDP (2 x 2) x TP2, TP2 on a ``dp_shard`` dim of 1 (the trainer's TP-only mesh) and TP2
alone; fused ``[w1; w3]``, 3 steps against one process's Muon on the same weights; and a DCP
save / load of the optimiser state at TP2 (each TP pair its own checkpoint).
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from titan_lrattnres.components.muon import Muon
from titan_lrattnres.components.optimizers import MLP_INPUT, MuonOptimizersContainer, ParamGroup
from titan_lrattnres.training import cpu

# tall uneven (19/18 rows), wide (Shard(1) statistics 19/18), 2/1 rows, 1/0 rows, 3-D, square
SHAPES = {"tall": (37, 24), "wide": (24, 37), "tiny": (3, 5), "row": (1, 8), "cube": (5, 3, 4)}
SHAPES["square"] = (16, 16)
STEPS = 3


class Weights(nn.Module):
    def __init__(self, names=tuple(SHAPES)):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        for name, shape in SHAPES.items():
            w = torch.randn(shape, generator=g)
            if name in names:
                self.register_parameter(name, nn.Parameter(w))


def grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


def set_grads(model: nn.Module, step: int) -> None:
    for name, full in grads(step).items():
        p = getattr(model, name, None)
        if p is None:
            continue
        p.grad = (
            torch.distributed.tensor.distribute_tensor(full, p.device_mesh, p.placements)
            if isinstance(p, DTensor)
            else full
        )


def sharded(mesh_shape: tuple[int, ...], params=tuple(SHAPES)) -> Weights:
    names = ("replicate", "shard") if len(mesh_shape) == 2 else ("shard",)
    model = Weights(params)
    fully_shard(model, mesh=init_device_mesh("cpu", mesh_shape, mesh_dim_names=names))
    return model


def parity(mesh_shape: tuple[int, ...], ortho_dtype: str, params=tuple(SHAPES)) -> dict:
    ref, model = Weights(params), sharded(mesh_shape, params)
    kw = dict(lr=0.02, weight_decay=0.1, ortho_dtype=ortho_dtype)
    ref_opt, opt = Muon(ref.parameters(), **kw), Muon(model.parameters(), **kw)
    diff = 0.0
    for step in range(STEPS):
        set_grads(ref, step)
        set_grads(model, step)
        ref_opt.step()
        opt.step()
        for name in params:
            full = getattr(model, name).full_tensor()
            diff = max(diff, (full - getattr(ref, name)).abs().max().item())
    state = opt.state[getattr(model, "wide", model.tall)]
    return {
        "max_abs_diff": diff,
        "collectives_per_step": opt.collectives / STEPS,
        "variance_placements": [str(p) for p in state["variance_buffer"].placements],
        "variance_is_dtensor": isinstance(state["variance_buffer"], DTensor),
    }


# pairs fused by ``fuse=(("_w1", "_w3"),)``: tall (19 + 7 rows; 10/9 and 4/3 per rank), wide
# (5 + 6 rows: column statistics), and 1 + 2 rows (1/0 and 1/1 per rank; wide)
PAIRS = {"tall": ((19, 24), (7, 24)), "wide": ((5, 24), (6, 24)), "tiny": ((1, 8), (2, 8))}
LONE = (37, 24)  # not fused


class Pairs(nn.Module):
    def __init__(self, fused: bool):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        for name, (a, b) in PAIRS.items():
            w1, w3 = torch.randn(a, generator=g), torch.randn(b, generator=g)
            if fused:
                self.register_parameter(f"{name}_w1", nn.Parameter(w1))
                self.register_parameter(f"{name}_w3", nn.Parameter(w3))
            else:  # the reference: one matrix [w1; w3]
                self.register_parameter(name, nn.Parameter(torch.cat([w1, w3])))
        self.lone = nn.Parameter(torch.randn(LONE, generator=g))


def pair_grads(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    out = {}
    for name, (a, b) in PAIRS.items():
        out[f"{name}_w1"], out[f"{name}_w3"] = (
            torch.randn(a, generator=g),
            torch.randn(b, generator=g),
        )
    out["lone"] = torch.randn(LONE, generator=g)
    return out


def fused_parity(ortho_dtype: str) -> dict:
    """2 ranks with ``[w1; w3]`` fused against one process's Muon on the concatenations."""
    ref, model = Pairs(fused=False), Pairs(fused=True)
    fully_shard(model, mesh=init_device_mesh("cpu", (2,), mesh_dim_names=("shard",)))
    kw = dict(lr=0.02, weight_decay=0.1, ortho_dtype=ortho_dtype)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
    ref_opt, opt = Muon(ref.parameters(), **kw), Muon(groups, fuse=(("_w1", "_w3"),), **kw)
    diff = 0.0
    for step in range(STEPS):
        full = pair_grads(step)
        for name in PAIRS:
            getattr(ref, name).grad = torch.cat([full[f"{name}_w1"], full[f"{name}_w3"]])
        ref.lone.grad = full["lone"]
        for n, p in named:
            p.grad = torch.distributed.tensor.distribute_tensor(
                full[n], p.device_mesh, p.placements
            )
        ref_opt.step()
        opt.step()
        for name in PAIRS:
            got = torch.cat([getattr(model, f"{name}_{k}").full_tensor() for k in ("w1", "w3")])
            diff = max(diff, (got - getattr(ref, name)).abs().max().item())
        diff = max(diff, (model.lone.full_tensor() - ref.lone).abs().max().item())
    placements = {
        n: str(opt.state[p]["variance_buffer"].placements[0]) for n, p in named if "_w" in n
    }
    return {
        "max_abs_diff": diff,
        "collectives_per_step": opt.collectives / STEPS,
        "variance_placements": placements,
    }


def container(model: nn.Module, fuse=()) -> MuonOptimizersContainer:
    group = ParamGroup(
        pattern=".*", optimizer_name="Muon", min_ndim=2, optimizer_kwargs={"lr": 0.02}
    )
    cfg = MuonOptimizersContainer.Config(
        param_groups=[group],
        implementation="for-loop",
        optimizer_factory_kwargs_by_name={"Muon": {"fuse": fuse}} if fuse else {},
    )
    return cfg.build(model_parts=[model])


def dcp_resume(folder: str) -> dict:
    model = sharded((2,))
    opt = container(model)
    set_grads(model, 0)
    opt.step()
    dcp.save({"model": model.state_dict(), "optimizer": opt}, checkpoint_id=folder)
    set_grads(model, 1)
    opt.step()
    expected = {n: p.to_local().clone() for n, p in model.named_parameters()}

    resumed = sharded((2,))
    opt2 = container(resumed)
    state = {"model": resumed.state_dict(), "optimizer": opt2}
    dcp.load(state, checkpoint_id=folder)
    resumed.load_state_dict(state["model"])
    set_grads(resumed, 1)
    opt2.step()
    got = {n: p.to_local() for n, p in resumed.named_parameters()}
    variance = opt2.optimizers[0].state[resumed.wide]["variance_buffer"]
    return {
        "bitwise": all(torch.equal(expected[n], got[n]) for n in expected),
        "variance_shard": isinstance(variance, DTensor) and variance.placements == (Shard(1),),
    }


# --- tensor parallel ---------------------------------------------------------------------------
DIM = 24
# (wqkv rows, wo columns, MLP hidden, embedding_key rows) per model part: stage 0 uneven TP and
# FSDP2 shards (15/15 -> 8/7 rows; 19/18 -> 10/9, 9/9), a tall fused [w1; w3], a wide w2 (column
# statistics over TP); stage 1 a wide wqkv, a wide fused [w1; w3] (5 rows each: 3/2 -> 2/1, 1/1,
# one shared column statistic) and a 1-row embedding_key (one FSDP2 rank holds none)
STAGES = ((30, 10, 37, 6), (9, 3, 5, 1))
TP_PLAN = {
    "attention.wqkv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
}


class Stage(nn.Module):
    """One layer's Muon weights, named as the model's (``feed_forward.w1.weight`` ...)."""

    def __init__(self, stage: int):
        super().__init__()
        qkv, inner, hidden, key = STAGES[stage]
        torch.manual_seed(10 + stage)
        linear = lambda i, o: nn.Linear(i, o, bias=False)  # noqa: E731
        self.attention = nn.ModuleDict({"wqkv": linear(DIM, qkv), "wo": linear(inner, DIM)})
        self.feed_forward = nn.ModuleDict(
            {"w1": linear(DIM, hidden), "w2": linear(hidden, DIM), "w3": linear(DIM, hidden)}
        )
        self.embedding_key = linear(DIM, key)


def stage_grads(model: nn.Module, step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + step)
    return {n: torch.randn(p.shape, generator=g) for n, p in model.named_parameters()}


def laid_out(stage: int, mesh, dp: tuple[str, ...]) -> nn.Module:
    """``Stage(stage)`` under TP on ``mesh["tp"]`` and, when ``dp`` names mesh dims, FSDP2 (one
    dim) or HSDP (two) over them: the placements torchtitan's parallelize gives."""
    model = Stage(stage)
    tp = mesh["tp"]
    parallelize_module(model, tp, TP_PLAN)
    key = model.embedding_key
    key.weight = nn.Parameter(distribute_tensor(key.weight.detach(), tp, [Replicate()]))
    if dp:
        fully_shard(model, mesh=mesh[dp])
    return model


def named_groups(model: nn.Module) -> list[dict]:
    named = list(model.named_parameters())
    return [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]


def tp_parity(stage: int, mesh, dp: tuple[str, ...], ortho_dtype: str) -> dict:
    """3 steps of Muon (fused [w1; w3]) on the laid-out stage against one process's."""
    ref, model = Stage(stage), laid_out(stage, mesh, dp)
    kw = dict(lr=0.02, weight_decay=0.1, ortho_dtype=ortho_dtype, fuse=MLP_INPUT)
    ref_opt, opt = Muon(named_groups(ref), **kw), Muon(named_groups(model), **kw)
    params = dict(model.named_parameters())
    refs = dict(ref.named_parameters())

    def diff(of=lambda p, opt: p) -> float:
        return max(
            (of(params[n], opt).full_tensor() - of(refs[n], ref_opt)).abs().max().item()
            for n in params
        )

    at_start = diff()
    worst = 0.0
    for step in range(STEPS):
        full = stage_grads(ref, step)
        for n, p in params.items():
            refs[n].grad = full[n]
            p.grad = distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None)
        ref_opt.step()
        opt.step()
        worst = max(worst, diff())
    state = {n: opt.state[p] for n, p in params.items()}
    return {
        "at_start": at_start,
        "max_abs_diff": worst,
        # momentum and NorMuon statistics, gathered whole: a block assembled in the wrong place
        # but sent back to the same place moves the weights by rounding only (Muon commutes with
        # row and column permutations), the statistics of the wrong rows are stored
        "state_max_abs_diff": max(
            diff(lambda p, o, k=k: o.state[p][k]) for k in ("momentum_buffer", "variance_buffer")
        ),
        "collectives_per_step": opt.collectives / STEPS,
        "placements": {n: [repr(pl) for pl in p.placements] for n, p in params.items()},
        "momentum_as_param": all(
            state[n]["momentum_buffer"].placements == p.placements for n, p in params.items()
        ),
        "variance": {
            n: [str(pl) for pl in s["variance_buffer"].placements]
            + [list(s["variance_buffer"].shape)]
            for n, s in state.items()
        },
    }


def tp_resume(folder: str, mesh) -> dict:
    """At TP2 (the trainer's mesh): model and container state saved with DCP after one step,
    loaded into a fresh model and container: the next step equals the uninterrupted run's bit
    for bit, and differs without the optimiser state (so the check can fail)."""
    pair = mesh["tp"].get_group()

    def build():
        model = laid_out(0, mesh, ("dp_shard",))
        return model, container(model, fuse=MLP_INPUT)

    def step(model, opt, i):
        full = stage_grads(model, i)
        for n, p in model.named_parameters():
            p.grad = distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=None)
        opt.step()
        return {n: p.to_local().clone() for n, p in model.named_parameters()}

    model, opt = build()
    step(model, opt, 0)
    dcp.save(
        {"model": model.state_dict(), "optimizer": opt}, checkpoint_id=folder, process_group=pair
    )
    expected = step(model, opt, 1)
    got = {}
    for load_optimizer in (True, False):
        resumed, opt2 = build()
        state = {"model": resumed.state_dict()}
        if load_optimizer:
            state["optimizer"] = opt2
        dcp.load(state, checkpoint_id=folder, process_group=pair)
        resumed.load_state_dict(state["model"])
        got[load_optimizer] = step(resumed, opt2, 1)
        if load_optimizer:
            muon = opt2.optimizers[0]
            kept = all(
                muon.state[p]["momentum_buffer"].placements == p.placements
                and isinstance(muon.state[p]["variance_buffer"], DTensor)
                for p in resumed.parameters()
            )
    same = {k: all(torch.equal(expected[n], g[n]) for n in expected) for k, g in got.items()}
    return {"bitwise": same[True], "without_state_equal": same[False], "state_kept": kept}


def refusals(tp) -> dict[str, str | None]:
    """Muon's one-line errors on layouts it cannot take (None: accepted)."""

    def refused(t: torch.Tensor) -> str | None:
        try:
            Muon([nn.Parameter(t)])
        except (NotImplementedError, RuntimeError) as e:
            return str(e)
        return None

    local = DTensor.from_local
    return {
        "partial": refused(local(torch.zeros(4, 4), tp, [Partial()])),
        "cube_by_columns": refused(
            distribute_tensor(torch.zeros(4, 4, 2), tp, [Shard(1)], src_data_rank=None)
        ),
        "wrong_local_shape": refused(
            local(torch.zeros(3, 4), tp, [Shard(0)], run_check=False, shape=(8, 4), stride=(4, 1))
        ),
    }


def tp_main(out: str) -> dict:
    result = {}
    names = ("pp", "dp_shard", "tp")
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=names)
    stage = mesh.get_coordinate()[0]
    for dtype in ("float32", "bfloat16"):
        result[f"pp2_fsdp2_tp2_{dtype}"] = tp_parity(stage, mesh, ("dp_shard",), dtype)
    result["stage"] = stage
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    result["hsdp2x2_tp2_float32"] = tp_parity(0, mesh, ("dp_replicate", "dp_shard"), "float32")
    mesh = init_device_mesh("cpu", (4, 1, 2), mesh_dim_names=("pairs", "dp_shard", "tp"))
    pair = mesh.get_coordinate()[0]
    for dtype in ("float32", "bfloat16"):
        result[f"tp2_{dtype}"] = tp_parity(pair % 2, mesh, ("dp_shard",), dtype)
    result["tp2_resume"] = tp_resume(os.path.join(out, f"ckpt_tp2_{pair}"), mesh)
    plain = init_device_mesh("cpu", (4, 2), mesh_dim_names=("pairs", "tp"))
    result["tp2_plain_float32"] = tp_parity(pair % 2, plain, (), "float32")
    result["refusals"] = refusals(plain["tp"])
    return result


def main(out: str, mode: str = "fsdp") -> None:
    cpu.release_gloo_at_exit()  # no SIGABRT at exit (see release_gloo_at_exit)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    if mode == "tp":
        result = tp_main(out)
    else:
        result = {
            f"{'x'.join(map(str, mesh))}_{dtype}": parity(mesh, dtype)
            for mesh in ((2,), (1, 2), (2, 1))
            for dtype in ("float32", "bfloat16")
        }
        # one matrix: rank 1 owns nothing and sends nothing back
        result["single_float32"] = parity((2,), "float32", params=("tall",))
        result["dcp"] = dcp_resume(os.path.join(out, "ckpt"))
        for dtype in ("float32", "bfloat16"):
            result[f"fused_{dtype}"] = fused_parity(dtype)
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


def launch(out, nproc: int, *args: str, timeout: int) -> list[dict]:
    """This worker on ``nproc`` gloo ranks (torchrun, one thread each) writing into ``out``;
    every rank's result."""
    from pathlib import Path

    from tests import forkserver

    here = Path(__file__).resolve()
    root = here.parents[2]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    cmd += ["--rdzv_backend", "c10d", "--rdzv_endpoint", "localhost:0"]
    cmd += [str(here), str(out), *args]
    p = forkserver.run(cmd, env=env, cwd=root, timeout=timeout)
    assert p.returncode == 0, p.stderr[-5000:]
    return [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(nproc)]


if __name__ == "__main__":
    main(*sys.argv[1:])
