"""Inference cost of the depth routing: prefill, cached decode latency, live memory per variant.

    python -m benchmarks.decode [--flavor cpu_small] [--prompt 256] [--new 32] [--batches 1,8]
        [--variants baseline,attnres4,sliced4_r32,projected4_r32,attnresfull] [--rounds 5]
        [--prefills 3] [--modes compiled,eager] [--device cpu] [--json PATH]

Every variant is the project's model at one flavor (so one checkpoint size; timing does not depend
on the weights' values), its weights views of one shared set (``share_weights``), decoding
through ``titan_lrattnres.evaluation.generate``'s KV cache, greedy, in each mode: ``compiled``
(``CompiledForward``: the prefill and the one-token step each one Inductor graph with the reads
fused in; on CPU the step's wrapper in C++, on CUDA the step in a CUDA graph) and
``eager`` (``forward_cached``). Per batch size B and mode a round prefills a ``B x prompt`` prompt
for every variant, the variants taking turns, ``--prefills`` times (each into an empty cache:
compiled, the one cache per size that ``CompiledForward`` keeps, as ``generate`` uses it; their
median is the round's prefill time), in an order that rotates from round to round, then decodes
``new`` tokens with the variants taking single steps in turn. As in ``generate``'s loop, a
round runs with Python's garbage collector paused (``gc_paused``; collected before it) and a
compiled step after the first skips dynamo's guards (``guards=False``). A step's ratio to the
baseline is taken against the baseline's same step (milliseconds apart, so drifts of a shared
machine cancel); a round's decode ratio is the median over its steps. Reported: the median over
rounds with its 95 % bootstrap interval (as ``benchmarks.overhead`` reports them) and range, for
the prefill likewise.
Compilation happens in the warm-up and is reported apart (``warmup_s``).

Memory (counted, not sampled): the KV cache (the same for every variant) and the peak bytes of the
live depth state at a layer of a forward (the stream into the layer and the one out of it: the
read h, the embedding, the completed block sums and their keys, the partial; the baseline keeps
one running sum). The depth state is per step only: nothing of it survives between decode steps.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

import torch

from benchmarks.meta import environment, write
from benchmarks.ops import _sync
from benchmarks.overhead import median_interval, parse_variant

DEFAULT_VARIANTS = ("baseline", "attnres4", "sliced4_r32", "projected4_r32", "attnresfull")


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def depth_state_bytes(*streams) -> int:
    """Bytes of depth streams ``(h, values, keys, partial, partial_key)`` (a layer's input, its
    output; lists or None), storages shared among them counted once."""
    tensors = []
    for stream in streams:
        for item in stream:
            tensors += item if isinstance(item, (list, tuple)) else [item]
    return _bytes(tensors)


def routing_parameter(name: str) -> bool:
    """Whether parameter ``name`` is a routing one: a layer's depth queries, the embedding's
    key projection (P-LR)."""
    return name.endswith(".queries") or name.startswith("embedding_key.")


def share_weights(models) -> None:
    """Make every model's weights views of one donor's (the model with the most weight elements):
    the same values and the same memory for every variant, so no variant gains or loses from
    where its weights were placed (one to several % a step when each model has its own copy).
    A fused ``[W^O; W^K]`` output projection of P-LR holds the others' ``W^O`` as its first rows;
    the routing parameters stay each model's own."""
    donor = max(models, key=lambda m: sum(p.numel() for p in m.parameters()))
    own = dict(donor.named_parameters())
    for model in models:
        if model is donor:
            continue
        for name, p in model.named_parameters():
            d = None if routing_parameter(name) else own.get(name)
            if d is not None and d.shape[1:] == p.shape[1:] and d.shape[0] >= p.shape[0]:
                p.data = d.data[: p.shape[0]]


