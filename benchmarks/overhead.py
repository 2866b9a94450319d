"""Step-time overhead of the routed model over the plain residual and torchtitan's decoder.

    python -m benchmarks.overhead --layers 12 --dim 512 --seq 1024 [--heads 8] [--batch 1]
        [--device cpu|cuda] [--dtype fp32|bf16] [--rounds 9] [--optimizer] [--cuda-graphs]
        [--ac none|selective|full] [--variants torchtitan,baseline,block8,...] [--profile]
        [--json PATH]

Every variant is the real ``LRAttnResModel`` (``titan_lrattnres.model.registry``): L layers in
``model.layers``, each compiled with ``fullgraph=True`` (inductor) as the trainer compiles them
(``titan_lrattnres.parallel.compile.compile_layers``: torchtitan's ``apply_compile``), after
torchtitan's activation checkpointing of each layer (``--ac``), weights initialised from one
seed. Variant ``torchtitan`` is torchtitan's own decoder of the same shape (``Llama3Model``, one
``TransformerBlock`` per layer, checkpointed and compiled by torchtitan the same way): the step
a user would otherwise run. A round times one forward + backward (+ AdamW step
with ``--optimizer``) of every variant, in an order that rotates from round to round; a
variant's ratio to the baseline and to torchtitan's decoder is taken WITHIN the round, and the
report gives the median over rounds with the range. Rounds cancel slow drifts of a shared
machine (frequency, other load) that a ratio of separate medians would not. A round runs with
Python's cyclic garbage collector off (a collection between rounds), as torchtitan's Trainer
runs its steps. Checked before timing: every variant's loss is finite.

How sure a run is: each median comes with a 95 % bootstrap interval (rounds resampled with
replacement) and the number of rounds at which the interval over the baseline would narrow to
+-2 points. Once per round a fixed workload (matmuls and a 32 MB copy, ~0.04 s on the 2-core
CPU) is timed too: its scatter is the machine's own noise, which no choice of kernels removes.
``--from-json PATH [PATH...]`` re-prints saved runs' table with these statistics, pooling the
rounds of several runs. ``--profile``: after the rounds, one profiled step per variant, its
time by class of work (``benchmarks.step_profile``). ``--ac none|selective|full``: torchtitan's
activation checkpointing of every layer (the paper's configs train with selective).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import random
import re
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.meta import environment, write
from benchmarks.ops import _sync
from titan_lrattnres.evaluation.generate import gc_paused
from titan_lrattnres.evaluation.memory import AC_MODES  # noqa: F401  (benchmarks.overhead.AC_MODES)

# name: (variant, blocks, rank); standard AttnRes has r = d. Any other name of the form
# {attnres|sliced|projected}{N|full}[_r{R}] (e.g. sliced4_r32) is parsed by ``parse_variant``.
# ``torchtitan``: torchtitan's own decoder (``Llama3Model``) of the same shape, built from the
# baseline's attention, MLP, norm, embedding and head configs: what a user would otherwise run.
# ``baseline_unshared``: the baseline with a graph of its own for every layer (each layer's
# forward its own code object), as layers that differ in their inputs compile: what L distinct
# compiled units cost a step against one shared by all layers, whatever the layers compute.
VARIANTS = {
    "torchtitan": ("torchtitan", None, 0),
    "baseline": ("baseline", None, 0),
    "baseline_unshared": ("baseline", None, 0),
    "block8": ("attnres", 8, 0),
    "sliced8_r64": ("sliced", 8, 64),
    "projected8_r32": ("projected", 8, 32),
    "full": ("attnres", None, 0),
}
_NAME = re.compile(r"(attnres|sliced|projected)(\d+|full)(?:_r(\d+))?")


def parse_variant(name: str) -> tuple[str, int | None, int]:
    """``(variant, blocks or None, rank)`` of a variant name (an ``@backend`` suffix aside)."""
    name = name.partition("@")[0]
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


DEFAULT_VARIANTS = tuple(v for v in VARIANTS if v != "baseline_unshared")
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

    @staticmethod
    def add_arguments(p, *, layers: int, dim: int, seq: int, heads: int, hidden: bool = False):
        """A step benchmark's shape options on parser ``p``: ``--layers --dim --seq --heads
        --batch --vocab`` (and ``--hidden`` if ``hidden``), with these defaults; read back by
        :meth:`of`."""
        p.add_argument("--layers", type=int, default=layers)
        p.add_argument("--dim", type=int, default=dim)
        p.add_argument("--seq", type=int, default=seq)
        p.add_argument("--heads", type=int, default=heads)
        p.add_argument("--batch", type=int, default=1)
        p.add_argument("--vocab", type=int, default=4096)
        if hidden:
            p.add_argument("--hidden", type=int, default=None)

    @classmethod
    def of(cls, a) -> Shape:
        """The shape parsed from :meth:`add_arguments`' options."""
        return cls(a.layers, a.dim, a.seq, a.heads, a.batch, a.vocab, getattr(a, "hidden", None))


