"""Peak memory of one training step per rank, predicted on the CPU without a GPU:
``measure(Case(...))``. The sweep's memory column; the command with its table of variants is
``python -m benchmarks.memory``.

Why: the routed variants keep every block's (Block) or every sublayer's (Full) output alive
across the depth loop, so their activation memory is not the baseline's; the paper's shape does
not fit a CPU, nor always a GPU. How: the project's model is built under ``FakeTensorMode``
(shapes, dtypes and storages, no data), parallelized as torchtitan's ``parallelize_llama`` does
it (the AC policy on every entry of ``model.layers`` -- one layer each: attention, MLP and the
reads of its two sites --, then FSDP2 through ``apply_fsdp_to_decoder``: parameters in
``--dtype``, fp32 master weights and reductions) over a fake process group of the FSDP size, and
one training step runs as torchtitan's ``train_step`` does: ``zero_grad(set_to_none)``, forward
with the chunked LM head + loss (``ChunkedLossWrapper``, 8 chunks;
CE + z-loss with the paper recipe), backward, gradient clipping, optimizer step.
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
and compiled layers (the step runs eager; inductor's partitioner saves fewer activations).
Attention runs as SDPA (CPU flash: output + log-sum-exp saved, as flash / FlexAttention do on a
GPU; selective AC saves it as it saves those). ``tests/benchmarks/test_memory.py`` holds the
tracker to a real CPU run (``measure_real``) at a small shape; ``benchmarks/gpu_check.py``'s
``memory`` section to ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import contextlib
import gc
import time
import traceback
from dataclasses import dataclass, replace
from enum import Enum

import torch

AC_MODES = ("none", "selective", "full")
GIB = 2**30
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
        raise RuntimeError("the memory prediction needs the default process group to itself")
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
    """The AC mode on every entry of ``model.layers`` (one layer each), as torchtitan does."""
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

    from titan_lrattnres.model.registry import FLAVORS, build_model_config, schedule_kwargs

    flavor = FLAVORS[case.flavor]
    blocks = None if case.blocks is None else min(case.blocks, 2 * flavor.n_layers)
    config = build_model_config(
        case.flavor,
        variant=case.variant,
        rank=min(case.rank or 64, flavor.dim),  # the baseline's: unused
        attn_backend="sdpa",
        **schedule_kwargs(blocks, case.block_layers),
    )
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
