"""Peak memory of one training step per variant, per rank, predicted on the CPU without a GPU.

    python -m benchmarks.memory [--flavor paper_0p5b] [--seq 2048] [--batch 4]
        [--variants baseline,block8,...] [--ac none,selective,full] [--fsdp 8,64]
        [--dtype bf16|fp32] [--optimizer recipe|adamw] [--json PATH]

Why: the routed variants keep every block's (or every sublayer's) output alive across the
depth loop, so their activation memory is not the baseline's; the paper's shape does not fit a
CPU, nor always a GPU. How: the project's model is built under ``FakeTensorMode`` (shapes,
dtypes and storages, no data), parallelized as torchtitan's ``parallelize_llama`` does it (the
AC policy on every entry of ``model.layers`` -- one sublayer each --, then FSDP2 through
``apply_fsdp_to_decoder``: parameters in ``--dtype``, fp32 master weights and reductions) over a
fake process group of the FSDP size, and one training step runs as torchtitan's ``train_step``
does: ``zero_grad(set_to_none)``, forward with the chunked LM head + loss (``ChunkedLossWrapper``,
8 chunks; CE + z-loss with the paper recipe), backward, gradient clipping, optimizer step.
``FSDPMemTracker`` (torch.distributed._tools) counts every storage by category as it is created
and freed. Steady state: the optimizer state exists before the step (one zero-gradient step
first, torchtitan's ``init_optim_state``).

Categories (bytes per rank; ``raw_*`` in the JSON keep the tracker's own): parameters = sharded
fp32 masters + unsharded (gathered) parameters + buffers + all-gather buffers; gradients =
sharded + unsharded gradients + reduce-scatter buffers; optimizer = optimizer state and
everything the optimizer step allocates; activations = tensors saved or made in the forward (and
in AC recomputation) + the step's inputs; temporaries = tensors made in the backward. Reported
both at the moment of the total's peak and as each category's own maximum over the step.

What it does not see: memory allocated inside a kernel and not through a tensor (e.g. Triton
scratch), the caching allocator's fragmentation and rounding beyond 512 B blocks, NCCL buffers,
and compiled sublayers (the step runs eager; inductor's partitioner saves fewer activations).
Attention runs as SDPA (CPU flash: output + log-sum-exp saved, as flash / FlexAttention do on a
GPU; selective AC saves it as it saves those). ``tests/benchmarks/test_memory.py`` holds the
tracker to a real CPU run at a small shape; ``benchmarks/gpu_check.py``'s ``memory`` section to
``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from enum import Enum

import torch

from benchmarks.meta import environment, write
from benchmarks.overhead import AC_MODES, VARIANTS, parse_variant

GIB = 2**30
DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "torchtitan")  # the project's model only
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# tracker category (FSDPMemTracker's _FSDPRefType name) -> reported category
GROUPS = {
    "parameters": ("SHARDED_PARAM", "UNSHARDED_PARAM", "BUFFER", "ALL_GATHER"),
    "gradients": ("SHARDED_GRAD", "UNSHARDED_GRAD", "REDUCE_SCATTER"),
    "optimizer": ("OPT",),
    "activations": ("ACT", "INP"),
    "temporaries": ("TEMP",),
}


@dataclass(frozen=True)
class Case:
    """One configuration: the model (flavor, variant, blocks / block_layers, rank), the step's
    shape (seq, local batch), the AC mode, the FSDP size and the training recipe."""

    flavor: str = "paper_0p5b"
    variant: str = "baseline"  # baseline | attnres | sliced | projected
    blocks: int | None = None  # None with block_layers None: Full
    rank: int = 64
    seq: int = 2048
    batch: int = 4
    ac: str = "none"  # none | selective | full
    fsdp: int = 8
    dtype: str = "bf16"  # FSDP2 parameter dtype (masters and reductions are fp32)
    optimizer: str = "recipe"  # recipe (Muon + AdamW, train_configs.recipe) | adamw
    z_loss: float = 1e-5  # the recipe's loss; 0: plain cross-entropy
    loss_chunks: int = 8  # ChunkedLossWrapper's default
    implementation: str = "fused"  # AdamW's: fused (GPU configs) | foreach (CPU configs)
    ortho_dtype: str = "bfloat16"  # Muon's Polar Express (the CPU configs: float32)
    block_layers: int | None = None
    max_norm: float = 1.0

    @classmethod
    def named(cls, name: str, **kw) -> Case:
        """The case of a ``benchmarks.overhead`` variant name (e.g. ``sliced8_r64``; standard
        AttnRes: r = d; the baseline: rank 0, unused)."""
        from titan_lrattnres.model.registry import FLAVORS

        variant, blocks, rank = parse_variant(name)
        if variant == "attnres":
            rank = FLAVORS[kw.get("flavor", cls.flavor)].dim
        return cls(variant=variant, blocks=blocks, rank=rank, **kw)


def _reftype_name(key) -> str:
    return key.name if isinstance(key, Enum) else key  # the enum's values have spaces


def _grouped(snap: dict[str, int]) -> dict[str, int]:
    return {g: sum(snap.get(k, 0) for k in keys) for g, keys in GROUPS.items()}


def _tracker_class():
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker, _FSDPRefType

    class Tracker(FSDPMemTracker):
        """FSDPMemTracker plus each category's own maximum, and optimizer containers
        (torchtitan's OptimizersContainer holds its optimizers' state, not its own)."""

        def __init__(self, mod, optimizers):
            super().__init__(mod, None)
            self._container = optimizers
            self.category_max: dict[str, int] = {}  # tracker and reported categories

        def _record_max(self):
            for snap in self._curr_mem_snap.values():  # one device
                named = {_reftype_name(k): v for k, v in snap.items()}
                for key, v in (*named.items(), *_grouped(named).items()):
                    self.category_max[key] = max(self.category_max.get(key, 0), v)

        def _update_peak_stats(self, peak_state) -> None:
            super()._update_peak_stats(peak_state)
            self._record_max()

        def _instrument_optimizer(self) -> None:
            container = self._container
            if container is None:
                return
            for opt in container:
                self._track_optimizer_states(_FSDPRefType.OPT, opt)

            def pre(*_):
                self._in_opt = True

            def post(*_):
                for opt in container:
                    self._track_optimizer_states(_FSDPRefType.OPT, opt)
                self._in_opt = False

            self._optimizer_hook_handles = (
                container.register_step_pre_hook(pre),
                container.register_step_post_hook(post),
            )

        def __enter__(self):
            out = super().__enter__()
            self._record_max()
            self._forget_handles = []
            return out

        def __exit__(self, *args):
            for h in self._forget_handles:
                h.remove()
            super().__exit__(*args)

        def allow_repeated_calls(self, module) -> None:
            """The chunked loss calls the LM head once per chunk, outside the model's forward:
            the tracker takes a second such call for a second iteration and refuses it.
            Forgetting the module's per-module statistics before each forward call allows it
            (they are not used here; the totals are kept)."""

            def forget(mod, args):
                if not self._mod_tracker.is_bw:
                    self.memory_tracking.pop(mod, None)

            self._forget_handles.append(module.register_forward_pre_hook(forget, prepend=True))

    return Tracker


@contextlib.contextmanager
def process_group(world: int, fake: bool, device: str = "cpu"):
    """A default process group for one configuration, destroyed after it: the fake backend
    (collectives do nothing) at any world size, or a real one-rank group (gloo / nccl)."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("benchmarks.memory needs the default process group to itself")
    if fake:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    else:
        if world != 1:
            raise ValueError("a real run is one process: FSDP size 1")
        backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _selective_ac():
    """torchtitan's SelectiveAC with CPU flash attention in its save list (it lists the GPU's
    flash / efficient / FlexAttention ops; the fake step runs the CPU one in their place)."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    class CpuFlashSelectiveAC(SelectiveAC):
        def get_save_ops(self) -> set:
            return super().get_save_ops() | {
                torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
            }

    return CpuFlashSelectiveAC(SelectiveAC.Config())


def apply_ac(model, mode: str) -> None:
    """The AC mode on every entry of ``model.layers`` (one sublayer each), as torchtitan does."""
    from torchtitan.distributed.activation_checkpoint import FullAC

    if mode == "full":
        FullAC.Config().build().apply(model)
    elif mode == "selective":
        _selective_ac().apply(model)
    elif mode != "none":
        raise ValueError(f"ac must be one of {AC_MODES}, got {mode!r}")


def build_optimizers(model, case: Case):
    """The recipe's Muon / AdamW container (``recipe_param_groups``) or one AdamW group."""
    from titan_lrattnres.components.optimizers import (
        MuonOptimizersContainer,
        ParamGroup,
        recipe_param_groups,
    )

    if case.optimizer == "recipe":
        config = recipe_param_groups(
            case.variant, implementation=case.implementation, ortho_dtype=case.ortho_dtype
        )
    elif case.optimizer == "adamw":
        kwargs = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
        group = ParamGroup(pattern=".*", optimizer_name="AdamW", optimizer_kwargs=kwargs)
        config = MuonOptimizersContainer.Config(
            param_groups=[group], implementation=case.implementation
        )
    else:
        raise ValueError(f"optimizer must be recipe or adamw, got {case.optimizer!r}")
    return config.build(model_parts=[model])


