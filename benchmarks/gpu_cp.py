"""Context parallel (CP=2) against one device: the project's model under torchtitan's CP.

    python -m benchmarks.gpu_cp [--out PATH] [--dry-run] [--seq-len T] [--cases a,b,...]

Two processes (spawned here) run one forward and backward of each case under torchtitan's CP
with ``spmd_backend="spmd_types"``, the path the Trainer takes: the batch, its labels and
positions sharded in the load-balanced order (``prepare_context_parallel_input``, "headtail":
rank i holds chunks i and 3-i of 4), the FlexAttention ``BlockMask`` built on the whole sequence
and CP-sharded with them, each attention's keys and values all-gathered over CP and their
gradients reduce-scattered back (the inner attention's layout), FSDP2 over ``dp_shard`` x ``cp``
summing every gradient (the layers' queries and the embedding key included). Rank 0 runs the same
model, from the same weights, on the whole sequence in one process. Compared: the loss and every
parameter's gradient (relative error ||g - g_ref|| / ||g_ref||, and the largest element
difference), fp32, TF32 off.

Cases (flavor ``debug``: d=64, L=2 layers, 4 sublayers): ``sliced_block`` (S-LR, Block N=2,
r=16, the fused phase-1 op), ``projected_block`` (P-LR, Block N=2, r=16: the embedding key and
the fused ``[W^O; W^K]``), ``sliced_full_documents`` (Full, the reference read, a batch of packed
documents: positions restart, the mask is causal within each document).

On GPUs: NCCL, FlexAttention as torchtitan compiles it; needs 2 GPUs, otherwise it prints "needs
2 GPUs, found N", records that in the JSON and exits 0. ``--dry-run``: the same on the CPU, 2
gloo processes, with :class:`titan_lrattnres.parallel.context.DenseFlexAttention` (FlexAttention's
mask, SDPA's math kernel: FlexAttention has no CPU backward) and the masks' compiled
``create_block_mask`` run eagerly; ~30 s on 2 cores. Exit status 1 when a case fails its
tolerance or raises. The GPU run's time is not measured yet: it is mostly torchtitan's
max-autotune compiles of FlexAttention (forward and backward, whole and local query lengths).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

import torch

from benchmarks.meta import environment, write

WORLD = 2
SEED = 0
BATCH = 2
# Relative tolerance on the loss and on every gradient. CPU, measured (dry run, T=256): loss
# <= 1.2e-7, gradients <= 1.2e-6 (a layer's queries'), from rounding: the CP ranks' partial
# gradients are summed in another order, the attention reduces over keys in another order.
# CUDA: not measured yet; FlexAttention's tiles over the local and the whole sequence differ.
TOL = {"cpu": 1e-5, "cuda": 1e-4}
CASES = {
    "sliced_block": dict(variant="sliced", blocks=2, rank=16, depth_backend="auto"),
    "projected_block": dict(variant="projected", blocks=2, rank=16, depth_backend="auto"),
    "sliced_full_documents": dict(
        variant="sliced", blocks=None, rank=16, depth_backend="reference", documents=True
    ),
}


def trainer_config(seq_len: int, cp: int):
    """The Trainer config the model config is updated from (``cpu_smoke``, CP degree ``cp``)."""
    from train_configs.cpu import cpu_smoke

    config = cpu_smoke()
    config.training.seq_len = seq_len
    config.parallelism.context_parallel_degree = cp
    config.parallelism.data_parallel_shard_degree = 1
    return config


def model_spec(case: str, config, device_type: str):
    """The project's ModelSpec for ``case`` with FlexAttention (DenseFlexAttention on the
    CPU), updated from ``config`` as the Trainer does."""
    from titan_lrattnres.parallel.context import DenseFlexAttention
    from titan_lrattnres.spec import model_registry

    kwargs = {k: v for k, v in CASES[case].items() if k != "documents"}
    spec = model_registry("debug", attn_backend="flex", **kwargs)
    if device_type == "cpu":
        for layer in spec.model.layers:
            if layer.attention is not None:
                layer.attention.inner_attention = DenseFlexAttention.Config()
    config.model_spec = spec
    spec.model.update_from_config(config=config)
    return spec


def build(spec, device: torch.device):
    """The model from seed ``SEED``, queries drawn N(0, 1.5/sqrt(r)) (zero queries make every
    read a plain mean and the embedding key's gradient zero)."""
    torch.manual_seed(SEED)
    model = spec.model.build()
    model.init_states(buffer_device=torch.device("cpu"))
    with torch.no_grad():
        for q in model.depth_queries():
            q.normal_(0, 1.5 / q.shape[-1] ** 0.5)
    return model.to(device)


def batch(case: str, seq_len: int, vocab: int, device: torch.device):
    """Inputs, labels ``[BATCH, seq_len]`` and positions (one document, or packed documents
    whose positions restart at a few cuts per row)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (BATCH, seq_len + 1), generator=g)
    positions = torch.arange(seq_len).repeat(BATCH, 1)
    if CASES[case].get("documents"):
        for row, cuts in enumerate(([seq_len // 3, seq_len // 2 + 7], [seq_len // 4 + 5])):
            for cut in cuts:
                positions[row, cut:] = torch.arange(seq_len - cut)
    return tokens[:, :-1].to(device), tokens[:, 1:].to(device), positions.to(device)


def loss_and_grads(model, inputs, labels, positions, n_tokens: int, context=None, cp_mesh=None):
    """Summed cross-entropy / ``n_tokens``, every parameter's full gradient, and with
    ``cp_mesh`` (the batch CP-sharded first, the loss summed over ranks) the positions that
    start each rank's two chunks of row 0, per rank."""
    import contextlib

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    kwargs = {"positions": positions, "attention_masks": model.get_attention_masks(positions)}
    if cp_mesh is not None:
        from torchtitan.distributed.context_parallel import prepare_context_parallel_input

        inputs, labels, kwargs = prepare_context_parallel_input(
            inputs, labels, kwargs, cp_mesh, inputs.device, load_balancer_type="headtail"
        )
    with context() if context is not None else contextlib.nullcontext():
        logits = model(inputs, **kwargs)
        ce = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
        )
        loss = ce / n_tokens
        loss.backward()
    loss, chunks = loss.detach(), None
    if cp_mesh is not None:
        dist.all_reduce(loss, group=cp_mesh.get_group())
        row = kwargs["positions"][0]
        chunks = [None] * cp_mesh.size()
        dist.all_gather_object(chunks, row[:: row.numel() // 2].tolist(), cp_mesh.get_group())
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        grads[name] = g.detach().double().cpu()
    return float(loss), grads, chunks


def compare(loss: float, grads: dict, ref_loss: float, ref_grads: dict, tol: float) -> dict:
    """Relative loss and gradient errors, per parameter, and whether all are within ``tol``."""
    if grads.keys() != ref_grads.keys():
        raise ValueError(f"parameters differ: {sorted(grads.keys() ^ ref_grads.keys())}")
    rel, max_abs, ref_norm = {}, {}, {}
    for name, ref in ref_grads.items():
        diff = grads[name] - ref
        ref_norm[name] = float(ref.norm())
        rel[name] = float(diff.norm()) / max(ref_norm[name], 1e-30)
        max_abs[name] = float(diff.abs().max())
    loss_rel = abs(loss - ref_loss) / abs(ref_loss)
    ok = loss_rel <= tol and all(r <= tol for r in rel.values())
    ok = ok and all(n > 0 for n in ref_norm.values())  # every gradient compared is not zero
    return {
        "loss": loss,
        "ref_loss": ref_loss,
        "loss_rel_err": loss_rel,
        "grad_rel_err": rel,
        "grad_max_abs_diff": max_abs,
        "ref_grad_norm": ref_norm,
        "max_grad_rel_err": max(rel.values()),
        "tolerance": tol,
        "ok": ok,
    }


def run_case(case: str, seq_len: int, parallel_dims, device: torch.device) -> dict | None:
    """One case on every rank; rank 0 returns the comparison with one process."""
    import torch.distributed as dist
    from torchtitan.distributed import utils as dist_utils

    rank, kind = dist.get_rank(), device.type
    config = trainer_config(seq_len, parallel_dims.cp)
    spec = model_spec(case, config, kind)
    inputs, labels, positions = batch(case, seq_len, spec.model.vocab_size, device)
    n_tokens = labels.numel()
    ref = None
    if rank == 0:  # one process, the whole sequence, the same weights
        ref = loss_and_grads(build(spec, device), inputs, labels, positions, n_tokens)[:2]
    model = spec.parallelize_fn(
        build(spec, device),
        parallel_dims=parallel_dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=None,
        dump_folder=tempfile.gettempdir(),
    )
    context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    loss, grads, chunks = loss_and_grads(
        model, inputs, labels, positions, n_tokens, context, parallel_dims.get_mesh("cp")
    )
    if rank != 0:
        return None
    return {**compare(loss, grads, *ref, TOL[kind]), "chunk_first_positions": chunks}


def _worker(rank: int, init_file: str, kind: str, seq_len: int, cases: list, out: str) -> None:
    import torch.distributed as dist

    if kind == "cpu":
        from titan_lrattnres.training import cpu

        cpu.apply()
        torch.set_num_threads(1)
        # the BlockMasks' torch.compile'd create_block_mask run eagerly: the same masks, without
        # two inductor compiles (most of the dry run's time on 2 cores)
        torch.compiler.set_stance("force_eager")
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        device = torch.device("cuda", rank)
    from torchtitan.distributed.parallel_dims import ParallelDims

    dist.init_process_group(
        "gloo" if kind == "cpu" else "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD,
    )
    try:
        parallel_dims = ParallelDims(
            dp_replicate=1, dp_shard=1, cp=WORLD, tp=1, pp=1, ep=1, world_size=WORLD,
            spmd_backend="spmd_types",
        )  # fmt: skip
        parallel_dims.build_mesh()
        results = {}
        for case in cases:
            try:
                results[case] = run_case(case, seq_len, parallel_dims, device)
            except Exception as e:  # recorded; the other cases still run
                results[case] = {"error": f"{type(e).__name__}: {e}", "ok": False,
                                 "traceback": traceback.format_exc()[-3000:]}  # fmt: skip
                if rank == 0:
                    print(results[case]["traceback"], file=sys.stderr)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def run(*, dry_run: bool, seq_len: int, cases: list[str]) -> dict:
    """The result dict (also what ``main`` writes)."""
    kind = "cpu" if dry_run else "cuda"
    result = {"dry_run": dry_run, "device": kind, "world": WORLD, "seq_len": seq_len,
              "batch": BATCH, "cases": cases}  # fmt: skip
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise ValueError(f"unknown cases {unknown}; known: {list(CASES)}")
    if seq_len % (WORLD * 128):
        raise ValueError(f"--seq-len must be a multiple of {WORLD * 128} (CP's BlockMask shards)")
    if not dry_run:
        found = torch.cuda.device_count()
        if found < WORLD:
            reason = f"needs {WORLD} GPUs, found {found}"
            print(reason)
            return {**result, "skipped": reason, "environment": environment()}
    result["environment"] = environment("cuda:0" if kind == "cuda" else None)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        mp.spawn(_worker, args=(str(Path(tmp) / "init"), kind, seq_len, cases, str(out)),
                 nprocs=WORLD)  # fmt: skip
        result["results"] = json.loads(out.read_text())
    result["all_ok"] = all(r["ok"] for r in result["results"].values())
    for case, r in result["results"].items():
        if "error" in r:
            print(f"{case}: ERROR {r['error']}")
        else:
            print(
                f"{case}: loss {r['loss']:.7f} (one device {r['ref_loss']:.7f}, rel "
                f"{r['loss_rel_err']:.1e}), max gradient rel err {r['max_grad_rel_err']:.1e} "
                f"over {len(r['grad_rel_err'])} parameters, tolerance {r['tolerance']:.0e}: "
                f"{'ok' if r['ok'] else 'FAIL'}"
            )
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="benchmarks/results/gpu_cp.json", help="result JSON")
    p.add_argument("--dry-run", action="store_true", help="CPU, gloo, DenseFlexAttention")
    p.add_argument("--seq-len", type=int, default=None, help="default: 256 dry, 1024 on GPUs")
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args(argv)
    seq_len = args.seq_len or (256 if args.dry_run else 1024)
    result = run(dry_run=args.dry_run, seq_len=seq_len, cases=args.cases.split(","))
    write(args.out, result)
    return 0 if result.get("skipped") or result["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