class Decoder:
    """One variant's model with its depth-state peak recorded at every layer."""

    def __init__(self, name: str, flavor: str, device, seed: int = 0):
        from titan_lrattnres.evaluation.inference import build_model

        variant, blocks, rank = parse_variant(name)
        torch.manual_seed(seed)
        args = {"flavor": flavor, "variant": variant, "blocks": blocks, "rank": rank or 64}
        self.model = build_model(args, device=device)
        self.peak = 0
        run_layers = self.model.run_layers

        self.tracking = True  # off while compiled graphs run (no Python state to look at)

        def tracked(stream, call=None):
            if not self.tracking:
                return run_layers(stream, call)

            def track(layer, *stream):
                out = layer(*stream) if call is None else call(layer, *stream)
                self.peak = max(self.peak, depth_state_bytes(stream, out))
                return out

            return run_layers(stream, track)

        self.model.run_layers = tracked

        self.compiled = None

    def step(self, mode: str):
        """``(tokens, cache) -> logits`` of ``mode`` (compiled: one ``CompiledForward``, kept)."""
        from titan_lrattnres.evaluation.generate import CompiledForward, forward_cached

        if mode == "eager":
            return lambda tokens, cache: forward_cached(self.model, tokens, cache)
        if self.compiled is None:
            self.compiled = CompiledForward(self.model)
        return self.compiled

    def start(self, prompt: torch.Tensor, new: int, device, mode: str = "eager") -> dict:
        """Prefill ``prompt`` into an empty cache with room for ``new`` more tokens (eager: a new
        cache; compiled: the ``CompiledForward``'s kept one, emptied, as ``generate`` does); the
        run's record (seconds, depth-state peak; the peaks are those of the eager path: a
        compiled graph has no Python state). :meth:`decode` then takes one greedy step of it."""
        from titan_lrattnres.evaluation.generate import KVCache

        step = self.step(mode)
        self.tracking = mode == "eager"
        b, t = prompt.shape
        if mode == "compiled":  # step is the CompiledForward
            cache = step.cache(b, t + new)
        else:
            cache = KVCache(self.model, b, t + new)
        self.peak = 0
        _sync(device)
        t0 = time.perf_counter()
        logits = step(prompt, cache)
        _sync(device)
        run = {"prefill_s": time.perf_counter() - t0, "prefill_depth_state_bytes": self.peak}
        self.peak = 0
        run.update(step_s=[], fn=step, cache=cache, device=device)
        run["next"], run["logits"] = logits[:, -1].argmax(-1, keepdim=True), logits
        return run

    def decode(self, run: dict) -> None:
        """One greedy single-token step of ``run`` (timed, appended to its ``step_s``)."""
        fn, options = run["fn"], {}
        if fn is self.compiled:  # as generate's loop does
            options = {"guards": False}  # honoured from the second step on (it checks)
        t0 = time.perf_counter()
        logits = fn(run["next"], run["cache"], **options)
        run["next"] = logits[:, -1].argmax(-1, keepdim=True)
        _sync(run["device"])
        run["step_s"].append(time.perf_counter() - t0)
        run["logits"] = logits.clone()  # a CUDA graph's output lives until its next step

    def finish(self, run: dict) -> dict:
        """The run's record once its steps are taken (checked finite; cache bytes counted)."""
        if not torch.isfinite(run.pop("logits")).all():
            raise RuntimeError("non-finite logits while decoding")
        cache = run.pop("cache")
        for k in ("fn", "next", "device"):
            run.pop(k)
        run["decode_depth_state_bytes"] = self.peak if self.tracking else None
        if not self.tracking:
            run["prefill_depth_state_bytes"] = None
        run["kv_cache_bytes"] = _bytes(list(cache.k.values()) + list(cache.v.values()))
        return run

    def run(self, prompt: torch.Tensor, new: int, device, mode: str = "eager") -> dict:
        """Prefill ``prompt``, then ``new`` greedy single-token steps: seconds and peaks."""
        run = self.start(prompt, new, device, mode)
        for _ in range(new):
            self.decode(run)
        return self.finish(run)


@torch.no_grad()
def compiled_agreement(flavor: str, variant: str, device, *, prompt: int = 8, new: int = 6) -> dict:
    """The compiled path against the eager one, same weights and tokens: a prompt, then ``new``
    single-token steps (the eager path's greedy tokens fed to both), into one static cache and
    then into a second one (on CUDA a new cache is at new addresses: its step graph must be
    recorded anew, never replayed into the first cache's memory). Largest logit difference of
    each and whether the greedy tokens agree."""
    from titan_lrattnres.evaluation.generate import KVCache, forward_cached
    from titan_lrattnres.model.registry import FLAVORS

    d = Decoder(variant, flavor, device)
    d.tracking = False
    fn = d.step("compiled")
    g = torch.Generator().manual_seed(3)
    out = {"variant": variant, "flavor": flavor, "max_abs_diff": [], "tokens_equal": True}
    for _ in range(2):  # another prompt: the second cache's contents differ from the first's
        eager = KVCache(d.model, 2, prompt + new)
        static = KVCache(d.model, 2, prompt + new, static=True)
        tokens = torch.randint(0, FLAVORS[flavor].vocab_size, (2, prompt), generator=g).to(device)
        for _ in range(new + 1):
            want = forward_cached(d.model, tokens, eager)
            got = fn(tokens, static).clone()
            out["max_abs_diff"].append((got - want).abs().max().item())
            nxt = want[:, -1].argmax(-1, keepdim=True)
            out["tokens_equal"] &= bool(torch.equal(got[:, -1].argmax(-1, keepdim=True), nxt))
            tokens = nxt
    out["worst"] = max(out["max_abs_diff"])
    return out