def torchtitan_decoder_config(config):
    """torchtitan's ``Llama3Model`` config with the layers, norms, embedding and head of the
    project's baseline ``config``: one ``Llama3TransformerBlock`` per layer, of its attention,
    MLP and norms."""
    from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock

    layers = [
        Llama3TransformerBlock.Config(
            attention=c.attention, feed_forward=c.feed_forward, attention_norm=c.attention_norm,
            ffn_norm=c.ffn_norm,
        )
        for c in config.layers
    ]  # fmt: skip
    return Llama3Model.Config(
        dim=config.dim, vocab_size=config.vocab_size, lm_head=config.lm_head,
        tok_embeddings=config.tok_embeddings, norm=config.norm, layers=layers,
    )  # fmt: skip


def build(
    name: str, shape: Shape, device, dtype, compile_: bool = True, seed: int = 0, attn=None,
    ac: str = "none", backend: str = "inductor",
):  # fmt: skip
    """The model for variant ``name`` (the project's, or torchtitan's decoder of the same
    shape), weights from ``seed``, activation checkpointing ``ac`` as torchtitan applies it to
    each entry of ``model.layers``, those entries compiled (``fullgraph=True``, torch.compile
    ``backend``) as the trainer compiles them (torchtitan's ``apply_compile``; for the project's
    model through ``titan_lrattnres.parallel.compile.compile_layers``); attention ``attn``
    (default: SDPA on CPU, FlexAttention on GPU). The depth queries stay fp32, as under mixed
    precision. ``<variant>@<backend>`` (e.g. ``block8@compiled``) runs the reads with that
    ``custom_ops`` backend (default ``auto``: on CPU the ``inductor`` read, aten ops with a
    written-out backward that Inductor compiles with the layer; ``compiled``: phase 1 as the
    registered op; ``reference``: the eager reference's ops)."""
    from torchtitan.config import CompileConfig
    from torchtitan.distributed.compile import apply_compile

    from titan_lrattnres.evaluation.memory import apply_ac
    from titan_lrattnres.model.model import plan_forward
    from titan_lrattnres.model.registry import Flavor, build_model_config
    from titan_lrattnres.parallel.compile import compile_layers

    name, _, depth_backend = name.partition("@")
    variant, blocks, rank = parse_variant(name)
    titan = variant == "torchtitan"
    variant = "baseline" if titan else variant
    flavor = Flavor(
        dim=shape.dim,
        n_layers=shape.layers,
        n_heads=shape.heads,
        hidden_dim=shape.hidden_dim,
        vocab_size=shape.vocab,
        max_seq_len=shape.seq,
    )
    torch.manual_seed(seed)
    attn = attn or ("sdpa" if torch.device(device).type == "cpu" else "flex")
    blocks = None if blocks is None else min(blocks, 2 * shape.layers)
    config = build_model_config(
        flavor,
        variant=variant,
        blocks=blocks,
        rank=min(rank or 64, shape.dim),
        attn_backend=attn,
        depth_backend=depth_backend or "auto",
    )
    model = (torchtitan_decoder_config(config) if titan else config).build()
    model.to(device=device)
    model.init_states(buffer_device=torch.device(device))
    for pname, param in model.named_parameters():  # not the buffers: RoPE's are complex
        if not pname.endswith("queries"):  # fp32 queries, as in mixed precision
            param.data = param.data.to(dtype)
    model.train()
    if name == "baseline_unshared":  # one plan, hence one graph, per layer
        for i, layer in enumerate(model.layers.values()):
            layer.plan_key = ("baseline", "unshared", i)
            plan_forward(layer, layer)
    apply_ac(model, ac)
    if compile_:

        class _Dims:  # the one attribute apply_compile reads from ParallelDims
            tp_enabled = False

        config = CompileConfig(enable=True, backend=backend)
        if titan:
            apply_compile(model, compile_config=config, parallel_dims=_Dims)
        else:  # the model spec's: apply_compile after a forward per layer plan for AC wrappers
            compile_layers(model, config, _Dims)
    return model


