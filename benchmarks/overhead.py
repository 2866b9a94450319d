"""Step-time overhead of the routed model over the plain residual, on the project's own model.

    python -m benchmarks.overhead --layers 12 --dim 512 --seq 1024 [--heads 8] [--batch 1]
        [--device cpu|cuda] [--dtype fp32|bf16] [--rounds 9] [--optimizer] [--cuda-graphs]
        [--variants baseline,block8,...] [--json PATH]

Every variant is the real ``LRAttnResModel`` (``titan_lrattnres.registry``), each sublayer
compiled with ``fullgraph=True`` through torchtitan's own ``apply_compile`` (inductor), weights
initialised from one seed. A round times one forward + backward (+ AdamW step with
``--optimizer``) of every variant, in an order that rotates from round to round; the overhead of
a variant is its time over the baseline's WITHIN the round, and the report gives the median over
rounds with the range. Rounds cancel slow drifts of a shared machine (frequency, other load) that
a ratio of separate medians would not. Checked before timing: every variant's loss is finite.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.ops import _sync

# name: (variant, blocks, rank); standard AttnRes has r = d. Any other name of the form
# {attnres|sliced|projected}{N|full}[_r{R}] (e.g. sliced4_r32) is parsed by ``parse_variant``.
VARIANTS = {
    "baseline": ("baseline", None, 0),
    "block8": ("attnres", 8, 0),
    "sliced8_r64": ("sliced", 8, 64),
    "projected8_r32": ("projected", 8, 32),
    "full": ("attnres", None, 0),
}
_NAME = re.compile(r"(attnres|sliced|projected)(\d+|full)(?:_r(\d+))?")


def parse_variant(name: str) -> tuple[str, int | None, int]:
    """``(variant, blocks or None, rank)`` of a variant name."""
    if name in VARIANTS:
        return VARIANTS[name]
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(
            f"unknown variant {name!r}: use one of {', '.join(VARIANTS)} or "
            "{attnres|sliced|projected}{N|full}[_r{R}], e.g. sliced4_r32"
        )
    blocks = None if m[2] == "full" else int(m[2])
    return m[1], blocks, int(m[3] or 0)


DEFAULT_VARIANTS = tuple(VARIANTS)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Shape:
    layers: int
    dim: int
    seq: int
    heads: int = 8
    batch: int = 1
    vocab: int = 4096
    hidden: int | None = None  # SwiGLU hidden; default 11d/4 rounded up to a multiple of 64

    @property
    def hidden_dim(self) -> int:
        return self.hidden or -(-11 * self.dim // 4 // 64) * 64


def build(name: str, shape: Shape, device, dtype, compile_: bool = True, seed: int = 0):
    """The project's model for variant ``name``, weights from ``seed``, sublayers compiled."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    from titan_lrattnres.registry import Flavor, build_model_config

    variant, blocks, rank = parse_variant(name)
    flavor = Flavor(
        dim=shape.dim,
        n_layers=shape.layers,
        n_heads=shape.heads,
        hidden_dim=shape.hidden_dim,
        vocab_size=shape.vocab,
        max_seq_len=shape.seq,
    )
    torch.manual_seed(seed)
    attn = "sdpa" if torch.device(device).type == "cpu" else "flex"
    blocks = None if blocks is None else min(blocks, 2 * shape.layers)
    config = build_model_config(
        flavor, variant=variant, blocks=blocks, rank=min(rank or 64, shape.dim), attn_backend=attn
    )
    model = config.build()
    model.to(device=device)
    model.init_states(buffer_device=torch.device(device))
    for pname, param in model.named_parameters():  # not the buffers: RoPE's are complex
        if not pname.startswith("router.query_"):  # fp32 queries (SPEC §2), as in mixed precision
            param.data = param.data.to(dtype)
    model.train()
    if compile_:

        class _Dims:  # the one attribute apply_compile reads from ParallelDims
            tp_enabled = False

        apply_compile(
            model,
            compile_config=CompileConfig(enable=True, backend="inductor"),
            parallel_dims=_Dims,
        )
    return model