def _p90(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=10)[-1] if len(xs) > 1 else xs[0]


MODES = ("compiled", "eager")


@torch.no_grad()
def measure(
    flavor: str,
    *,
    variants=DEFAULT_VARIANTS,
    prompt: int = 256,
    new: int = 32,
    batches=(1, 8),
    rounds: int = 5,
    modes=MODES,
    device="cpu",
    progress=print,
    on_result=None,
    prefills: int = 3,
) -> dict:
    """``{mode: {batch: {variant: figures}}}``; ``variants`` must include ``"baseline"``. Modes
    run one after the other, each batch size in turn; ``on_result(mode, batch, rows)`` is called
    as each is done (a caller under a time cap keeps what finished). ``prefills``: timed
    prefills per variant and round (a round's prefill time is their median)."""
    from titan_lrattnres.evaluation.generate import gc_paused
    from titan_lrattnres.model.registry import FLAVORS

    if "baseline" not in variants:
        raise ValueError("variants must include 'baseline' (ratios are taken against it)")
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; one of {', '.join(FLAVORS)}")
    if prompt + new > FLAVORS[flavor].max_seq_len:
        raise ValueError(
            f"prompt + new = {prompt + new} > max_seq_len {FLAVORS[flavor].max_seq_len} of {flavor}"
        )
    if prefills < 1:
        raise ValueError(f"prefills must be >= 1, got {prefills}")
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
    decoders = {n: Decoder(n, flavor, device) for n in variants}
    share_weights([d.model for d in decoders.values()])
    vocab = FLAVORS[flavor].vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = {b: torch.randint(0, vocab, (b, prompt), generator=g).to(device) for b in batches}
    out = {m: {} for m in modes}
    for m in modes:
        for b, tokens in prompts.items():
            warmup_s = {}
            for n, d in decoders.items():  # warm-up, the shapes of the rounds: compiles both graphs
                t0 = time.perf_counter()
                d.run(tokens, new, device, m)
                warmup_s[n] = time.perf_counter() - t0
                progress(f"  B={b} warm-up {m} {n}: {warmup_s[n]:.1f} s")
            runs = {n: [] for n in variants}
            order = list(variants)
            for r in range(rounds):
                rotated = _turn(order, r)
                gc.collect()  # the round runs with the collector off, as generate's loop does
                with gc_paused():
                    # every variant prefills in turn, ``prefills`` times (the last fill kept),
                    # then decodes step by step in turn: a ratio compares prefills, and steps,
                    # taken milliseconds apart
                    live, seconds = {}, {n: [] for n in rotated}
                    for i in range(prefills):
                        for n in _turn(rotated, i):
                            live[n] = decoders[n].start(tokens, new, device, m)
                            seconds[n].append(live[n]["prefill_s"])
                    for n in rotated:
                        live[n]["prefill_s"] = statistics.median(seconds[n])
                    for i in range(new):
                        for n in _turn(rotated, i):
                            decoders[n].decode(live[n])
                for n in rotated:
                    runs[n].append(decoders[n].finish(live[n]))
                base = runs["baseline"][-1]
                progress(
                    f"  B={b} round {r + 1}/{rounds} {m}: "
                    + " ".join(
                        f"{n} {runs[n][-1]['prefill_s'] / base['prefill_s']:.3f}/"
                        f"{_step_ratio(runs[n][-1], base):.3f}"
                        for n in variants[1:]
                    )
                    + "  (prefill/decode ratio)"
                )
            out[m][b] = {
                n: {
                    "variant": list(parse_variant(n)),
                    "warmup_s": warmup_s[n],
                    **_summarise(runs[n], runs["baseline"], b),
                }
                for n in variants
            }
            if on_result is not None:
                on_result(m, b, out[m][b])
    return out


def _turn(names: list[str], i: int) -> list[str]:
    """``names`` rotated left by ``i``: turn ``i``'s order."""
    k = i % len(names)
    return names[k:] + names[:k]


