"""Inference cost of the depth routing: prefill, cached decode latency, live memory per variant.

    python -m benchmarks.decode [--flavor cpu_small] [--prompt 256] [--new 32] [--batches 1,8]
        [--variants baseline,attnres4,sliced4_r32,projected4_r32,attnresfull] [--rounds 5]
        [--modes compiled,eager] [--device cpu] [--json PATH]

Every variant is the project's model at one flavor (so one checkpoint size; weights from one seed,
timing does not depend on their values) decoding through ``titan_lrattnres.evaluation.generate``'s
KV cache, greedy, in each mode: ``compiled`` (``CompiledForward``: the prefill and the one-token
step each one Inductor graph with the reads fused in; on CUDA the step in a CUDA graph) and
``eager`` (``forward_cached``). Per batch size B a round times, for every variant in an order that
rotates from round to round, and every mode: the prefill of a ``B x prompt`` prompt, then ``new``
single-token steps. Ratios to the baseline of the same mode are taken within a round (median over
rounds, with the range over rounds), so drifts of a shared machine cancel. Compilation happens in
the warm-up and is reported apart (``compile_s``).

Memory (counted, not sampled): the KV cache (the same for every variant) and the peak bytes of the
live depth state during a forward (embedding, completed block sums and their keys, the partial,
the phase-1 reads of the current block; the baseline keeps one running sum). The depth state is
per step only: nothing of it survives between decode steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from benchmarks.meta import environment, write
from benchmarks.ops import _sync
from benchmarks.overhead import parse_variant

DEFAULT_VARIANTS = ("baseline", "attnres4", "sliced4_r32", "projected4_r32", "attnresfull")


def _bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def depth_state_bytes(state) -> int:
    phase1 = state.phase1 or ((), (), 0)
    return _bytes(
        [state.embedding, state.embedding_key, state.partial, state.partial_key, state.running]
        + list(state.values)
        + list(state.keys)
        + list(phase1[0])
        + list(phase1[1])
    )


class Decoder:
    """One variant's model with its depth-state peak recorded at every read site."""

    def __init__(self, name: str, flavor: str, device, seed: int = 0):
        from titan_lrattnres.evaluation.inference import build_model

        variant, blocks, rank = parse_variant(name)
        torch.manual_seed(seed)
        args = {"flavor": flavor, "variant": variant, "blocks": blocks, "rank": rank or 64}
        self.model = build_model(args, device=device)
        self.peak = 0
        run_depth = self.model.run_depth

        self.tracking = True  # off while compiled graphs run (no Python state to look at)

        def tracked(embedding, sublayer_fn, on_read=None):
            if not self.tracking:
                return run_depth(embedding, sublayer_fn, on_read=on_read)

            def track(j, state):
                self.peak = max(self.peak, depth_state_bytes(state))
                if on_read is not None:
                    on_read(j, state)

            return run_depth(embedding, sublayer_fn, on_read=track)

        self.model.run_depth = tracked

        self.compiled = None

    def step(self, mode: str):
        """``(tokens, cache) -> logits`` of ``mode`` (compiled: one ``CompiledForward``, kept)."""
        from titan_lrattnres.evaluation.generate import CompiledForward, forward_cached

        if mode == "eager":
            return lambda tokens, cache: forward_cached(self.model, tokens, cache)
        if self.compiled is None:
            self.compiled = CompiledForward(self.model)
        return self.compiled

    def run(self, prompt: torch.Tensor, new: int, device, mode: str = "eager") -> dict:
        """Prefill ``prompt``, then ``new`` greedy single-token steps; seconds and peaks (the
        depth-state peaks are those of the eager path: a compiled graph has no Python state)."""
        from titan_lrattnres.evaluation.generate import KVCache

        b = prompt.shape[0]
        step = self.step(mode)
        self.tracking = mode == "eager"
        cache = KVCache(self.model, b, prompt.shape[1] + new, static=mode == "compiled")
        self.peak = 0
        _sync(device)
        t0 = time.perf_counter()
        logits = step(prompt, cache)
        _sync(device)
        prefill, prefill_peak = time.perf_counter() - t0, self.peak
        self.peak, steps = 0, []
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(new):
            t0 = time.perf_counter()
            logits = step(nxt, cache)
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            _sync(device)
            steps.append(time.perf_counter() - t0)
        if not torch.isfinite(logits).all():
            raise RuntimeError("non-finite logits while decoding")
        kv = _bytes(list(cache.k.values()) + list(cache.v.values()))
        return {
            "prefill_s": prefill,
            "step_s": steps,
            "prefill_depth_state_bytes": prefill_peak if self.tracking else None,
            "decode_depth_state_bytes": self.peak if self.tracking else None,
            "kv_cache_bytes": kv,
        }


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
) -> dict:
    """``{mode: {batch: {variant: figures}}}``; ``variants`` must include ``"baseline"``."""
    from titan_lrattnres.model.registry import FLAVORS

    if "baseline" not in variants:
        raise ValueError("variants must include 'baseline' (ratios are taken against it)")
    if flavor not in FLAVORS:
        raise ValueError(f"unknown flavor {flavor!r}; one of {', '.join(FLAVORS)}")
    if prompt + new > FLAVORS[flavor].max_seq_len:
        raise ValueError(
            f"prompt + new = {prompt + new} > max_seq_len {FLAVORS[flavor].max_seq_len} of {flavor}"
        )
    unknown = set(modes) - set(MODES)
    if unknown or not modes:
        raise ValueError(f"modes must be a non-empty subset of {MODES}, got {list(modes)}")
    decoders = {n: Decoder(n, flavor, device) for n in variants}
    vocab = FLAVORS[flavor].vocab_size
    g = torch.Generator().manual_seed(1)
    out = {m: {} for m in modes}
    for b in batches:
        tokens = torch.randint(0, vocab, (b, prompt), generator=g).to(device)
        compile_s = {}
        for n, d in decoders.items():
            for m in modes:  # warm-up, the shapes of the rounds: compiles both graphs
                t0 = time.perf_counter()
                d.run(tokens, new, device, m)
                compile_s[m, n] = time.perf_counter() - t0
                progress(f"  B={b} warm-up {m} {n}: {compile_s[m, n]:.1f} s")
        runs = {(m, n): [] for m in modes for n in variants}
        order = list(variants)
        for r in range(rounds):
            k = r % len(order)
            for n in order[k:] + order[:k]:
                for m in modes:
                    runs[m, n].append(decoders[n].run(tokens, new, device, m))
            for m in modes:
                base = runs[m, "baseline"][-1]
                progress(
                    f"  B={b} round {r + 1}/{rounds} {m}: "
                    + " ".join(
                        f"{n} {runs[m, n][-1]['prefill_s'] / base['prefill_s']:.3f}/"
                        f"{_med(runs[m, n][-1]['step_s']) / _med(base['step_s']):.3f}"
                        for n in variants[1:]
                    )
                    + "  (prefill/decode ratio)"
                )
        for m in modes:
            out[m][b] = {
                n: {
                    "variant": list(parse_variant(n)),
                    "warmup_s": compile_s[m, n],
                    **_summarise(runs[m, n], runs[m, "baseline"], b),
                }
                for n in variants
            }
    return out