def build_loss(model, case: Case):
    """torchtitan's chunked LM head + loss (the model returns the final hidden states)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss

    if case.z_loss:
        from titan_lrattnres.components.zloss import ZLossCrossEntropy

        inner = ZLossCrossEntropy.Config(z_loss_weight=case.z_loss)
    else:
        inner = CrossEntropyLoss.Config()
    loss = ChunkedLossWrapper.Config(num_chunks=case.loss_chunks, loss_fn=inner).build()
    loss.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    return loss


def build(case: Case, mesh, device: str = "cpu"):
    """(model, optimizers, loss, tokens, labels) of ``case``: the model built, AC applied,
    FSDP2 over ``mesh``, the optimizer state materialized."""
    from torchtitan.components.optimizer.utils import init_optim_state
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    from titan_lrattnres.model.registry import FLAVORS, build_model_config

    flavor = FLAVORS[case.flavor]
    blocks = None if case.blocks is None else min(case.blocks, 2 * flavor.n_layers)
    schedule = {"blocks": blocks} if case.block_layers is None else {}
    config = build_model_config(
        case.flavor,
        variant=case.variant,
        block_layers=case.block_layers,
        rank=min(case.rank or 64, flavor.dim),  # the baseline's: unused
        attn_backend="sdpa",
        **schedule,
    )
    # as the model config does under the trainer: with AC every read is recomputed in the
    # backward and the sublayer reading h keeps no copy of it
    config.router.recompute_reads = case.ac != "none"
    dev = torch.device(device)
    with torch.device(dev):
        model = config.build()
    model.init_states(buffer_device=dev)
    model.train()
    apply_ac(model, case.ac)
    apply_fsdp_to_decoder(
        model,
        mesh,
        param_dtype=DTYPES[case.dtype],
        reduce_dtype=torch.float32,
        pp_enabled=False,
        cpu_offload=False,
        reshard_after_forward_policy="default",
    )
    optimizers = build_optimizers(model, case)
    for opt in optimizers:
        init_optim_state(opt)
    loss_fn = build_loss(model, case)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, flavor.vocab_size, (case.batch, case.seq + 1), generator=g)
    tokens, labels = data[:, :-1].contiguous().to(dev), data[:, 1:].contiguous().to(dev)
    return model, optimizers, loss_fn, tokens, labels


def train_step(model, optimizers, loss_fn, tokens, labels, max_norm: float):
    """torchtitan's ``train_step`` without the data loader and the logging."""
    from torchtitan.distributed import utils as dist_utils

    optimizers.zero_grad(set_to_none=True)
    global_valid_tokens = torch.tensor(labels.numel(), device=labels.device)
    pred = model(tokens)
    loss, _ = loss_fn(pred, labels, global_valid_tokens)
    del pred
    loss.backward()
    dist_utils.clip_grad_norm_(list(model.parameters()), max_norm, foreach=True)
    optimizers.step()
    return loss