class Step:
    """One training step of a model on fixed tokens: forward, loss, backward (+ AdamW)."""

    def __init__(self, model, tokens, targets, optimizer: bool, cuda_graph: bool):
        self.model, self.tokens, self.targets = model, tokens, targets
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer else None
        self.graph = None
        self.loss = None
        if cuda_graph:
            self._capture()

    def eager(self):
        loss = F.cross_entropy(self.model(self.tokens).flatten(0, 1).float(), self.targets)
        loss.backward()
        if self.opt is not None:
            self.opt.step()
        self.model.zero_grad(set_to_none=self.graph is None)
        return loss

    def _capture(self):
        # PyTorch's whole-network capture recipe: warm up on a side stream, then capture once.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                self.eager()
        torch.cuda.current_stream().wait_stream(side)
        self.model.zero_grad(set_to_none=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.loss = F.cross_entropy(self.model(self.tokens).flatten(0, 1).float(), self.targets)
            self.loss.backward()
            if self.opt is not None:
                self.opt.step()
        self.graph = graph

    def __call__(self):
        if self.graph is not None:
            self.graph.replay()
            return self.loss
        return self.eager()


def _timed(step, device) -> float:
    _sync(device)
    t0 = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - t0


def measure(
    shape: Shape,
    *,
    device="cpu",
    dtype=torch.float32,
    variants=DEFAULT_VARIANTS,
    rounds: int = 9,
    warmup: int = 2,
    optimizer: bool = False,
    cuda_graphs: bool = False,
    compile_: bool = True,
    progress=print,
) -> dict:
    """Per variant: step seconds per round, overhead % over the baseline per round, median and
    range. ``variants`` must include ``"baseline"``."""
    if "baseline" not in variants:
        raise ValueError("variants must include 'baseline' (ratios are taken against it)")
    for name in variants:
        parse_variant(name)  # a bad name fails before anything is built
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, shape.vocab, (shape.batch, shape.seq + 1), generator=g).to(device)
    tokens, targets = data[:, :-1].contiguous(), data[:, 1:].flatten().contiguous()
    steps = {}
    for name in variants:
        t0 = time.perf_counter()
        model = build(name, shape, device, dtype, compile_)
        step = Step(model, tokens, targets, optimizer, cuda_graphs)
        for _ in range(warmup):
            loss = step()
        _sync(device)
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"{name}: non-finite loss {loss.item()} before timing")
        steps[name] = step
        progress(f"  built + warmed {name:<15} {time.perf_counter() - t0:6.1f} s")
    times = {n: [] for n in variants}
    order = list(variants)
    for r in range(rounds):
        k = r % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(_timed(steps[name], device))
        base = times["baseline"][-1]
        progress(
            f"  round {r + 1}/{rounds}: "
            + " ".join(f"{n} {100 * (times[n][-1] / base - 1):+.1f}%" for n in variants[1:])
        )
    result = {}
    for name in variants:
        pct = [100 * (t / b - 1) for t, b in zip(times[name], times["baseline"], strict=True)]
        result[name] = {
            "variant": parse_variant(name),
            "step_s": times[name],
            "median_step_s": statistics.median(times[name]),
            "overhead_pct": pct,
            "median_overhead_pct": statistics.median(pct),
            "min_overhead_pct": min(pct),
            "max_overhead_pct": max(pct),
            "tokens_per_s": shape.batch * shape.seq / statistics.median(times[name]),
        }
    return result


def table(result: dict) -> str:
    lines = [
        f"{'variant':<16}{'(variant, blocks, r)':<26}{'median step s':>14}{'overhead':>10}"
        f"{'range':>18}{'tokens/s':>11}",
    ]
    for name, r in result.items():
        span = f"[{r['min_overhead_pct']:+.1f}, {r['max_overhead_pct']:+.1f}]"
        lines.append(
            f"{name:<16}{str(tuple(r['variant'])):<26}{r['median_step_s']:>14.4f}"
            f"{r['median_overhead_pct']:>+9.1f}%"
            f"{span:>18}"
            f"{r['tokens_per_s']:>11.0f}"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", action="store_true", help="include an AdamW step")
    p.add_argument("--cuda-graphs", action="store_true", help="capture the step (CUDA only)")
    p.add_argument("--no-compile", action="store_true", help="eager sublayers (debugging)")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="CPU: leave glibc's allocator as it is (default: the trainer's CPU setting, "
        "titan_lrattnres.cpu.keep_freed_memory)",
    )
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    if a.cuda_graphs and torch.device(a.device).type != "cuda":
        p.error("--cuda-graphs needs --device cuda")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    shape = Shape(a.layers, a.dim, a.seq, a.heads, a.batch, a.vocab, a.hidden)
    kept = False
    if torch.device(a.device).type == "cpu" and not a.system_malloc:
        from titan_lrattnres.cpu import keep_freed_memory

        kept = keep_freed_memory()  # what the CPU trainer runs with
    variants = tuple(v for v in a.variants.split(",") if v)
    print(
        f"overhead: L={shape.layers} d={shape.dim} T={shape.seq} B={shape.batch} heads="
        f"{shape.heads} hidden={shape.hidden_dim} vocab={shape.vocab} {a.dtype} on {a.device}, "
        f"{a.rounds} rounds, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"freed memory kept mapped: {kept}"
    )
    try:
        result = measure(
            shape,
            device=a.device,
            dtype=DTYPES[a.dtype],
            variants=variants,
            rounds=a.rounds,
            warmup=a.warmup,
            optimizer=a.optimizer,
            cuda_graphs=a.cuda_graphs,
            compile_=not a.no_compile,
        )
    except (ValueError, RuntimeError) as e:
        print(f"overhead: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if a.json:
        meta = dict(vars(a), hidden=shape.hidden_dim, torch=torch.__version__,
                    threads=torch.get_num_threads(), machine=platform.machine(),
                    freed_memory_kept=kept)  # fmt: skip
        with open(a.json, "w") as f:
            json.dump({"config": meta, "result": result}, f, indent=1)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