def _scaled(n: int | None, unit: int) -> float | None:
    return None if n is None else n / unit


def _step_ratio(run: dict, base: dict) -> float:
    """Median over the steps of a round of the step's time over the baseline's same step."""
    return statistics.median(t / b for t, b in zip(run["step_s"], base["step_s"], strict=True))


def _summarise(runs: list[dict], base: list[dict], batch: int) -> dict:
    steps = [s for r in runs for s in r["step_s"]]
    med_step = [statistics.median(r["step_s"]) for r in runs]
    pre_ratio = [r["prefill_s"] / b["prefill_s"] for r, b in zip(runs, base, strict=True)]
    step_ratio = [_step_ratio(r, b) for r, b in zip(runs, base, strict=True)]
    last = runs[-1]
    return {
        "prefill_s": statistics.median(r["prefill_s"] for r in runs),
        "prefill_ratio": statistics.median(pre_ratio),
        "prefill_ratio_ci95": list(median_interval(pre_ratio)),
        "prefill_ratio_range": [min(pre_ratio), max(pre_ratio)],
        "decode_ms_median": 1e3 * statistics.median(steps),
        "decode_ms_p90": 1e3 * _p90(steps),
        "decode_ratio": statistics.median(step_ratio),
        "decode_ratio_ci95": list(median_interval(step_ratio)),
        "decode_ratio_range": [min(step_ratio), max(step_ratio)],
        "decode_tokens_per_s": batch / statistics.median(med_step),
        "kv_cache_mib": last["kv_cache_bytes"] / 2**20,
        "prefill_depth_state_mib": _scaled(last["prefill_depth_state_bytes"], 2**20),
        "decode_depth_state_kib": _scaled(last["decode_depth_state_bytes"], 2**10),
    }


def table(result: dict) -> str:
    head = (
        f"{'mode':<9}{'B':>2} {'variant':<16}{'prefill s':>10}{'x base':>8}{'decode ms':>10}"
        f"{'p90':>8}{'x base':>8}{'95% CI':>14}{'tok/s':>8}{'KV MiB':>8}{'warm-up s':>10}"
    )
    lines = [head]
    for mode, by_batch in result.items():
        for b, rows in by_batch.items():
            for n, r in rows.items():
                lo, hi = r["decode_ratio_ci95"]
                lines.append(
                    f"{mode:<9}{b:>2} {n:<16}{r['prefill_s']:>10.4f}{r['prefill_ratio']:>8.3f}"
                    f"{r['decode_ms_median']:>10.2f}{r['decode_ms_p90']:>8.2f}"
                    f"{r['decode_ratio']:>8.3f}{f'{lo:.3f}-{hi:.3f}':>14}"
                    f"{r['decode_tokens_per_s']:>8.0f}{r['kv_cache_mib']:>8.2f}{r['warmup_s']:>10.1f}"
                )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--flavor", default="cpu_small")
    p.add_argument("--prompt", type=int, default=256, help="prompt length (training length)")
    p.add_argument("--new", type=int, default=32, help="decoded tokens per round")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prefills", type=int, default=3, help="timed prefills per variant and round")
    p.add_argument("--modes", default=",".join(MODES), help="compiled and / or eager")
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None, help="write the result here")
    a = p.parse_args(argv)
    if a.rounds < 1 or a.new < 2 or a.prompt < 1:
        p.error("--rounds >= 1, --new >= 2 and --prompt >= 1 are needed")
    variants = tuple(v for v in a.variants.split(",") if v)
    batches = tuple(int(b) for b in a.batches.split(","))
    print(
        f"decode: flavor {a.flavor}, prompt {a.prompt}, {a.new} new tokens, batches {batches}, "
        f"{a.rounds} rounds on {a.device}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads"
    )
    done = {}

    def save(mode, batch, rows):  # each (mode, batch) printed and written as it is done
        done.setdefault(mode, {})[batch] = rows
        print(table({mode: {batch: rows}}), flush=True)
        if a.json:
            write(a.json, {"config": dict(vars(a), **environment(a.device)), "result": done})

    try:
        for v in variants:
            parse_variant(v)
        measure(
            a.flavor, variants=variants, prompt=a.prompt, new=a.new, batches=batches,
            rounds=a.rounds, modes=tuple(m for m in a.modes.split(",") if m), device=a.device,
            on_result=save, progress=lambda m: print(m, flush=True), prefills=a.prefills,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        print(f"decode: {e}", file=sys.stderr)
        return 2
    print(table(done))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