def device_snapshot(snaps: dict, device: str) -> dict:
    """The tracker's snapshot of ``device`` among its per-device ones (a CUDA step also holds a
    few host tensors, which get an entry of their own: left out, as the prediction has none)."""
    kind = torch.device(device).type
    mine = [snap for d, snap in snaps.items() if torch.device(d).type == kind]
    if len(mine) != 1:
        raise RuntimeError(f"expected one {kind} snapshot, got devices {list(snaps)}")
    return mine[0]


def track(case: Case, device: str = "cpu", fake: bool = True, step_hook=None) -> dict:
    """The tracked step of ``case`` (a process group must be up): peak total, the categories at
    the peak and each one's own maximum, in bytes. ``step_hook``: a context manager entered
    around the tracked step alone (the real run's independent measure)."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh(torch.device(device).type, (world,), mesh_dim_names=("fsdp",))
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model, optimizers, loss_fn, tokens, labels = build(case, mesh, device)
        tracker = _tracker_class()(model, optimizers)
        tracker.track_inputs((tokens, labels))
        with step_hook() if step_hook else contextlib.nullcontext(), tracker:
            tracker.allow_repeated_calls(model.lm_head)
            train_step(model, optimizers, loss_fn, tokens, labels, case.max_norm)
        snaps = tracker.get_tracker_snapshot("peak")
    snap = device_snapshot(snaps, device)
    raw = {_reftype_name(k): v for k, v in snap.items() if _reftype_name(k) != "Total"}
    maxima = tracker.category_max
    return {
        "peak": snap["Total"],
        "at_peak": _grouped(raw),
        "max": {g: maxima.get(g, 0) for g in GROUPS},
        "raw_at_peak": raw,
        "raw_max": {k: v for k, v in maxima.items() if k not in GROUPS and k != "Total"},
        "optimizers": sorted({type(o).__name__ for o in optimizers}),
    }


def measure(case: Case, fallback: bool = True) -> dict:
    """``track`` of ``case`` under fake tensors on a fake process group of ``case.fsdp`` ranks.
    If the recipe's optimizer fails there, AdamW in its place (``optimizer_note`` says why)."""
    t0 = time.perf_counter()
    try:
        with process_group(case.fsdp, fake=True):
            out = track(case)
        out["optimizer"] = case.optimizer
    except Exception as error:
        if not (fallback and case.optimizer == "recipe"):
            raise
        why = traceback.format_exc(limit=3).strip().splitlines()[-1]
        try:
            with process_group(case.fsdp, fake=True):
                out = track(replace(case, optimizer="adamw"))
        except Exception:
            raise error from None  # not the optimizer's failure
        out["optimizer"] = "adamw"
        out["optimizer_note"] = f"the recipe's Muon failed under fake tensors ({why})"
    out["seconds"] = time.perf_counter() - t0
    return out