def attention_kwargs(model, tokens) -> dict:
    """The forward's attention masks: FlexAttention's ``BlockMask`` (causal, one document per
    row), built once as the Trainer builds one per batch; SDPA needs none."""
    from torchtitan.models.common.attention import FlexAttention

    if not isinstance(model.config.first_attention.inner_attention, FlexAttention.Config):
        return {}
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).expand(b, t)
    return {"attention_masks": model.get_attention_masks(positions)}


class Step:
    """One training step of a model on fixed tokens: forward, loss, backward (+ AdamW)."""

    def __init__(self, model, tokens, targets, optimizer: bool, cuda_graph: bool, pool=None):
        """``pool``: a ``torch.cuda.graph_pool_handle()`` the capture shares with other steps'
        (replayed in the order they were captured, never concurrently); None: a private one."""
        self.model, self.tokens, self.targets = model, tokens, targets
        self.pool = pool
        self.kwargs = attention_kwargs(model, tokens)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer else None
        self.graph = None
        self.loss = None
        if cuda_graph:
            self._capture()

    def _loss(self):
        logits = self.model(self.tokens, **self.kwargs)
        return F.cross_entropy(logits.flatten(0, 1).float(), self.targets)

    def eager(self):
        loss = self._loss()
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
        with torch.cuda.graph(graph, pool=self.pool):
            self.loss = self._loss()
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


def _probe(device) -> Callable[[], None]:
    """A fixed workload (matmuls and a copy) whose time moves only with the machine."""
    a = torch.randn(512, 512, device=device)
    x = torch.empty(8 * 2**20, device=device)  # 32 MB fp32
    y = torch.empty_like(x)

    def run():
        for _ in range(8):
            torch.mm(a, a)
            y.copy_(x)

    return run


def median_interval(values, resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median of ``values`` (deterministic: seeded)."""
    rng = random.Random(seed)
    n = len(values)
    meds = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[int(0.975 * resamples) - 1]


def rounds_for(rounds: int, interval: tuple[float, float], halfwidth: float = 2.0) -> int | None:
    """Rounds at which a median's 95 % ``interval`` from ``rounds`` rounds would be
    +-``halfwidth`` points (it narrows as 1/sqrt(rounds)); None when it is degenerate."""
    lo, hi = interval
    if hi - lo <= 0:
        return None
    return math.ceil(rounds * ((hi - lo) / 2 / halfwidth) ** 2)


def summarize(times: dict[str, list[float]], variants, shape: Shape) -> dict:
    """Per variant: step seconds per round; overhead % over the baseline per round, its median,
    range, 95 % interval of the median and the rounds a +-2-point interval needs; with
    ``torchtitan`` among the variants, the overhead % over torchtitan's decoder per round, its
    median and 95 % interval."""
    result = {}

    def pct(name, against):  # per round, % over ``against`` within the round
        return [100 * (t / b - 1) for t, b in zip(times[name], times[against], strict=True)]

    for name in variants:
        over = pct(name, "baseline")
        lo, hi = median_interval(over)
        titan = {}
        if "torchtitan" in times:  # the same ratios against torchtitan's own decoder
            tt = pct(name, "torchtitan")
            titan = {"overhead_vs_torchtitan_pct": tt,
                     "median_overhead_vs_torchtitan_pct": statistics.median(tt),
                     "ci95_overhead_vs_torchtitan_pct": list(median_interval(tt))}  # fmt: skip
        result[name] = {
            **titan,
            "variant": parse_variant(name),
            "step_s": times[name],
            "median_step_s": statistics.median(times[name]),
            "overhead_pct": over,
            "median_overhead_pct": statistics.median(over),
            "min_overhead_pct": min(over),
            "max_overhead_pct": max(over),
            "ci95_overhead_pct": [lo, hi],
            "rounds_for_2_points": None if name == "baseline" else rounds_for(len(over), (lo, hi)),
            "tokens_per_s": shape.batch * shape.seq / statistics.median(times[name]),
        }
    return result


def noise(probe_s: list[float]) -> dict:
    """The fixed workload's scatter: robust standard deviation (1.4826 MAD) in % of its median."""
    med = statistics.median(probe_s)
    dev = [100 * (t / med - 1) for t in probe_s]
    mad = statistics.median(abs(d) for d in dev)
    return {"probe_s": probe_s, "median_s": med, "robust_sd_pct": 1.4826 * mad,
            "min_pct": min(dev), "max_pct": max(dev)}  # fmt: skip


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
    ac: str = "none",
    profile: bool = False,
    progress=print,
) -> dict:
    """``summarize`` of the timed rounds, plus ``"_machine_noise"``: ``noise`` of the fixed
    workload timed once per round. ``variants`` must include ``"baseline"``."""
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
        model = build(name, shape, device, dtype, compile_, ac=ac)
        step = Step(model, tokens, targets, optimizer, cuda_graphs)
        for _ in range(warmup):
            loss = step()
        _sync(device)
        if not torch.isfinite(loss).item():
            raise RuntimeError(f"{name}: non-finite loss {loss.item()} before timing")
        steps[name] = step
        progress(f"  built + warmed {name:<15} {time.perf_counter() - t0:6.1f} s")
    times = {n: [] for n in variants}
    probe, probe_s = _probe(device), []
    probe()
    order = list(variants)
    for r in range(rounds):
        k = r % len(order)
        # Python's cyclic collector off while a round runs, as torchtitan's Trainer trains
        # (``GarbageCollection``: off, a collection every ``gc_freq`` steps): a collection set off
        # by whichever step allocates at the time would land on that variant's time
        gc.collect()
        with gc_paused():
            for name in order[k:] + order[:k]:
                times[name].append(_timed(steps[name], device))
        probe_s.append(_timed(probe, device))
        base = times["baseline"][-1]
        progress(
            f"  round {r + 1}/{rounds}, over the baseline: "
            + " ".join(
                f"{n} {100 * (times[n][-1] / base - 1):+.1f}%" for n in variants if n != "baseline"
            )
            + f" (fixed workload {probe_s[-1]:.3f} s)"
        )
    result = {**summarize(times, variants, shape), "_machine_noise": noise(probe_s)}
    if profile:  # one more step of each, profiled: where its time goes
        from benchmarks.step_profile import profile_step

        result["_profile_ms"] = {name: profile_step(steps[name], device) for name in variants}
    return result


