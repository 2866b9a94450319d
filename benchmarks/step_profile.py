"""Where a training step's time goes: one step under ``torch.profiler``, its time by class of
work (matmuls, attention, the depth reads' own kernels, Inductor's fused kernels, the rest).

On a GPU the classes are of CUDA kernels (their own time); on the CPU of the profiled events'
self time, "the rest" being the step's wall time less the classified (Python, autograd, the
compiled graphs' wrappers). Used by ``benchmarks.overhead --profile`` and the GPU run
``benchmarks.gpu_speed``."""

from __future__ import annotations

import time

import torch

# class -> name fragments (lower case), first match wins
CLASSES = (
    ("depth reads", ("_read_fwd_kernel", "_read_bwd_kernel", "_merge_", "block_read",
                     "merge_partial", "depth_read", "read_backward")),
    ("attention", ("flash", "flex", "attention", "fmha", "sdpa", "scaled_dot_product")),
    ("matmuls", ("gemm", "cutlass", "xmma", "cublas", "nvjet", "aten::mm", "aten::addmm",
                 "aten::bmm", "_mm_")),
    ("Inductor fused", ("triton_", "compiledfxgraph")),
)  # fmt: skip
LABELS = tuple(c for c, _ in CLASSES) + ("other",)


def kernel_class(name: str) -> str:
    low = name.lower()
    for label, needles in CLASSES:
        if any(n in low for n in needles):
            return label
    return "other"


def profile_step(step, device, calls: int = 3) -> dict[str, float]:
    """Milliseconds per call of ``step`` by class (see the module docstring), the mean of
    ``calls`` calls (one CPU matmul's time alone can move by a quarter from call to call)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.device(device).type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize()
        wall_ms = 1e3 * (time.perf_counter() - t0)
    by_class = dict.fromkeys(LABELS, 0.0)
    for evt in prof.key_averages():
        if cuda and evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        label = kernel_class(evt.key)
        if not cuda and label == "other":
            continue  # the CPU's rest: wall time less the classes, below
        us = evt.self_device_time_total if cuda else evt.self_cpu_time_total
        by_class[label] += us / 1e3
    if not cuda:
        by_class["other"] = max(wall_ms - sum(by_class.values()), 0.0)
    return {label: ms / calls for label, ms in by_class.items()}


def profile_table(rows: dict[str, dict[str, float]], against: str | None = None) -> str:
    """Milliseconds per class and variant; under each routed variant, its difference to
    ``against`` (default: the first row)."""
    against = against or next(iter(rows), None)
    lines = [f"{'ms':<16}" + "".join(f"{c:>16}" for c in LABELS) + f"{'total':>10}"]
    base = rows.get(against, {})
    for name, r in rows.items():
        lines.append(f"{name:<16}" + "".join(f"{r.get(c, 0):>16.2f}" for c in LABELS)
                     + f"{sum(r.values()):>10.2f}")  # fmt: skip
        if name != against and name != "baseline" and base:
            diff = [r.get(c, 0) - base.get(c, 0) for c in LABELS]
            lines.append(f"{'  - ' + against[:12]:<16}" + "".join(f"{x:>+16.2f}" for x in diff)
                         + f"{sum(diff):>+10.2f}")  # fmt: skip
    return "\n".join(lines)