def _profiled_peak(prof, window: str) -> int:
    """Peak bytes live during the ``window`` range of a CPU profile with ``profile_memory``:
    the allocation events in time order, each free subtracting what its pointer was given in
    this profile (a free of an earlier allocation is not this profile's)."""
    from torch._C._profiler import _EventType

    events, spans, stack = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.typed[0] == _EventType.Allocation:
            fields = node.typed[1]
            events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        elif node.name == window:
            spans.append((node.start_time_ns, node.end_time_ns))
        stack.extend(node.children)
    ((start, end),) = spans
    live, total, peak = {}, 0, 0
    for t, size, ptr in sorted(events, key=lambda e: e[0]):
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if start <= t <= end:
            peak = max(peak, total)
    return peak


def measure_real(case: Case, device: str = "cpu") -> dict:
    """``track`` of ``case`` on real tensors (one process: FSDP size 1 on a one-rank gloo / nccl
    group), plus ``measured_peak``, the step's peak measured apart from the tracker: on CUDA
    ``torch.cuda.max_memory_allocated()`` over the step less what was allocated before the model
    was built; on the CPU the profiler's allocation events (``profile_memory``) from before the
    model was built, the most bytes live at once during the step."""
    if case.fsdp != 1:
        raise ValueError("a real run is one process: fsdp=1")
    t0 = time.perf_counter()
    if torch.device(device).type == "cuda":
        gc.collect()  # an earlier run's garbage, freed during this step, would lower its peak
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)

        @contextlib.contextmanager
        def window():
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield

        with process_group(1, fake=False, device=device):
            out = track(case, device, fake=False, step_hook=window)
            torch.cuda.synchronize(device)
        out["measured_peak"] = torch.cuda.max_memory_allocated(device) - before
        out["measured_by"] = "torch.cuda.max_memory_allocated"
    else:
        from torch.profiler import ProfilerActivity, profile, record_function

        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            with process_group(1, fake=False):
                out = track(case, device, fake=False,
                            step_hook=lambda: record_function("tracked_step"))  # fmt: skip
        out["measured_peak"] = _profiled_peak(prof, "tracked_step")
        out["measured_by"] = "torch.profiler CPU allocation events"
    out["seconds"] = time.perf_counter() - t0
    return out


def cases(flavor, variants, ac_modes, fsdp_sizes, **kw) -> list[tuple[str, Case]]:
    return [(name, Case.named(name, flavor=flavor, ac=ac, fsdp=w, **kw))
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