def _ratio(pct: float) -> str:
    return f"{1 + pct / 100:.3f}x"


def _ratio_interval(interval) -> str:
    lo, hi = interval
    return f"[{1 + lo / 100:.3f}, {1 + hi / 100:.3f}]"


def table(result: dict) -> str:
    """One row per variant: its median step, tokens/s, and its step time as a ratio over
    torchtitan's decoder and over the project's baseline (median of the per-round ratios, 95 %
    interval; over the baseline also the range and the rounds a +-2-point interval needs)."""
    w = max([16, *(len(n) + 2 for n in result if not n.startswith("_"))])
    lines = [
        f"{'variant':<{w}}{'(variant, blocks, r)':<26}{'median step s':>14}{'tokens/s':>11}"
        f"{'over torchtitan':>17}{'95% interval':>18}{'over baseline':>15}{'95% interval':>18}"
        f"{'range':>18}{'rounds for +-2':>15}",
    ]
    for name, r in result.items():
        if name.startswith("_"):
            continue
        titan = f"{'-':>17}{'':>18}"
        if "median_overhead_vs_torchtitan_pct" in r:
            titan = (f"{_ratio(r['median_overhead_vs_torchtitan_pct']):>17}"
                     f"{_ratio_interval(r['ci95_overhead_vs_torchtitan_pct']):>18}")  # fmt: skip
        span = _ratio_interval((r["min_overhead_pct"], r["max_overhead_pct"]))
        need = r["rounds_for_2_points"]
        lines.append(
            f"{name:<{w}}{str(tuple(r['variant'])):<26}{r['median_step_s']:>14.4f}"
            f"{r['tokens_per_s']:>11.0f}{titan}{_ratio(r['median_overhead_pct']):>15}"
            f"{_ratio_interval(r['ci95_overhead_pct']):>18}{span:>18}"
            f"{'-' if need is None else need:>15}"
        )
    m = result.get("_machine_noise")
    if m is not None:
        lines.append(
            f"machine noise: a fixed workload of {m['median_s']:.3f} s scattered "
            f"{m['robust_sd_pct']:.1f} % (robust sd) [{m['min_pct']:+.1f}, {m['max_pct']:+.1f}] "
            f"over {len(m['probe_s'])} rounds"
        )
    return "\n".join(lines)


