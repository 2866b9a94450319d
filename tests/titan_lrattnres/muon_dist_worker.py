"""2-rank Muon checks (run by test_muon.py under torch.distributed.run, gloo, CPU).

Each rank writes ``OUT/rank{r}.json``: for every layout (FSDP2 1-D mesh, HSDP (1, 2) and (2, 1)
meshes) and ortho dtype, the largest |2-rank - 1-process| parameter difference over 3 steps and
the all-to-all count; then whether a DCP save / load of the optimiser state gives a bitwise
identical next step. The 1-process reference runs in each rank on plain tensors.
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
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(result, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
