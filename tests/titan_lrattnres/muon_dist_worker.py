"""2-rank Muon checks (run by test_muon.py under torch.distributed.run, gloo, CPU).

Each rank writes ``OUT/rank{r}.json``: for every layout (FSDP2 1-D mesh, HSDP (1, 2) and (2, 1)
meshes) and ortho dtype, the largest |2-rank - 1-process| parameter difference over 3 steps and
the all-to-all count; then whether a DCP save / load of the optimiser state gives a bitwise
identical next step. The 1-process reference runs in each rank on plain tensors. ``fused_*``:
pairs of parameters fused into one matrix (``Muon(fuse=...)``), each member sharded by its own
rows, against one process's Muon on the concatenated matrices.
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
from torch.distributed.tensor import DTensor, Shard

from titan_lrattnres.components.muon import Muon
from titan_lrattnres.components.optimizers import MuonOptimizersContainer, ParamGroup
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


def container(model: nn.Module) -> MuonOptimizersContainer:
    group = ParamGroup(
        pattern=".*", optimizer_name="Muon", min_ndim=2, optimizer_kwargs={"lr": 0.02}
    )
    cfg = MuonOptimizersContainer.Config(param_groups=[group], implementation="for-loop")
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


def main(out: str) -> None:
    cpu.release_gloo_at_exit()  # no SIGABRT at exit (see release_gloo_at_exit)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
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


if __name__ == "__main__":
    main(sys.argv[1])