_SAME = ("layers", "dim", "seq", "heads", "batch", "vocab", "hidden", "device", "dtype",
         "optimizer", "cuda_graphs", "no_compile", "system_malloc", "ac")  # fmt: skip


def rescore(paths: list[str]) -> dict:
    """Saved runs re-summarized, their rounds pooled (each round's ratio stands alone, so runs
    of one configuration pool into one sample). Refuses runs of different configurations."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    c = runs[0]["config"]
    names = [n for n in runs[0]["result"] if not n.startswith("_")]
    for path, run in zip(paths, runs, strict=True):
        diff = [k for k in _SAME if run["config"].get(k) != c.get(k)]
        if diff or [n for n in run["result"] if not n.startswith("_")] != names:
            raise ValueError(
                f"{path} is not a run of {paths[0]}'s configuration ({diff or 'variants'})"
            )
    shape = Shape(c["layers"], c["dim"], c["seq"], c["heads"], c["batch"], c["vocab"], c["hidden"])
    out = summarize({n: [t for run in runs for t in run["result"][n]["step_s"]] for n in names},
                    names, shape)  # fmt: skip
    probes = [t for run in runs for t in run["result"].get("_machine_noise", {}).get("probe_s", [])]
    if probes:
        out["_machine_noise"] = noise(probes)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    Shape.add_arguments(p, layers=12, dim=512, seq=1024, heads=8, hidden=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--optimizer", action="store_true", help="include an AdamW step")
    p.add_argument(
        "--ac", choices=AC_MODES, default="none",
        help="activation checkpointing of every layer, as torchtitan applies it; the paper's "
        "configs train with selective",
    )  # fmt: skip
    p.add_argument("--cuda-graphs", action="store_true", help="capture the step (CUDA only)")
    p.add_argument("--no-compile", action="store_true", help="eager layers (debugging)")
    p.add_argument(
        "--system-malloc",
        action="store_true",
        help="CPU: leave glibc's allocator as it is (default: the trainer's CPU setting, "
        "titan_lrattnres.training.cpu.keep_freed_memory)",
    )
    p.add_argument(
        "--variants", default=",".join(DEFAULT_VARIANTS),
        help="comma-separated: torchtitan (its decoder), baseline, block8, sliced8_r64, ... "
        "({attnres|sliced|projected}{N|full}[_r{R}])",
    )  # fmt: skip
    p.add_argument(
        "--profile", action="store_true",
        help="after the rounds, one profiled step per variant: its time by class of work",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the result here")
    p.add_argument(
        "--from-json", nargs="+", default=None, metavar="PATH",
        help="print saved runs' table (several: their rounds pooled); time nothing",
    )  # fmt: skip
    a = p.parse_args(argv)
    if a.from_json:
        try:
            print(table(rescore(a.from_json)))
        except (OSError, ValueError, KeyError) as e:
            print(f"overhead: {e}", file=sys.stderr)
            return 2
        return 0
    if a.cuda_graphs and torch.device(a.device).type != "cuda":
        p.error("--cuda-graphs needs --device cuda")
    if a.rounds < 1:
        p.error("--rounds must be >= 1")
    shape = Shape.of(a)
    kept = False
    if torch.device(a.device).type == "cpu" and not a.system_malloc:
        from titan_lrattnres.training.cpu import keep_freed_memory

        kept = keep_freed_memory()  # what the CPU trainer runs with
    variants = tuple(v for v in a.variants.split(",") if v)
    print(
        f"overhead: L={shape.layers} d={shape.dim} T={shape.seq} B={shape.batch} heads="
        f"{shape.heads} hidden={shape.hidden_dim} vocab={shape.vocab} {a.dtype} on {a.device}, "
        f"AC {a.ac}, {a.rounds} rounds, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads, "
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
            ac=a.ac,
            profile=a.profile,
        )
    except (ValueError, RuntimeError) as e:
        print(f"overhead: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if a.profile:
        from benchmarks.step_profile import profile_table

        rows = result["_profile_ms"]
        print(profile_table(rows, "torchtitan" if "torchtitan" in rows else "baseline"))
    if a.json:
        meta = dict(vars(a), hidden=shape.hidden_dim, **environment(a.device),
                    freed_memory_kept=kept, rounds_collector="off")  # fmt: skip
        write(a.json, {"config": meta, "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