def _scaled(n: int | None, unit: int) -> float | None:
    return None if n is None else n / unit


def _med(xs) -> float:
    return statistics.median(xs)


def _summarise(runs: list[dict], base: list[dict], batch: int) -> dict:
    steps = [s for r in runs for s in r["step_s"]]
    med_step = [statistics.median(r["step_s"]) for r in runs]
    pre_ratio = [r["prefill_s"] / b["prefill_s"] for r, b in zip(runs, base, strict=True)]
    prefill = [r["prefill_s"] for r in runs]
    step_ratio = [
        statistics.median(r["step_s"]) / statistics.median(b["step_s"])
        for r, b in zip(runs, base, strict=True)
    ]
    last = runs[-1]
    return {
        "prefill_s": statistics.median(prefill),
        "prefill_ratio": statistics.median(pre_ratio),
        "prefill_ratio_range": [min(pre_ratio), max(pre_ratio)],
        "decode_ms_median": 1e3 * statistics.median(steps),
        "decode_ms_p90": 1e3 * _p90(steps),
        "decode_ratio": statistics.median(step_ratio),
        "decode_ratio_range": [min(step_ratio), max(step_ratio)],
        "decode_tokens_per_s": batch / statistics.median(med_step),
        "kv_cache_mib": last["kv_cache_bytes"] / 2**20,
        "prefill_depth_state_mib": _scaled(last["prefill_depth_state_bytes"], 2**20),
        "decode_depth_state_kib": _scaled(last["decode_depth_state_bytes"], 2**10),
    }


def table(result: dict) -> str:
    head = (
        f"{'mode':<9}{'B':>2} {'variant':<16}{'prefill s':>10}{'x base':>8}{'decode ms':>10}"
        f"{'p90':>8}{'x base':>8}{'range':>14}{'tok/s':>8}{'KV MiB':>8}{'warm-up s':>10}"
    )
    lines = [head]
    for mode, by_batch in result.items():
        for b, rows in by_batch.items():
            for n, r in rows.items():
                lo, hi = r["decode_ratio_range"]
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
    try:
        for v in variants:
            parse_variant(v)
        result = measure(
            a.flavor, variants=variants, prompt=a.prompt, new=a.new, batches=batches,
            rounds=a.rounds, modes=tuple(m for m in a.modes.split(",") if m), device=a.device,
        )  # fmt: skip
    except (ValueError, RuntimeError) as e:
        print(f"decode: {e}", file=sys.stderr)
        return 2
    print(table(result))
    if a.json:
        write(a.json, {"config": dict(vars(a), **environment(a.device)), "result": result})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
